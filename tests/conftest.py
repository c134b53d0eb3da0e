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
from dataclasses import dataclass

import pytest

import pinpool
from pinpool._main.epochs import ending_thread


def open_fd_count() -> int:
    """How many file descriptors this process has open, once earlier garbage is collected and
    the freeing thread has freed every pool dropped so far (it closes their memfds in the
    background): a count taken before and after a step then changes by that step's fds only,
    not by an earlier test's objects that a collection in between happens to close. (It waits
    for the workers of ended epochs first, which close their pipes on pinpool's ending
    thread.)"""
    gc.collect()
    pinpool.wait_for_freed_pools(timeout=60)
    return len(os.listdir("/proc/self/fd"))


def open_fds() -> frozenset[tuple[int, str]]:
    """This process's open file descriptors with what each names, settled as for
    :func:`open_fd_count`. Set against an earlier one, what is new is what a step left open,
    whatever background threads closed meanwhile (the ending thread, a grant desk dropping a
    gone worker's connection)."""
    open_fd_count()
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            out.add((int(name), os.readlink(f"/proc/self/fd/{name}")))
        except FileNotFoundError:
            pass  # (closed meanwhile, the listing's own descriptor among them)
    return frozenset(out)


def shm_entries() -> frozenset[str]:
    """The names of the entries ``/dev/shm`` holds right now (none if it does not exist)."""
    try:
        return frozenset(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return frozenset()


def shm_entry_count() -> int:
    """How many entries ``/dev/shm`` holds right now (0 if it does not exist)."""
    return len(shm_entries())


def shm_entries_left(before: frozenset[str], settle: float = 5.0) -> list[str]:
    """The entries ``/dev/shm`` gained since ``before`` that are still there, given up to
    ``settle`` seconds to go: ``/dev/shm`` is the machine's, and entries that come and go
    (torch and multiprocessing remove theirs at once; another test's, run alongside) are no
    leak. multiprocessing's named semaphores (``sem.mp-*``) are not counted: pinpool makes
    none, and those of a loader whose workers start with spawn or a forkserver, in a test run
    alongside, stay for the loader's life."""
    deadline = time.monotonic() + settle
    while True:
        left = sorted(n for n in shm_entries() - before if not n.startswith("sem.mp-"))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def child_pids() -> set[int]:
    """This process's children (zombies included: they are children until reaped), once the
    workers of every ended epoch have been shut down (on pinpool's ending thread)."""
    ending_thread.wait_all()
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


def _same_as_copy_mode(item: pytest.Item) -> bool:
    """Whether ``item`` runs a zero-copy mode with ``num_workers=0``, where zero-copy does
    nothing (the batches are made in this process): the same test in the copy mode with the
    same pin thread runs too."""
    params = getattr(item, "callspec", None)
    mode = params.params.get("loader_mode") if params is not None else None
    return (
        mode is not None and LOADER_MODES[mode].zero_copy and params.params.get("num_workers") == 0
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the zero-copy runs that are copy-mode runs again (:func:`_same_as_copy_mode`,
    unless ``--zero-copy`` asks for zero-copy alone); skip every test marked
    ``@pytest.mark.cuda`` when no usable GPU is present."""
    if not config.getoption("--zero-copy"):
        again = [item for item in items if _same_as_copy_mode(item)]
        if again:
            config.hook.pytest_deselected(items=again)
            items[:] = [item for item in items if not _same_as_copy_mode(item)]
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


@dataclass(frozen=True)
class LoaderMode:
    """How a DataLoader test runs: ``zero_copy`` as ``pinpool.DataLoader``'s default, and
    ``pin_thread``: torch's pin-memory thread running (as on every GPU machine), which takes
    batches ahead of the consumer and in the order they arrive."""

    zero_copy: bool
    pin_thread: bool


#: The four ways a batch reaches the consumer, by test id.
LOADER_MODES = {
    "copy": LoaderMode(zero_copy=False, pin_thread=False),
    "zero-copy": LoaderMode(zero_copy=True, pin_thread=False),
    "copy+pin-thread": LoaderMode(zero_copy=False, pin_thread=True),
    "zero-copy+pin-thread": LoaderMode(zero_copy=True, pin_thread=True),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--modes",
        choices=["marked", "all"],
        default="marked",
        help="which tests of the DataLoader suites (those using the loader_mode fixture) run in "
        "all four loader modes: those marked every_mode (the default), or all of them",
    )
    parser.addoption(
        "--zero-copy",
        action="store_true",
        help="run the DataLoader suites in zero-copy mode only (with --pin-thread: that one)",
    )
    parser.addoption(
        "--pin-thread",
        action="store_true",
        help="run the DataLoader suites with torch's pin-memory thread only (see --zero-copy)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "copy_mode_only: checks copy-mode internals (not run in zero-copy mode)"
    )
    config.addinivalue_line(
        "markers", "every_mode: runs in all four loader modes (see the loader_mode fixture)"
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    # What is there now (torch, hypothesis, the test modules) stays to the end: frozen, it is
    # not walked again by each of the suite's many gc.collect() calls (a third of the time of
    # the DataLoader suites). What a test makes is collected as before.
    gc.collect()
    gc.freeze()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests that use ``loader_mode`` run in copy mode, or in all four modes when marked
    ``every_mode`` or under ``--modes all``; ``--zero-copy``/``--pin-thread`` choose one mode
    for all of them. ``copy_mode_only`` tests skip the zero-copy modes."""
    if "loader_mode" not in metafunc.fixturenames:
        return
    config = metafunc.config
    zero_copy, pin_thread = config.getoption("--zero-copy"), config.getoption("--pin-thread")
    if zero_copy or pin_thread:
        names = [n for n, m in LOADER_MODES.items() if m == LoaderMode(zero_copy, pin_thread)]
    elif config.getoption("--modes") == "all" or metafunc.definition.get_closest_marker(
        "every_mode"
    ):
        names = list(LOADER_MODES)
    else:
        names = ["copy"]
    if metafunc.definition.get_closest_marker("copy_mode_only") is not None:
        names = [n for n in names if not LOADER_MODES[n].zero_copy]
    metafunc.parametrize("loader_mode", names, indirect=True)


def fake_pin_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes torch's DataLoader start its pin thread on a machine with no accelerator (as on
    a GPU machine); skips the test where that cannot be done: a torch that decides through
    ``torch.cuda`` rather than ``torch.accelerator`` (2.6) starts it only where CUDA is."""
    import inspect

    import torch
    import torch.utils.data.dataloader

    if torch.accelerator.is_available():
        return  # the real thing
    if "accelerator" not in inspect.getsource(torch.utils.data.dataloader._BaseDataLoaderIter):
        pytest.skip(f"torch {torch.__version__} starts its pin thread only where CUDA is")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)


@pytest.fixture
def loader_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> LoaderMode:
    """The test's :class:`LoaderMode` (chosen by :func:`pytest_generate_tests`), in force: every
    ``pinpool.DataLoader`` the test makes defaults to its ``zero_copy``, and with ``pin_thread``
    on a machine with no accelerator, torch's DataLoader believes there is one (its iterators
    start the pin-memory thread; pinpool's handles do their own pinning, so nothing else of
    the accelerator is used)."""
    mode = LOADER_MODES[request.param]
    if mode.zero_copy:
        import pinpool.loader

        defaults = dict(pinpool.loader.DataLoader.__init__.__kwdefaults__ or {})
        defaults["zero_copy"] = True
        monkeypatch.setattr(pinpool.loader.DataLoader.__init__, "__kwdefaults__", defaults)
    if mode.pin_thread:
        fake_pin_thread(monkeypatch)
    return mode


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
