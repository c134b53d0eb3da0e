"""Shared fixtures and helpers for the pinpool test suite.

The ``cuda`` and ``slow`` markers are registered in ``pyproject.toml``; this file only decides
when ``cuda`` tests can run (see :func:`pytest_collection_modifyitems`) and provides helpers for
leak checks (open file descriptors, ``/dev/shm`` entries) and pools that are always closed.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

import pinpool


def open_fd_count() -> int:
    """How many file descriptors this process has open, once the release thread has freed
    every pool dropped so far (it closes their memfds in the background)."""
    pinpool.wait_for_releases(timeout=60)
    return len(os.listdir("/proc/self/fd"))


def shm_entries() -> frozenset[str]:
    """The names of the entries ``/dev/shm`` holds right now (none if it does not exist)."""
    try:
        return frozenset(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return frozenset()


def shm_entry_count() -> int:
    """How many entries ``/dev/shm`` holds right now (0 if it does not exist)."""
    return len(shm_entries())


def child_pids() -> set[int]:
    """This process's children (zombies included: they are children until reaped)."""
    pids: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return pids


def process_state(pid: int) -> str | None:
    """Process ``pid``'s state letter (``Z``: a zombie), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def zombies(pids: set[int]) -> set[int]:
    """Those of ``pids`` that are zombies."""
    return {pid for pid in pids if process_state(pid) == "Z"}


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (no CUDA context current yet), with ``env`` added."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **env},
    )


def make_memfd(data: bytes | int, name: str = "pinpool-test", seal: bool = True) -> int:
    """A memfd holding ``data`` (or that many zero bytes), sealed against shrinking and growing
    (only such a file can be mapped) unless ``seal`` is False; the caller closes it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    if isinstance(data, int):
        os.ftruncate(fd, data)
    else:
        os.ftruncate(fd, len(data))
        os.pwrite(fd, data, 0)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def cuda_unavailable_reason() -> str | None:
    """Why CUDA tests cannot run here, or None if they can.

    Both sides must see a GPU: pinpool's own driver loader and torch.
    """
    if not pinpool.cuda_available():
        return "pinpool.cuda_available() is False (no CUDA driver or device)"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test marked ``@pytest.mark.cuda`` when no usable GPU is present."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    reason = cuda_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs CUDA: {reason}")
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture
def fd_count() -> Callable[[], int]:
    """The :func:`open_fd_count` helper, as a fixture."""
    return open_fd_count


@pytest.fixture
def shm_count() -> Callable[[], int]:
    """The :func:`shm_entry_count` helper, as a fixture."""
    return shm_entry_count


@pytest.fixture
def make_pool() -> Iterator[Callable[..., pinpool.PinPool]]:
    """A factory for pools that are closed at the end of the test.

    Defaults to a host pool (``device="cpu"``) so tests do not depend on the machine.
    """
    pools: list[pinpool.PinPool] = []

    def factory(slot_bytes: int = 4096, num_slots: int = 2, **kwargs: object) -> pinpool.PinPool:
        kwargs.setdefault("device", "cpu")
        pool = pinpool.PinPool(slot_bytes, num_slots, **kwargs)  # type: ignore[arg-type]
        pools.append(pool)
        return pool

    yield factory
    for pool in pools:
        pool.close()
    # Drop slots and views the test left behind while the pools are still referenced here.
    gc.collect()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--zero-copy",
        action="store_true",
        help="run the DataLoader tests with zero_copy=True as pinpool.DataLoader's default",
    )
    parser.addoption(
        "--pin-thread",
        action="store_true",
        help="on a machine without an accelerator, make torch's DataLoader run its pin-memory "
        "thread anyway (the path every GPU machine takes)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "copy_mode_only: checks copy-mode internals (skipped under --zero-copy)"
    )


@pytest.fixture(autouse=True)
def _zero_copy_default(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``--zero-copy``, every ``pinpool.DataLoader`` a test makes defaults to
    ``zero_copy=True`` (the whole loader suite runs again in that mode)."""
    if not request.config.getoption("--zero-copy"):
        return
    if request.node.get_closest_marker("copy_mode_only") is not None:
        pytest.skip("checks copy-mode internals")
    import pinpool.loader

    defaults = dict(pinpool.loader.DataLoader.__init__.__kwdefaults__ or {})
    defaults["zero_copy"] = True
    monkeypatch.setattr(pinpool.loader.DataLoader.__init__, "__kwdefaults__", defaults)


@pytest.fixture(autouse=True)
def _pin_thread(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``--pin-thread`` on a machine with no accelerator, torch's DataLoader believes
    there is one: its iterators start the pin-memory thread, which decodes batches ahead of
    the consumer and in the order they arrive, exactly as on a GPU machine. pinpool's
    handles do their own pinning, so nothing else of the accelerator is used."""
    if not request.config.getoption("--pin-thread"):
        return
    import torch

    if torch.accelerator.is_available():
        return  # the real thing
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)


def late_wakeups(stop: threading.Event, out: list[float]) -> None:
    """A stand-in for a training thread: how late each 1 ms sleep wakes up."""
    while not stop.is_set():
        t0 = time.perf_counter()
        time.sleep(0.001)
        out.append(time.perf_counter() - t0 - 0.001)


@contextlib.contextmanager
def probe() -> Iterator[list[float]]:
    """How late each 1 ms sleep of a thread woke during the block, in seconds: a thread that
    holds the GIL (or blocks the others) for N ms shows up as a wake-up N ms late."""
    out: list[float] = []
    stop = threading.Event()
    thread = threading.Thread(target=late_wakeups, args=(stop, out), daemon=True)
    thread.start()
    time.sleep(0.05)
    try:
        yield out
    finally:
        time.sleep(0.05)
        stop.set()
        thread.join()
