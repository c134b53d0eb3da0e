"""``pinpool.DataLoader`` under faults: whatever ends an epoch (its end, a ``break``, an error in
a worker, a killed worker, a timeout, an interrupt, the loader going away), nothing is left
behind: every slot back in the pool, every worker segment unmapped, no file descriptor, no
``/dev/shm`` entry and no child process (or zombie) more than before.

Each test runs the same kind of loader once first (the first use of a start method leaves
helper processes and descriptors behind for good), then counts, then runs the fault, then
drops the loader and its iterator and counts again. Loaders get an explicit pool (unless the
test is about the loader's own pool), so its counters can be read after the loader is gone.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch
from conftest import LoaderMode, child_pids, open_fd_count, probe, shm_entries, zombies
from loader_datasets import (
    DiesHoldingTheResultLock,
    Exiting,
    Failing,
    Indexed,
    Killing,
    Sized,
    Sleepy,
    indices_only,
)
from torch.utils.data._utils import signal_handling

import pinpool
from pinpool._main.epochs import ending_thread

#: Every test here runs in copy mode; those marked ``every_mode`` in all four loader modes
#: (``tests/conftest.py``: ``loader_mode``). Marked ``faults``: they count this process's fds
#: and children and the machine's /dev/shm entries, and time how soon a death is noticed, so
#: ``make test`` runs them in a process of their own, with nothing else running.
pytestmark = [pytest.mark.usefixtures("loader_mode"), pytest.mark.faults]

MiB = 1 << 20


# --------------------------------------------------------------------------- bookkeeping


@dataclass(frozen=True)
class StuckFeeder:
    """A queue's feeder thread waiting for a write lock that nothing in this process holds
    (see :func:`stuck_feeders`), with what it keeps open: ``fds``, ``shm`` entries."""

    ident: int
    fds: int
    shm: int


def stuck_feeders() -> dict[int, StuckFeeder]:
    """torch's own hazard, by thread id. A DataLoader worker that exits or dies while its
    result queue's feeder thread is writing a batch (told to exit, torch's worker no longer
    waits for that thread) leaves the queue's write lock, shared by every process of the
    loader, held by a process that no longer exists. When a pin-memory thread runs, torch's
    shutdown puts one more message on that queue in the main process: that put's feeder
    thread then waits for the lock forever, keeping the queue's pipe ends open (and, with
    spawn or a forkserver, its semaphores' /dev/shm entries). torch's own loader leaves the
    same when a worker's last write and its exit meet; the fault tests count it as torch's."""
    out = {}
    frames = sys._current_frames()
    for thread in threading.enumerate():
        frame = frames.get(thread.ident) if thread.name == "QueueFeederThread" else None
        # Waiting for the lock: the innermost Python frame is the feeder's own (writing, or
        # waiting for work, it is deeper).
        if frame is None or frame.f_code.co_name != "_feed" or thread.ident is None:
            continue
        args = frame.f_locals
        lock = args.get("writelock")
        if lock is None:
            continue
        if lock.acquire(False):  # (free: it is not stuck)
            lock.release()
            continue
        ends = [getattr(args.get(n), "__self__", None) for n in ("reader_close", "writer_close")]
        fds = sum(1 for end in ends if end is not None and not end.closed)
        sems = (lock, args.get("queue_sem"))
        names = [getattr(getattr(sem, "_semlock", None), "name", None) for sem in sems]
        shm = sum(1 for n in names if n and os.path.exists("/dev/shm/sem." + n.lstrip("/")))
        out[thread.ident] = StuckFeeder(thread.ident, fds, shm)
    return out


@dataclass(frozen=True)
class Resources:
    fds: int
    shm: frozenset[str]  # /dev/shm's entries
    children: frozenset[int]
    fd_targets: tuple[str, ...] = ()  # what each open fd is (for the message only)
    stuck: tuple[StuckFeeder, ...] = ()  # torch's (see stuck_feeders)

    @staticmethod
    def now() -> Resources:
        ending_thread.wait_all()  # (an ended epoch's workers exit, and leave, on the ending thread)
        count = open_fd_count()
        targets = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        stuck = tuple(stuck_feeders().values())
        return Resources(count, shm_entries(), frozenset(child_pids()), tuple(targets), stuck)

    def unexplained_fds(self, before: Resources) -> int:
        """Open fds gained since ``before`` beyond those kept by torch's feeders stuck since."""
        old = {f.ident for f in before.stuck}
        kept = sum(f.fds for f in self.stuck if f.ident not in old)
        return self.fds - before.fds - kept

    def leaks_since(self, before: Resources, kept_fds: int = 0) -> list[str]:
        out = []
        # What torch's own hazard left since (a feeder stuck before was counted then).
        old = {f.ident for f in before.stuck}
        new_stuck = [f for f in self.stuck if f.ident not in old]
        kept_fds += sum(f.fds for f in new_stuck)
        kept_shm = sum(f.shm for f in new_stuck)
        if self.fds > before.fds + kept_fds:
            new = list(self.fd_targets)
            for target in before.fd_targets:
                if target in new:
                    new.remove(target)
            threads = sorted(t.name for t in threading.enumerate())
            out.append(
                f"{self.fds - before.fds} more open fds (torch keeps {kept_fds}): {new}; "
                f"threads: {threads}"
            )
        # /dev/shm is the machine's: an entry another process made and removed meanwhile is
        # not this test's; one still there is, and its name says whose it is, but for a
        # semaphore (multiprocessing's, of any process: another test run's forkserver queues
        # keep theirs while they live), which is this process's only where it maps it.
        mapped = _shm_inodes_mapped_here()
        new_shm = sorted(
            n
            for n in self.shm - before.shm
            if os.path.exists(f"/dev/shm/{n}")
            and (not n.startswith("sem.") or _inode(f"/dev/shm/{n}") in mapped)
        )
        if len(new_shm) > kept_shm:
            out.append(f"{len(new_shm)} more /dev/shm entries (torch keeps {kept_shm}): {new_shm}")
        extra = self.children - before.children
        if extra:
            out.append(f"children left: {sorted(extra)} (zombies: {sorted(zombies(extra))})")
        return out


def _shm_inodes_mapped_here() -> set[int]:
    """The inodes of the /dev/shm files this process maps (a named semaphore is mapped by each
    process that uses it, under the temporary name glibc made it with: hence inodes)."""
    with open("/proc/self/maps") as maps:
        return {int(line.split()[4]) for line in maps if "/dev/shm/" in line}


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def wait_until(condition: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def assert_pool_clean(pool: pinpool.PinPool) -> None:
    """Every slot free; every segment ever mapped is unmapped."""
    gc.collect()
    if not pool.closed:
        pool.flush()
    s = pool.stats()
    assert s["slots_checked_out"] == 0 and s["slots_fenced"] == 0, s
    assert s["slots_free"] == pool.num_slots, s
    assert s["segments_mapped"] == s["segments_unmapped"], s
    assert s["pending_unmaps"] == 0, s


def torch_keeps_fds(persistent_workers: int) -> int:
    """File descriptors torch itself keeps after a loader with ``persistent_workers`` is gone:
    when it pins memory (an accelerator is present), it registers an ``atexit`` hook per
    persistent worker, which holds the worker's ``Process`` object, and with it the two pipe
    ends ``fork`` opened for it, until the interpreter exits. ``torch.utils.data.DataLoader``
    does the same."""
    return 2 * persistent_workers if torch.accelerator.is_available() else 0


def assert_no_leaks(
    before: Resources, pool: pinpool.PinPool | None = None, persistent_workers: int = 0
) -> None:
    """Once the garbage is collected: the pool is clean and no fd, /dev/shm entry or child
    process is left over (waiting a little for exiting workers to be reaped), beyond what
    torch keeps of ``persistent_workers`` (see :func:`torch_keeps_fds`)."""
    gc.collect()
    if pool is not None:
        assert_pool_clean(pool)
    after: list[Resources] = []

    def settled() -> bool:
        gc.collect()
        after.append(Resources.now())
        return not after[-1].leaks_since(before, kept)

    kept = torch_keeps_fds(persistent_workers)
    if not wait_until(settled):
        pytest.fail("leaked: " + "; ".join(after[-1].leaks_since(before, kept)))


class Hang(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fails the test (instead of blocking forever) if the block takes over ``seconds``."""

    def expire(signum: int, frame: Any) -> None:
        raise Hang(f"no progress within {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def forget(info: pytest.ExceptionInfo[Any]) -> BaseException:
    """The caught exception, with its traceback's frames cleared (they hold the iterator,
    which must die by reference count: collected later in a cycle, torch's worker shutdown
    would find its queues already finalized and wait 5 s per worker)."""
    err = info.value
    traceback.clear_frames(info.tb)
    err.__traceback__ = None
    return err


@pytest.fixture
def pool() -> pinpool.PinPool:
    # Not closed at the end: a loader that outlives its test (one kept by a failure's
    # traceback) would raise PoolClosed from its finalizer later (see
    # test_closing_the_callers_pool_before_the_loader).
    return pinpool.PinPool(2 * MiB, 8, device="cpu")


def loader(ds: Any, pool: pinpool.PinPool, **kw: Any) -> pinpool.DataLoader:
    kw.setdefault("batch_size", 2)
    kw.setdefault("num_workers", 2)
    return pinpool.DataLoader(ds, pool=pool, **kw)


def warm_up(pool: pinpool.PinPool, **kw: Any) -> Resources:
    """One full epoch of a loader like the test's, then the resources to compare against."""
    for batch in loader(Indexed(6), pool, **kw):
        del batch
    gc.collect()
    assert_pool_clean(pool)
    time.sleep(0.05)
    return Resources.now()


def check_batch(
    batch: dict[str, Any], first: int, size: int = 2, shape: tuple[int, ...] = (3, 4)
) -> None:
    idx = list(range(first, first + size))
    assert batch["idx"].tolist() == idx
    assert torch.equal(batch["x"], torch.stack([torch.full(shape, float(i)) for i in idx]))
    assert batch["name"] == [f"s{i}" for i in idx]


# --------------------------------------------------------------------------- epochs


@pytest.mark.every_mode
@pytest.mark.parametrize("num_workers", [0, 2])
def test_normal_end_of_epoch(pool: pinpool.PinPool, num_workers: int) -> None:
    before = warm_up(pool, num_workers=num_workers)
    pin = loader(Indexed(20), pool, num_workers=num_workers)
    for i, batch in enumerate(pin):
        check_batch(batch, 2 * i)
    assert i == 9
    del batch
    gc.collect()
    if num_workers:
        # The epoch is over: once the ending thread has shut its workers down (the final
        # next() did not wait for it), they are gone and their segments unmapped.
        ending_thread.wait_all()
        assert pin.stats()["segments_cached"] == 0
        assert_pool_clean(pool)
    del pin
    assert_no_leaks(before, pool)


@pytest.mark.every_mode
@pytest.mark.parametrize("num_workers", [0, 2])
def test_break_out_of_the_loop(pool: pinpool.PinPool, num_workers: int) -> None:
    before = warm_up(pool, num_workers=num_workers)
    pin = loader(Indexed(40), pool, num_workers=num_workers)
    for i, batch in enumerate(pin):
        check_batch(batch, 2 * i)
        if i == 3:
            break
    del batch
    gc.collect()
    assert_pool_clean(pool)  # the iterator died with the loop
    del pin
    assert_no_leaks(before, pool)


@pytest.mark.every_mode
@pytest.mark.parametrize("shape", [(3, 4), (64, 64)], ids=["small", "streamed"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_exception_in_getitem(
    pool: pinpool.PinPool, num_workers: int, shape: tuple[int, ...]
) -> None:
    # With 16 KiB samples the worker streams sample 4 into its segment, then sample 5 raises.
    before = warm_up(pool, num_workers=num_workers)
    pin = loader(Failing(20, bad=5, shape=shape), pool, num_workers=num_workers)
    it = iter(pin)
    got = []
    with deadline(60), pytest.raises(ValueError) as info:
        for batch in it:
            got.append(batch["idx"].tolist())
            del batch
    err = forget(info)
    message = str(err)
    assert "sample 5 is broken on purpose" in message
    if num_workers:
        # torch's ExceptionWrapper: the original type, the worker's traceback in the text.
        assert "Caught ValueError in DataLoader worker process" in message
        assert "Traceback (most recent call last)" in message
        assert "loader_datasets.py" in message
    assert got == [[0, 1], [2, 3]]
    # The iterator goes on after the failed batch, as torch's does.
    rest = []
    for batch in it:
        rest.append(batch["idx"].tolist())
        check_batch(batch, rest[-1][0], shape=shape)
    del batch
    assert rest == [[2 * i, 2 * i + 1] for i in range(3, 10)]
    del it, pin, err, info
    assert_no_leaks(before, pool)


class RefusesToStart(torch.utils.data.Sampler[int]):
    """A sampler that raises as its epoch starts: with workers, inside torch's iterator's
    ``__init__``, after the workers started and were registered for its SIGCHLD check."""

    def __len__(self) -> int:
        return 8

    def __iter__(self) -> Iterator[int]:
        raise ValueError("this sampler refuses to start")


@pytest.mark.every_mode
def test_a_sampler_that_raises_as_the_epoch_starts(
    pool: pinpool.PinPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = warm_up(pool)
    registered: list[int] = []
    register = signal_handling._set_worker_pids

    def recording(iterator_id: int, pids: tuple[int, ...]) -> None:
        registered.append(iterator_id)
        register(iterator_id, pids)

    monkeypatch.setattr(signal_handling, "_set_worker_pids", recording)
    pin = loader(Indexed(8), pool, sampler=RefusesToStart())
    for _ in range(2):  # (the loader is usable after: the next epoch raises the same)
        with deadline(60), pytest.raises(ValueError, match="refuses to start") as info:
            iter(pin)
        forget(info)
    assert len(registered) == 2
    # Nothing registered is left: the half-made iterator's id, which a later iterator may
    # be given (torch refuses an id registered twice), and its dead workers, which torch's
    # SIGCHLD check would report as failed.
    for iterator_id in registered:
        with pytest.raises(ValueError, match="Cannot find worker information"):
            torch._C._remove_worker_pids(iterator_id)
    del pin, info
    assert_no_leaks(before, pool)


@pytest.mark.every_mode
def test_worker_killed_with_sigkill(pool: pinpool.PinPool) -> None:
    # prefetch_factor=1: when the worker dies, every batch it sent has been received (see
    # test_worker_gone_before_its_batch_is_received for the other case).
    before = warm_up(pool, prefetch_factor=1)
    pin = loader(Killing(400, bad=11), pool, timeout=20, prefetch_factor=1)
    it = iter(pin)
    t0 = time.monotonic()
    with deadline(60), pytest.raises(RuntimeError) as info:
        for batch in it:
            check_batch(batch, int(batch["idx"][0]))
            del batch
    elapsed = time.monotonic() - t0
    err = forget(info)
    assert "DataLoader worker (pid" in str(err), str(err)
    assert "killed" in str(err) or "exited unexpectedly" in str(err), str(err)
    assert elapsed < 20, f"took {elapsed:.1f} s to notice the dead worker"
    with deadline(60):
        del it, pin, err, info
        assert_no_leaks(before, pool)


@pytest.mark.every_mode
def test_a_worker_dead_holding_the_result_queues_lock_leaves_what_torch_leaves(
    pool: pinpool.PinPool,
) -> None:
    """torch's own hazard (see :func:`stuck_feeders`), made certain: a worker dies holding
    its result queue's write lock. torch's loader and pinpool's leave the same behind (with a
    pin-memory thread: a feeder thread stuck on the lock, with its queue's pipe ends), and
    pinpool nothing more: in zero-copy mode, a worker holds no lock of pinpool's, and the
    slots it held come back with the iterator."""

    def run(make: Callable[..., Any]) -> tuple[Resources, Resources]:
        # (prefetch_factor=1: when the worker dies, the others have sent what they made)
        kw = {"batch_size": 2, "num_workers": 2, "timeout": 20, "prefetch_factor": 1}
        for batch in make(Indexed(6), **kw):
            del batch
        gc.collect()
        before = Resources.now()
        it = iter(make(DiesHoldingTheResultLock(400, bad=11), **kw))
        with deadline(60), pytest.raises(RuntimeError, match="DataLoader worker") as info:
            for batch in it:
                del batch
        forget(info)
        with deadline(60):
            del it, info
            gc.collect()
            wait_until(lambda: not (Resources.now().children - before.children))
        return before, Resources.now()

    # torch's, with a pin-memory thread where pinpool's has one (its batch holds nothing to
    # pin: on a machine without an accelerator, torch's thread could not pin a tensor).
    torch_before, torch_after = run(
        partial(
            torch.utils.data.DataLoader,
            pin_memory=torch.accelerator.is_available(),
            collate_fn=indices_only,
        )
    )
    before, after = run(lambda ds, **kw: loader(ds, pool, **kw))
    torch_left = len(torch_after.stuck) - len(torch_before.stuck)
    assert len(after.stuck) - len(before.stuck) == torch_left
    # Open fds beyond those the new stuck feeders keep: none, or no more than torch's run had
    # (a count of this whole process: an fd closed meanwhile makes torch's negative).
    unexplained = after.unexplained_fds(before)
    assert unexplained <= max(0, torch_after.unexplained_fds(torch_before)), unexplained
    assert not after.leaks_since(before)
    assert_pool_clean(pool)


# Exercises the first use of a worker segment, which zero-copy batches do not need.
@pytest.mark.copy_mode_only
def test_worker_gone_before_its_batch_is_received() -> None:
    pool = pinpool.PinPool(8 * MiB, 4, device="cpu")
    before = warm_up(pool, num_workers=1)
    # Batch 1 (6 MiB) does not fit batch 0's segment: it goes out in a new one, whose first
    # handle tells the main process where to open it. Batch 2 makes the worker exit.
    pin = loader(
        Exiting([10, 10, 3 * MiB, 3 * MiB, 10, 10], bad=4), pool, num_workers=1, timeout=10
    )
    it = iter(pin)
    assert next(it).shape == (2, 10)
    time.sleep(0.8)  # meanwhile the worker sent batch 1, started batch 2 and exited
    outcome = "no error"
    delivered = 1
    with deadline(30):
        try:
            # torch's pin thread (on GPU machines) takes batch 1's segment as it arrives, while
            # the worker still lives: then batch 1 comes, and the error is batch 2's.
            while True:
                assert next(it).shape == ((2, 3 * MiB) if delivered == 1 else (2, 10))
                delivered += 1
        except Exception as exc:
            # Keep only the text (an exception's frames reference torch's iterator). Either
            # torch notices the dead worker first (RuntimeError), or pinpool does, when it
            # cannot open the segment (WorkerLost, a RuntimeError too).
            kind = "RuntimeError" if isinstance(exc, RuntimeError) else type(exc).__name__
            outcome = f"{kind}: {exc}"
        del it, pin
        assert_no_leaks(before, pool)
    assert outcome.startswith("RuntimeError:") and "DataLoader worker (pid" in outcome, outcome
    assert delivered in (1, 2), delivered


def test_timeout(pool: pinpool.PinPool) -> None:
    before = warm_up(pool)
    pin = loader(Sleepy(20, slow=8, seconds=2.0), pool, timeout=0.3)
    it = iter(pin)
    got = []
    t0 = time.monotonic()
    with deadline(30), pytest.raises(RuntimeError, match=r"timed out after 0\.3 seconds") as info:
        for batch in it:
            got.append(batch["idx"].tolist())
            del batch
    assert time.monotonic() - t0 < 1.9, "did not time out before the slow sample was ready"
    forget(info)
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with deadline(30):
        del it, pin, info
        assert_no_leaks(before, pool)


@pytest.mark.every_mode
@pytest.mark.parametrize("num_workers", [0, 2])
def test_keyboard_interrupt_from_the_consumer(pool: pinpool.PinPool, num_workers: int) -> None:
    before = warm_up(pool, num_workers=num_workers)
    pin = loader(Indexed(40), pool, num_workers=num_workers)
    kept = []
    with pytest.raises(KeyboardInterrupt) as info:
        for i, batch in enumerate(pin):
            kept.append(batch)
            if i == 2:
                raise KeyboardInterrupt
    forget(info)
    del batch
    for i, b in enumerate(kept):
        check_batch(b, 2 * i)
    assert pool.stats()["slots_checked_out"] == 3
    del kept, b
    del pin, info
    assert_no_leaks(before, pool)


@pytest.mark.every_mode
@pytest.mark.parametrize("persistent", [False, True])
def test_loader_deleted_mid_epoch(pool: pinpool.PinPool, persistent: bool) -> None:
    before = warm_up(pool, persistent_workers=persistent)
    pin = loader(Indexed(40), pool, persistent_workers=persistent)
    it = iter(pin)
    first = next(it)
    next(it)
    third = next(it)
    del it, pin  # the loader, its iterator and its workers go; the batches stay
    gc.collect()
    check_batch(first, 0)
    check_batch(third, 4)
    assert pool.stats()["slots_checked_out"] == 2
    del first, third
    assert_no_leaks(before, pool, persistent_workers=2 if persistent else 0)


@pytest.mark.every_mode
def test_owned_pool_goes_with_the_loader(loader_mode: LoaderMode) -> None:
    """Without ``pool=``, the loader's own pool is closed when the loader goes (persistent
    workers and all); its counters can still be read."""
    for batch in pinpool.DataLoader(Indexed(4), batch_size=2, num_workers=2):
        del batch
    gc.collect()
    before = Resources.now()
    pin = pinpool.DataLoader(Indexed(40), batch_size=2, num_workers=2, persistent_workers=True)
    it = iter(pin)
    for _ in range(3):
        check_batch(next(it), 2 * _)
    own = pin.pool
    assert own is not None and not own.closed
    del it, pin
    gc.collect()
    assert own.closed
    pinpool.wait_for_freed_pools(timeout=60)  # (a part still being made holds the pool a while)
    s = own.stats()
    # (free, or never made ready: the prepare thread runs at idle priority, and on a busy
    # machine the pool may close before it came to the rest of the arena)
    assert s["slots_checked_out"] == 0 and s["bytes_checked_out"] == 0, s
    assert s["bytes_free"] + s["bytes_preparing"] == own.arena_bytes, s
    # (zero-copy: every batch in its granted slot, no segment mapped)
    assert s["segments_mapped"] == s["segments_unmapped"] >= (0 if loader_mode.zero_copy else 2), s
    # (with torch's pin thread, batches decoded ahead count too)
    assert s["checkouts"] == s["releases"] >= 3, s
    del own
    assert_no_leaks(before, persistent_workers=2)


# Counts checkouts exactly; zero-copy also checks slots out when it dispatches indices.
@pytest.mark.copy_mode_only
def test_owned_pool_stats_after_a_batch_outlives_the_loader() -> None:
    pin = pinpool.DataLoader(Indexed(40), batch_size=2, num_workers=2)
    it = iter(pin)
    kept = next(it)
    own = pin.pool
    del it, pin
    gc.collect()
    assert own.closed
    check_batch(kept, 0)  # still valid after its pool was closed
    assert own.stats()["slots_checked_out"] == 1
    del kept
    gc.collect()
    s = own.stats()
    # (with torch's pin thread, batches decoded ahead count too)
    assert s["releases"] == s["checkouts"] >= 1, s
    # (free, or never made ready: the prepare thread runs at idle priority, and on a busy
    # machine the pool may close before it came to the rest of the arena)
    assert s["slots_checked_out"] == 0 and s["bytes_checked_out"] == 0, s
    assert s["bytes_free"] + s["bytes_preparing"] == own.arena_bytes, s


@pytest.mark.every_mode
def test_closing_the_callers_pool_before_the_loader() -> None:
    own = pinpool.PinPool(2 * MiB, 4, device="cpu")
    pin = loader(Indexed(8), own)
    for batch in pin:
        del batch
    own.close()
    unraisable: list[Any] = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        del pin
        gc.collect()
    finally:
        sys.unraisablehook = old_hook
    assert not unraisable, [str(u.exc_value) for u in unraisable]


# After a break, zero-copy grants of the persistent iterator hold slots until the next
# epoch drains them; this test expects none held between epochs.
@pytest.mark.copy_mode_only
def test_persistent_workers_with_a_break(pool: pinpool.PinPool) -> None:
    before = warm_up(pool, persistent_workers=True)
    mapped_before = pool.stats()["segments_mapped"]
    pin = loader(Indexed(16), pool, persistent_workers=True)
    for epoch in range(4):
        seen = []
        for i, batch in enumerate(pin):
            check_batch(batch, 2 * i)
            seen.append(i)
            if epoch == 1 and i == 1:
                break
        del batch
        gc.collect()
        assert seen == ([0, 1] if epoch == 1 else list(range(8)))
        s = pool.stats()
        if epoch == 1:
            # Batches were taken ahead (by torch's pin thread, or without it by the consumer's
            # read-ahead); they wait for the next epoch, which drops them (persistent workers keep
            # the iterator between epochs).
            assert s["slots_checked_out"] <= 2 * 2, s
        else:
            assert s["slots_checked_out"] == 0, s
    # Between epochs the workers and their segments stay.
    assert pin.stats()["segments_cached"] >= 2
    # ... and are reused: at most a ring (prefetch_factor + 2) per worker over 4 epochs.
    assert pool.stats()["segments_mapped"] - mapped_before <= 2 * (2 + 2)
    del pin
    assert_no_leaks(before, pool, persistent_workers=2)


# spawn and forkserver start slowly: one ending each (an epoch's end, a break).
@pytest.mark.parametrize(
    ("context", "end"),
    [
        ("fork", "normal"),
        ("fork", "break"),
        pytest.param("spawn", "break", marks=pytest.mark.slow),
        pytest.param("forkserver", "normal", marks=pytest.mark.slow),
    ],
)
def test_start_methods(pool: pinpool.PinPool, context: str, end: str) -> None:
    workers = 2 if context == "fork" else 1
    kw = {"num_workers": workers, "multiprocessing_context": context}
    before = warm_up(pool, **kw)
    pin = loader(Indexed(12), pool, **kw)
    with deadline(60):
        for i, batch in enumerate(pin):
            check_batch(batch, 2 * i)
            if end == "break" and i == 1:
                break
        assert i == (1 if end == "break" else 5)
        del batch, pin
        assert_no_leaks(before, pool)


@pytest.mark.parametrize("end", ["normal", "break", "exception", "loader-deleted"])
def test_zero_copy_mode(pool: pinpool.PinPool, end: str) -> None:
    """Zero-copy mode hands slots to workers with the indices: whatever ends the epoch, every
    slot handed out comes back."""
    before = warm_up(pool, zero_copy=True)
    ds = Failing(40, bad=13) if end == "exception" else Indexed(40)
    pin = loader(ds, pool, zero_copy=True)
    it = iter(pin)
    got = []
    with deadline(60):
        try:
            for batch in it:
                check_batch(batch, 2 * len(got))
                got.append(batch)
                if end == "break" and len(got) == 3:
                    break
                if end == "loader-deleted" and len(got) == 3:
                    del it, pin  # with batches still alive
                    break
        except ValueError as exc:
            assert "Caught ValueError" in str(exc)
            traceback.clear_frames(exc.__traceback__)
        del batch
    assert len(got) == {"normal": 20, "break": 3, "exception": 6, "loader-deleted": 3}[end]
    stats = pool.stats()
    # Every live batch holds a slot (those beyond the pool went to ordinary memory).
    assert stats["slots_checked_out"] >= min(len(got), pool.num_slots), stats
    for i, b in enumerate(got):
        check_batch(b, 2 * i)
    del got, b
    if end != "loader-deleted":
        assert pin.stats()["zero_copy_batches"] >= 1
        del it, pin
    assert_no_leaks(before, pool)


# --------------------------------------------------------------------------- unmapping


def munmap_reference(nbytes: int) -> float:
    """Reference: seconds ``mmap.close()`` takes to unmap ``nbytes`` of touched memory (what
    a thread would stall the others for if it unmapped holding the GIL)."""
    m = mmap.mmap(-1, nbytes)
    for off in range(0, nbytes, mmap.PAGESIZE):
        m[off] = 1
    t0 = time.perf_counter()
    m.close()
    return time.perf_counter() - t0


@pytest.mark.slow
def test_unmapping_big_segments_does_not_block_other_threads() -> None:
    """Growing ~64 MiB batches from 2 persistent workers: smaller segments are retired during
    the epoch, the largest stay mapped until the loader is dropped. Dropping it (workers shut
    down, segments unmapped on the reclaimer thread, ``flush()`` waiting without the GIL)
    must not stall a thread that only wants the GIL back every millisecond.

    (No ``gc.collect()`` inside the measured window: a full collection with torch loaded holds
    the GIL for ~100 ms by itself.)"""
    sizes = [16 * MiB, 24 * MiB, 40 * MiB, 48 * MiB, 64 * MiB, 64 * MiB, 64 * MiB, 64 * MiB]
    with pinpool.PinPool(72 * MiB, 2, device="cpu", copy_threads=1) as pool:
        pin = pinpool.DataLoader(
            Sized(sizes),
            batch_size=None,
            num_workers=2,
            persistent_workers=True,
            pool=pool,
        )
        with probe() as during_epoch:
            for i, batch in enumerate(pin):
                assert batch.shape == (sizes[i],) and int(batch[-1]) == i
                del batch
        s = pool.stats()
        cached = pin.stats()["segments_cached"]
        # Growing batches made the workers retire smaller segments during the epoch ...
        assert s["segments_unmapped"] >= 2, s
        # ... and the newest (largest) ones are still mapped here.
        assert cached >= 2
        mapped_bytes = cached * 80 * MiB
        unmapped_before = s["segments_unmapped"]
        gc.collect()
        with probe() as lateness:
            t0 = time.perf_counter()
            del pin  # by reference count: the loader is not part of a cycle
            pool.flush()
            dropped_in = time.perf_counter() - t0
        s = pool.stats()
        # (a segment retired while this loader lived may be unmapped with them)
        assert s["segments_unmapped"] - unmapped_before >= cached, s
        assert s["segments_mapped"] == s["segments_unmapped"] and s["pending_unmaps"] == 0
        reference = munmap_reference(mapped_bytes)
        worst = max(lateness)
        assert worst < 0.020, (
            f"a thread's 1 ms sleep woke {worst * 1e3:.1f} ms late while the loader (with "
            f"{cached} segments, about {mapped_bytes // MiB} MiB) was dropped and its segments "
            f"unmapped, in {dropped_in * 1e3:.0f} ms; for reference, unmapping as much touched "
            f"memory (mmap.close()) takes {reference * 1e3:.1f} ms, which a thread holding the "
            f"GIL would stall the others for; during the epoch the probe was at worst "
            f"{max(during_epoch) * 1e3:.1f} ms late"
        )
