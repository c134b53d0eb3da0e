"""How pinpool behaves as a library among others: its logger, its messages when something it
needs is missing, and its defaults when several data-parallel ranks share a host."""

from __future__ import annotations

import logging
import os

import pytest
from conftest import run_python

import pinpool
from pinpool._main.settings.arguments import local_world_size
from pinpool._main.settings.arguments import worker_copy_threads as _worker_copy_threads


def test_the_pinpool_logger_is_silent_unless_configured() -> None:
    logger = logging.getLogger("pinpool")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)


NOTES_ONCE = """
import logging
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("pinpool").addHandler(Keep())
logging.getLogger("pinpool").setLevel(logging.DEBUG)
import pinpool
pools = [pinpool.PinPool(4096, 2) for _ in range(3)]  # no device visible
assert all(p.memory != "pinned" and p.notes for p in pools), [p.notes for p in pools]
warnings = [m for m in records if "CUDA" in m]
debug = [m for m in records if m.startswith("pool of 8192 bytes")]
print(len(warnings), len(debug))
"""


def test_a_note_every_pool_gets_is_logged_once_per_process() -> None:
    proc = run_python(NOTES_ONCE, CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1", "3"], proc.stdout  # one warning; a debug line per pool


def test_the_dataloader_without_torch_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pinpool\n"
        "pool = pinpool.PinPool(4096, 1, device='cpu')  # the pool needs no torch\n"
        "for name in ('DataLoader', 'pinned', 'Pinned'):\n"
        "    try:\n"
        "        getattr(pinpool, name)\n"
        "    except ImportError as exc:\n"
        "        print(exc)\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 3, proc.stdout
    for name, line in zip(("DataLoader", "pinned", "Pinned"), lines, strict=True):
        assert f"pinpool.{name} needs PyTorch" in line and "pip install 'torch>=2.6,<2.16'" in line


def test_the_bench_without_its_extras_says_what_to_install() -> None:
    proc = run_python("import sys; sys.modules['tqdm'] = None\nimport pinpool.bench")
    assert proc.returncode != 0
    assert "pip install 'tqdm>=4.66'" in proc.stderr and "tqdm" in proc.stderr
    # Nothing names a package the index does not have: pinpool is built from its checkout.
    assert "pinpool[" not in proc.stderr


def test_defaults_share_the_cores_among_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("PINPOOL_COPY_THREADS", raising=False)
    monkeypatch.delenv("PINPOOL_WORKER_COPY_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_world_size() == 1
    with pinpool.PinPool(4096, 1, device="cpu") as alone:
        assert alone.copy_threads == min(8, cores)
    assert _worker_copy_threads(None, 1) == min(4, max(2, cores))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000")
    assert local_world_size() == 1000
    with pinpool.PinPool(4096, 1, device="cpu") as crowded:
        assert crowded.copy_threads == 1
    assert _worker_copy_threads(None, 4) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert local_world_size() == 1


def test_the_dataloader_is_generic_like_torchs() -> None:
    alias = pinpool.DataLoader[int]
    assert alias.__origin__ is pinpool.DataLoader
