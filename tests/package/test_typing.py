"""Types a user's code sees: ``mypy --strict`` runs over a small program that uses the
DataLoader, the pool, slot views and both ``stats()``, and must pass without a single
annotation on the loader (``memoryview(slot)`` included: the stub declares the buffer
protocol); a second program with deliberate mistakes must fail exactly where they are (so the
first passing means something). The typed dicts are also compared with what
``stats()`` returns at run time."""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

import pinpool

USER_PROGRAM = """
from typing import Any, assert_type

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

import pinpool


class Pairs(Dataset[tuple[Tensor, int]]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return torch.zeros(3), index


def train(dataset: Dataset[tuple[Tensor, int]]) -> int:
    loader = pinpool.DataLoader(dataset, batch_size=4, num_workers=2, zero_copy=True)
    assert_type(loader, pinpool.DataLoader[tuple[Tensor, int]])
    as_torchs: torch.utils.data.DataLoader[tuple[Tensor, int]] = loader
    for batch in loader:
        del batch
    stats = loader.stats()
    assert_type(stats, pinpool.LoaderStats)
    assert_type(stats["batches"], int)
    assert_type(stats["wait_seconds"], float)  # a pool counter: once the pool exists
    return len(as_torchs)


tensors = pinpool.DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2)
assert_type(tensors, pinpool.DataLoader[tuple[Tensor, ...]])
train(Pairs())

pool = pinpool.PinPool(1 << 16, 2, device="cpu")
assert_type(pool.stats(), pinpool.PoolStats)
assert_type(pool.stats()["checkouts"], int)
with pool.checkout() as slot:
    assert_type(slot.view(torch.float32, (4, 4)), Tensor)
    assert_type(slot.view(torch.uint8, 16, offset=16), Tensor)
    assert_type(slot.view("float32", [2, 2]), Tensor | npt.NDArray[Any])
    assert_type(slot.view(np.int64, np.int64(3)), Tensor | npt.NDArray[Any])
    array = np.frombuffer(slot, dtype=np.uint8)  # the buffer protocol (PEP 688)
    assert_type(array, npt.NDArray[np.uint8])  # (numpy's own alias: its shape type varies)
    floats = np.frombuffer(memoryview(slot), dtype=np.float32)  # (before 3.12's typing too)
    view: memoryview = memoryview(slot)  # (the stub declares __buffer__)
    assert_type(floats, npt.NDArray[np.float32])
"""

#: Mistakes a type checker must report, each marked with the error code mypy gives it.
MISTAKES = """
import torch
from torch import Tensor
from torch.utils.data import Dataset

import pinpool


def make(dataset: Dataset[tuple[Tensor, int]]) -> None:
    loader = pinpool.DataLoader(dataset, batch_size=4)
    wrong: pinpool.DataLoader[str] = loader  # E: assignment
    print(loader.stats()["batchez"])  # E: typeddict-item
    pool = pinpool.PinPool(4096, 1, device="cpu")
    print(pool.stats()["batches"])  # E: typeddict-item
    number: int = pool.checkout().view(torch.float32, 4)  # E: assignment
    pool.checkout().view(None, 4)  # E: call-overload
    pinpool.DataLoader(dataset, zero_copy="yes")  # E: arg-type
    pinpool.PinPool(4096, 1, backend="bogus")  # E: arg-type
    print(wrong)
"""


def _mypy(tmp_path: Path, cache: Path, *files: Path) -> subprocess.CompletedProcess[str]:
    # Python 3.12's typing: numpy's stubs take any buffer (PEP 688's Buffer) from 3.12 on, and
    # only bytes-like types before, whatever the object supports.
    command = [sys.executable, "-m", "mypy", "--strict", "--python-version", "3.12"]
    command += ["--cache-dir", str(cache), "--show-error-codes", "--no-error-summary"]
    return subprocess.run(
        [*command, *map(str, files)], capture_output=True, text=True, cwd=tmp_path, check=False
    )


@pytest.mark.slow
def test_a_user_program_passes_mypy_strict_and_mistakes_are_reported(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    pytest.importorskip("mypy")
    good = tmp_path / "user_program.py"
    good.write_text(USER_PROGRAM)
    bad = tmp_path / "mistakes.py"
    bad.write_text(MISTAKES)
    # Kept between runs (pytest's cache): mypy reads torch's stubs once, not every time.
    # (a fresh one where pytest's cache is off)
    store = getattr(request.config, "cache", None)
    cache = Path(store.mkdir("mypy")) if store is not None else tmp_path / "mypy-cache"
    proc = _mypy(tmp_path, cache, good, bad)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    errors: dict[tuple[str, int], str] = {}
    for line in proc.stdout.splitlines():
        found = re.match(r"(\w+)\.py:(\d+): error: .*\[([\w-]+)\]$", line)
        if found:
            errors[(found[1], int(found[2]))] = found[3]
        else:
            assert ": note: " in line, line
    expected = {
        ("mistakes", number): mark.group(1)
        for number, text in enumerate(MISTAKES.splitlines(), start=1)
        if (mark := re.search(r"# E: ([\w-]+)", text))
    }
    assert len(expected) == 7
    # The user's program type-checks as written; every mistake is reported, as what it is.
    assert errors == expected, proc.stdout


def test_the_typed_dicts_name_exactly_what_stats_returns() -> None:
    pool_keys = set(typing.get_type_hints(pinpool.PoolStats))
    loader_hints = typing.get_type_hints(pinpool.LoaderStats)
    with pinpool.PinPool(4096, 1, device="cpu") as pool:
        assert set(pool.stats()) == pool_keys
    loader = pinpool.DataLoader(torch.arange(8.0), batch_size=4)
    before = loader.stats()  # no pool yet: the loader's own counters only
    assert set(before) == pinpool.LoaderStats.__required_keys__
    assert pool_keys == pinpool.LoaderStats.__optional_keys__
    assert sum(len(batch) for batch in loader) == 8
    after = loader.stats()
    assert set(after) == set(loader_hints)
    for key, value in after.items():
        assert isinstance(value, loader_hints[key]), (key, value)


@pytest.mark.slow
def test_the_guides_examples_pass_mypy_strict_on_the_oldest_python(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Every complete Python block of the README and the guide type-checks with ``mypy
    --strict`` as Python 3.11 (the oldest pinpool supports) sees it: what a user copies
    passes their own type checker."""
    pytest.importorskip("mypy")
    root = Path(__file__).resolve().parent.parent.parent
    files = []
    block = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
    for doc in (root / "README.md", root / "docs" / "guide.md"):
        for n, found in enumerate(block.finditer(doc.read_text())):
            code = found.group(1)
            if code.split("\n", 1)[0].strip().lower().startswith("# fragment"):
                continue
            path = tmp_path / f"{doc.stem.lower()}_{n}.py"
            path.write_text(code)
            files.append(path)
    store = getattr(request.config, "cache", None)
    cache = Path(store.mkdir("mypy")) if store is not None else tmp_path / "mypy-cache"
    command = [sys.executable, "-m", "mypy", "--strict", "--python-version", "3.11"]
    command += ["--cache-dir", str(cache), "--show-error-codes", "--no-error-summary"]
    command += ["--ignore-missing-imports"]  # (accelerate ships no types: the user's own call)
    proc = subprocess.run(
        [*command, *map(str, files)], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
