"""At a limit of open files too low for a loader's workers to start, pinpool's loader fails as
torch's does (``OSError``: too many open files), cleans up the half-made iterator silently (no
"Exception ignored" from a finalizer: torch's own prints an ``AttributeError``), and leaves no
more descriptors open than torch's loader does. Each loader runs in a process of its own, its
limit lowered there."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.faults

_RUN = textwrap.dedent(
    """
    import gc, os, resource, sys
    sys.path.insert(0, sys.argv[2])
    import torch, pinpool
    from loader_datasets import Indexed

    kind = sys.argv[1]
    Loader = pinpool.DataLoader if kind == "pinpool" else torch.utils.data.DataLoader
    warm = Loader(Indexed(8), batch_size=2)  # (the loader's and its pool's own, first)
    list(warm)
    del warm
    gc.collect()
    pinpool.wait_for_freed_pools(30)

    def fds():
        return len(os.listdir("/proc/self/fd"))

    before = fds()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (before + 6, hard))
    loader = Loader(Indexed(8), batch_size=2, num_workers=4, multiprocessing_context="fork")
    try:
        list(loader)
        print("error: none")
    except OSError as exc:
        print("error:", exc.errno)
    del loader
    gc.collect()
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    pinpool.wait_for_freed_pools(30)
    gc.collect()
    print("left:", fds() - before)
    """
)


def _run(kind: str) -> tuple[int, str, str]:
    done = subprocess.run(
        [sys.executable, "-c", _RUN, kind, "tests"], capture_output=True, text=True, timeout=120
    )
    lines = done.stdout.splitlines()
    left = int(next(line for line in lines if line.startswith("left:")).split()[1])
    error = next(line for line in lines if line.startswith("error:"))
    return left, error, done.stderr


def test_a_loader_whose_workers_cannot_start_fails_cleanly() -> None:
    torch_left, torch_error, _ = _run("torch")
    left, error, stderr = _run("pinpool")
    assert error == torch_error == "error: 24", (error, torch_error)  # EMFILE, both
    assert "Exception ignored" not in stderr, stderr
    assert "AttributeError" not in stderr, stderr
    assert left <= torch_left, (left, torch_left)
