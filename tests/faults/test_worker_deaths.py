"""A DataLoader worker's death, in every mode: torch's error reaches the consumer at once,
whatever pinpool code its SIGCHLD handler happens to raise it in, and once the iterator is
dropped no worker process is left, running or as a zombie (``pinpool._signals``, and
``_main.epochs.workers.WorkersIter._shutdown_workers``).

A signal's Python handler runs in the main thread between any two steps of whatever runs
there, so where it lands is a matter of timing: the end-to-end tests repeat their trials, in
a setting where it lands in pinpool's receiver more often than not, and cover the modes inside
one test (copy and zero-copy, with and without torch's pin thread; ``make test`` runs this
file once). The other tests raise a signal at a chosen step, as a handler would.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import child_pids, process_state
from handles import HandleFactory
from loader_datasets import Dying, Indexed, Paced

import pinpool
import pinpool._wire.handle
import pinpool._wire.peer
from pinpool._main.epochs import ending_thread

#: Run alone, as the other fault tests (``test_loader_faults.py`` says why).
pytestmark = pytest.mark.faults

MiB = 1 << 20
#: (zero_copy, torch's pin thread)
MODES = [(False, False), (True, False), (False, True), (True, True)]
#: torch checks its workers every 5 s (``MP_STATUS_CHECK_INTERVAL``) when its SIGCHLD
#: handler's error is lost on the way: a death noticed later than this was.
LATE_S = 2.0


class Interrupted(Exception):
    """What the test's signal handlers raise."""


@contextlib.contextmanager
def accelerator(present: bool) -> Iterator[None]:
    """torch's DataLoader with its pin-memory thread (as where an accelerator is present:
    batches taken ahead, on another thread) or without it (taken on the consumer's thread),
    on any machine (pinpool's handles do their own pinning; the pool here is host memory)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.accelerator, "is_available", lambda: present)
        if present:
            mp.setattr(torch.accelerator, "current_accelerator", lambda *a: torch.device("cuda"))
            mp.setattr(torch.accelerator, "current_device_index", lambda: 0)
            mp.setattr(torch.accelerator, "set_device_index", lambda index: None)
        yield


@contextlib.contextmanager
def handler(signum: int, fn: Callable[[int, Any], None]) -> Iterator[None]:
    """``fn`` as the handler of ``signum`` for the block. Other libraries' gc callbacks
    (hypothesis installs one) are set aside meanwhile: Python reports an exception raised while
    a gc callback runs as unraisable and goes on, so a handler's exception landing there would
    be lost to the code under test (and fail the test as an unraisable exception)."""
    callbacks = gc.callbacks[:]
    gc.callbacks.clear()
    old = signal.signal(signum, fn)
    try:
        yield
    finally:
        signal.signal(signum, old)
        gc.callbacks[:] = callbacks


def raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(f"signal {signum}")


def leftovers(before: set[int], workers: list[int]) -> list[str]:
    """This process's children that were not there ``before`` (zombies included), and the
    ``workers`` still alive (a forkserver's workers are not this process's children)."""
    out = [f"child {pid} ({process_state(pid)})" for pid in sorted(child_pids() - before)]
    for pid in workers:
        state = process_state(pid)
        if state is not None and f"child {pid} ({state})" not in out:
            out.append(f"worker {pid} ({state})")
    return out


def worker_pids(it: Any) -> list[int]:
    return [w.pid for w in it._inner._workers]


def died_at(stamp: Path) -> float:
    return float(stamp.read_text())


Trial = tuple[float, str, Any, Any, set[int], list[int]]


def killed_trial(
    stamp: Path, make: Callable[..., Any], then: Callable[[], Any] | None = None
) -> Trial:
    """One loader of four workers whose third is SIGKILLed in its first batch, iterated until
    the error: (seconds from its death to the consumer's error, the error, the iterator (None
    if ``iter()`` raised), the loader, this process's children before, the workers).
    ``then`` runs right after ``iter()``, inside the timing."""
    stamp.unlink(missing_ok=True)
    loader = make(Dying(400, bad=4, how="kill", stamp=str(stamp)), batch_size=2, num_workers=4)
    before = child_pids()
    it: Any = None
    workers: list[int] = []
    error = "no error"
    try:
        # (The error can come in iter() already: the worker may die while the first batches'
        # indices are still being sent.)
        it = iter(loader)
        workers = [w.pid for w in getattr(it, "_inner", it)._workers]
        if then is not None:
            then()
        for batch in it:
            del batch
    except RuntimeError as exc:  # (pinpool's WorkerLost is one too)
        error = f"{type(exc).__name__}: {exc}"
    delay = time.monotonic() - died_at(stamp)
    return delay, error, it, loader, before, workers


def killed_in_turn(stamp: Path, make: Callable[..., Any]) -> tuple[float, str, list[str]]:
    """:func:`killed_trial`: (the delay, the error, what is left once the iterator is gone)."""
    delay, error, it, loader, before, workers = killed_trial(stamp, make)
    del it, loader
    # What a trial left in reference cycles goes now, not in the next trial's timing: the
    # collector runs finalizers (multiprocessing's, weakref callbacks) where a handler's
    # exception is lost to anyone, pinpool's or not.
    gc.collect()
    return delay, error, leftovers(before, workers)


@pytest.mark.slow
def test_a_killed_workers_error_comes_at_once(tmp_path: Path) -> None:
    """A worker SIGKILLed mid-epoch: the consumer gets torch's error as soon as torch's SIGCHLD
    handler has run, wherever it ran (in the receiver opening another worker's segment or
    making the pool, say), not from torch's status check seconds later; as torch's own loader
    does. Four workers, the third killed in its first batch while the others' first batches
    arrive: the main process is then mostly in the receiver."""
    stamp = tmp_path / "died"
    reference, _, _ = killed_in_turn(stamp, torch.utils.data.DataLoader)
    seen = []
    for _ in range(3):
        for zero_copy, pin_thread in MODES:
            with accelerator(pin_thread):
                kw = {"zero_copy": True, "stream_samples": False} if zero_copy else {}
                delay, error, left = killed_in_turn(stamp, partial(pinpool.DataLoader, **kw))
            seen.append(f"zero_copy={zero_copy} pin_thread={pin_thread}: {delay:.2f} s")
            assert "DataLoader worker (pid" in error, error
            assert delay < LATE_S, (
                f"the error came {delay:.2f} s after the worker's death (torch's own loader: "
                f"{reference:.2f} s); trials so far: {seen}"
            )
            assert not left, f"left after the iterator was dropped: {left}"


@pytest.mark.slow
def test_a_killed_workers_error_comes_at_once_while_an_old_iterator_is_dropped(
    tmp_path: Path,
) -> None:
    """As above, while the last epoch's iterator is dropped on the main thread: its workers'
    shutdown runs in its finalizer, the new iterator's worker dies meanwhile, and torch's
    SIGCHLD handler raises in there. The finalizer hands the error back, and it must come as
    soon as the finalizer is left: torch's handler reports a failed worker only once (it
    forgets that iterator's workers as it raises), so running the handler again would find
    nothing, and the error would wait for torch's status check, 5 s later (half the trials
    did before the finalizer raised the handed-back error itself). Two modes: the finalizer's
    path is the same in every mode."""
    stamp = tmp_path / "died"
    lost: list[tuple[str, BaseException | None, list[str]]] = []

    def keep(u: Any) -> None:
        # The frames it was raised through, as text: the traceback itself would keep the
        # iterators those frames name alive, and their workers with them.
        frames, tb = [], u.exc_traceback
        while tb is not None:
            frames.append(f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}")
            tb = tb.tb_next
        if u.exc_value is not None:
            u.exc_value.__traceback__ = None
        lost.append((repr(u.object), u.exc_value, frames))

    with pytest.MonkeyPatch.context() as mp:
        # What no one could be told (an exception raised in a finalizer or a weakref callback),
        # kept to be checked below.
        mp.setattr(sys, "unraisablehook", keep)
        for zero_copy, pin_thread in [(True, False), (False, True)]:
            old: list[Any] = []
            make = partial(pinpool.DataLoader, zero_copy=zero_copy)
            for trial in range(4):
                with accelerator(pin_thread):
                    # (The last trial's iterator and its workers are shut down in ``then``.)
                    delay, error, it, loader, before, workers = killed_trial(
                        stamp, make, then=old.clear
                    )
                    old += [it, loader]  # (dropped in the next trial)
                    del it, loader
                case = f"zero_copy={zero_copy} pin_thread={pin_thread}, trial {trial}"
                assert "DataLoader worker (pid" in error, f"{case}: {error}"
                assert delay < LATE_S, f"{case}: the error came {delay:.2f} s after the death"
            old.clear()
            gc.collect()  # (an iterator an exception's frames hold in a cycle goes here)
            # (An iterator dropped while its workers exit hands their join to the ending
            # thread: what is left is what is still there once it is done.)
            assert ending_thread.wait_all(30)
            assert not leftovers(before, workers)
    # torch's handler may also raise in another library's weakref callback (one that runs as
    # the old iterator goes), where Python only prints it: pinpool's consumer finds the death
    # itself then (WORKERS_LOOKED_AT_S). Nothing else, and nothing in pinpool's code, is lost.
    package = os.path.dirname(pinpool.__file__)
    for where, exc, frames in lost:
        ours = [f for f in frames if f.startswith(package)]
        assert isinstance(exc, RuntimeError) and "DataLoader worker (pid" in str(exc), (
            f"lost in {where}: {exc!r} ({frames})"
        )
        assert not ours, f"torch's error lost in pinpool's code ({where}): {ours}"


@pytest.mark.parametrize("zero_copy", [False, True])
def test_an_iterator_collected_on_its_own_pin_thread_is_shut_down(zero_copy: bool) -> None:
    """An epoch left early whose iterator is in a reference cycle (an exception's frames hold
    it, say) is collected wherever an allocation sets the collector off: here on its own pin
    thread, which is still taking batches ahead. torch's shutdown joins that thread, which
    cannot join itself: the shutdown goes to the ending thread, nothing is raised into the
    void ("cannot join current thread"), and every worker is reaped, the pin thread gone."""
    lost: list[BaseException] = []
    collected_on: list[str] = []
    real_pin = pinpool._wire.handle.BatchHandle.pin_memory
    armed = [False]

    def pin_memory(self: Any) -> Any:
        if armed[0]:
            armed[0] = False
            collected_on.append(threading.current_thread().name)
            gc.collect()  # (the iterator is collected here, on its pin thread)
        return real_pin(self)

    pool = pinpool.PinPool(2 * MiB, 16, device="cpu")
    with accelerator(True), pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "unraisablehook", lambda u: lost.append(u.exc_value))
        mp.setattr(pinpool._wire.handle.BatchHandle, "pin_memory", pin_memory)
        loader = pinpool.DataLoader(
            Paced(400, (4,), 0.02), batch_size=2, num_workers=2, pool=pool, zero_copy=zero_copy
        )
        before = child_pids()
        it = iter(loader)
        workers = worker_pids(it)
        pin_thread = it._inner._pin_memory_thread
        batch = next(it)
        del batch
        cycle: list[Any] = [it]
        cycle.append(cycle)
        armed[0] = True
        del it, cycle
        deadline = time.monotonic() + 10
        while armed[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert collected_on and collected_on[0] == pin_thread.name, collected_on
        ending_thread.wait_all(30)
        pin_thread.join(10)
        assert not pin_thread.is_alive()
        left = leftovers(before, workers)
    assert not lost, lost
    assert not left, f"left after the iterator was collected: {left}"
    del loader
    gc.collect()
    pool.flush()
    assert pool.stats()["slots_free"] == pool.num_slots, pool.stats()


@pytest.mark.parametrize("zero_copy, pin_thread", [(True, False), (False, True)])
def test_a_death_no_sigchld_reports_is_found_by_the_waiting_consumer(
    tmp_path: Path, zero_copy: bool, pin_thread: bool
) -> None:
    """torch's SIGCHLD handler set aside (as when its error is lost, or no SIGCHLD comes: a
    forkserver's workers): the consumer, waiting for the dead worker's batch, finds the death
    itself, within ``WORKERS_LOOKED_AT_S``, not at torch's status check 5 s later."""
    from pinpool._main.epochs.workers import WORKERS_LOOKED_AT_S

    stamp = tmp_path / "died"
    with accelerator(pin_thread):
        with handler(signal.SIGCHLD, lambda signum, frame: None):
            delay, error, it, loader, before, workers = killed_trial(
                stamp, partial(pinpool.DataLoader, zero_copy=zero_copy)
            )
        del it, loader
        gc.collect()
    assert "exited unexpectedly" in error, error
    assert delay < WORKERS_LOOKED_AT_S + 0.75, f"found {delay:.2f} s after the death"
    assert not leftovers(before, workers)


@pytest.mark.slow
def test_no_worker_is_left_after_a_death() -> None:
    """Whatever kills a worker (SIGKILL mid-batch, ``os._exit(3)`` just after it sent its
    first batch, an exception in ``__getitem__``), in every mode, with the garbage collector
    on and off: once the consumer has the error and drops the iterator, every worker has
    exited and been reaped (nothing to wait for)."""
    pool = pinpool.PinPool(2 * MiB, 8, device="cpu")
    deaths = [("kill", 7), ("exit", 4), ("raise", 7)]  # (each in a worker's second batch)
    for i in range(12):
        zero_copy, pin_thread = MODES[i % 4]
        how, bad = deaths[i % 3]
        collect = (i // 4) % 2 == 0
        case = f"{how}, zero_copy={zero_copy}, pin_thread={pin_thread}, gc={collect}"
        with accelerator(pin_thread):
            loader = pinpool.DataLoader(
                Dying(40, bad=bad, how=how),
                batch_size=2,
                num_workers=2,
                pool=pool,
                zero_copy=zero_copy,
                timeout=30,
            )
            before = child_pids()
            if not collect:
                gc.disable()
            try:
                it = iter(loader)
                workers = worker_pids(it)
                error = "no error"
                try:
                    for batch in it:
                        del batch
                except Exception as exc:  # (kept as text: its frames hold the iterator)
                    error = f"{type(exc).__name__}: {exc}"
                del it
                left = leftovers(before, workers)
            finally:
                gc.enable()
        expected = "sample 7 is broken" if how == "raise" else "DataLoader worker (pid"
        assert expected in error, f"{case}: {error}"
        assert not left, f"{case}: left after the iterator was dropped: {left} ({error})"
        del loader
    gc.collect()
    pool.flush()
    s = pool.stats()
    assert s["slots_free"] == pool.num_slots, s
    assert s["segments_mapped"] == s["segments_unmapped"], s


@pytest.mark.slow
@pytest.mark.parametrize(
    "context, how, zero_copy, pin_thread",
    [("forkserver", "exit", False, False), ("spawn", "kill", True, True)],
)
def test_no_worker_is_left_after_a_death_with_other_start_methods(
    context: str, how: str, zero_copy: bool, pin_thread: bool
) -> None:
    """As above, with workers started by a forkserver (not this process's children: no
    SIGCHLD tells their deaths, which torch finds at its status check, and their exits are
    waited for through the forkserver) or spawned."""
    if context == "forkserver":  # (started once, for good, by its first use)
        multiprocessing.forkserver.ensure_running()
    multiprocessing.resource_tracker.ensure_running()
    pool = pinpool.PinPool(2 * MiB, 8, device="cpu")
    with accelerator(pin_thread):
        loader = pinpool.DataLoader(
            Dying(40, bad=7, how=how),
            batch_size=2,
            num_workers=2,
            pool=pool,
            zero_copy=zero_copy,
            multiprocessing_context=context,
        )
        before = child_pids()
        it = iter(loader)
        workers = worker_pids(it)
        error = "no error"
        try:
            for batch in it:
                del batch
        except RuntimeError as exc:
            error = f"{type(exc).__name__}: {exc}"
        del it
        left = leftovers(before, workers)
    assert "DataLoader worker (pid" in error, error
    assert not left, f"left after the iterator was dropped: {left}"


# --------------------------------------------------------------------------- at a chosen step


def test_a_signal_handlers_exception_in_the_receiver_goes_on() -> None:
    """An exception a signal handler raises while the receiver takes hold of a batch's segment
    goes on to the caller: as the batch arrives (torch's SIGCHLD error would be lost there, and
    the consumer would wait out torch's status check), and as an undelivered batch is dropped,
    where the finalizer that drops it sends the signal again, to raise in the main thread once
    it is out of the finalizer."""
    pool = pinpool.PinPool(2 * MiB, 4, device="cpu")
    loader = pinpool.DataLoader(Indexed(4), batch_size=2, pool=pool)
    factory = HandleFactory(loader)
    real_open = pinpool._wire.peer.open_fd_of
    armed = [False]

    def open_fd_of(pid: int, fd: int) -> int:
        if armed[0]:
            armed[0] = False
            signal.raise_signal(signal.SIGUSR1)  # (the handler raises here, before the open)
        return real_open(pid, fd)

    receiver = loader._pinpool_receiver
    with (
        handler(signal.SIGUSR1, raise_interrupted),
        pytest.MonkeyPatch.context() as mp,
    ):
        mp.setattr(pinpool._wire.peer, "open_fd_of", open_fd_of)
        # As the batch arrives (on the consumer's thread, where there is no pin thread).
        handle = factory.make()
        armed[0] = True
        with pytest.raises(Interrupted):
            receiver.receive_now(handle)
        assert not armed[0]
        del handle
        gc.collect()
        # As an undelivered batch is dropped (by its finalizer).
        factory.write()
        handle = factory.make()
        armed[0] = True
        t0 = time.monotonic()
        with pytest.raises(Interrupted):
            del handle
            while time.monotonic() - t0 < 5:
                time.sleep(0.01)
        assert time.monotonic() - t0 < LATE_S
        assert not armed[0]
    del loader, factory
    gc.collect()


@pytest.mark.parametrize("zero_copy, pin_thread", [(True, True), (False, False)])
def test_a_signal_handlers_exception_while_the_workers_shut_down(
    zero_copy: bool, pin_thread: bool
) -> None:
    """A SIGCHLD handler that raises on every child's exit (a program's own, say) while the
    iterator is dropped mid-epoch: run on the main thread, torch's worker shutdown would be
    cut short by its exception (in its joins, in the clean-up after them, in pinpool's steps
    after those). Every worker is reaped before the iterator's finalizer returns, and the
    exception is raised in the consumer right after it, not swallowed by the finalizer nor
    by the finalizers of the iterator's queues and processes, which run as it goes."""
    here = sys._getframe().f_code
    armed = [True]

    def on_child_exit(signum: int, frame: Any) -> None:
        # Raises wherever it lands, until it has raised here, in the consumer.
        if armed[0]:
            armed[0] = frame is None or frame.f_code is not here
            raise Interrupted(f"signal {signum}")

    pool = pinpool.PinPool(2 * MiB, 16, device="cpu")
    for _ in range(2):
        with accelerator(pin_thread):
            loader = pinpool.DataLoader(
                Indexed(400), batch_size=2, num_workers=4, pool=pool, zero_copy=zero_copy
            )
            before = child_pids()
            it = iter(loader)
            workers = worker_pids(it)
            for _ in range(2):
                batch = next(it)
                del batch
            armed[0] = True
            t0 = time.monotonic()
            with handler(signal.SIGCHLD, on_child_exit), pytest.raises(Interrupted):
                del it
                while time.monotonic() - t0 < 5:
                    time.sleep(0.01)
            raised_after = time.monotonic() - t0
            left = leftovers(before, workers)
        assert not left, f"left after the iterator was dropped: {left}"
        assert raised_after < LATE_S, f"the handler's exception came {raised_after:.2f} s late"
        del loader
    gc.collect()
    pool.flush()
    assert pool.stats()["slots_free"] == pool.num_slots, pool.stats()


@pytest.mark.parametrize("zero_copy, pin_thread", [(True, True), (False, False)])
def test_torchs_error_in_the_shutdown_of_a_failed_iterator(
    zero_copy: bool, pin_thread: bool
) -> None:
    """A worker has died and torch's SIGCHLD handler has not said so yet (as when pinpool's
    ``WorkerLost`` reached the consumer first: the worker exited before its segment was
    opened) as the iterator is dropped: the handler raises torch's error for it in the
    shutdown, as the other workers exit. The shutdown still ends with every worker reaped,
    the slots and segments of the iterator's workers are back at once (not when the loader
    goes), and nothing about an iterator the consumer dropped is raised to it. (Here the
    worker is killed while torch's handler is set aside, and the handler is back before the
    iterator is dropped.)"""
    pool = pinpool.PinPool(2 * MiB, 16, device="cpu")
    with accelerator(pin_thread):
        loader = pinpool.DataLoader(
            Indexed(400), batch_size=2, num_workers=3, pool=pool, zero_copy=zero_copy
        )
        before = child_pids()
        it = iter(loader)
        workers = worker_pids(it)
        for _ in range(4):
            batch = next(it)
            del batch
        dead = workers[-1]  # (torch joins it last: the others' exits come first)
        with handler(signal.SIGCHLD, signal.SIG_DFL):  # (no Python handler, nothing reaped)
            os.kill(dead, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while process_state(dead) != "Z" and time.monotonic() < deadline:
                time.sleep(0.005)
        assert process_state(dead) == "Z"
        del it  # torch's handler raises in there
        time.sleep(0.5)  # (an error sent back to the consumer would be raised here)
        left = leftovers(before, workers)
        assert not left, f"left after the iterator was dropped: {left}"
        gc.collect()
        pool.flush()
        s = pool.stats()
        assert s["slots_free"] == pool.num_slots, s  # (grants dropped with the iterator)
        assert s["segments_mapped"] == s["segments_unmapped"], s
        del loader
