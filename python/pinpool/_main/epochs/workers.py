"""A ``pinpool.DataLoader``'s workers: torch's multi-process iterator with pinpool's
changes (:class:`WorkersIter`), and their shutdown, finished whatever interrupts torch's.

At an epoch's natural end (every task sent to a worker answered, workers not persistent) the
training thread only starts the shutdown: torch's steps (stopping the pin thread, telling each
worker to exit, joining it) and pinpool's (reaping, closing the index queues) run on a thread
of their own, while the kernel tears the exiting workers down, so the final ``next()`` does not
wait for it. No worker has a task then, so none writes into the arena any more.

Invariants: once :meth:`WorkersIter._shutdown_workers` (or :func:`shut_down`) returns, every
worker of the iterator has exited and been reaped, and its index queues are closed, whatever
a signal handler raised meanwhile: on the main thread the shutdown runs on the ending thread,
where no handler runs, and the main thread waits for it in a wait no handler cuts short (the
handler's exception is raised as the wait returns; should the ending thread be busy with
another shutdown for a second, the main thread takes this one back and has a thread of its
own run it). Except at an epoch's natural end, where the shutdown is the ending thread's to
finish (later calls leave it to it), the workers, having no task, writing nothing any more;
and where the iterator's own pin thread calls it (the collector ran the iterator's finalizer
there), which cannot join itself: the ending thread finishes it, and what must wait for the
workers' exit waits for it (``after_shutdown``).
Nothing is done in a process forked from the one that started the workers. The steps after
torch's shutdown (reaping, closing the queues), the loader's finalizer and :func:`shut_down`
are ``shutdown``'s (re-exported here, where the loader imports them), and the thread that
finishes a shutdown is ``ending_thread``'s.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from ... import _signals, _trace
from ..._torch_contract import (
    MultiProcessingIter,
    mp_status_check_interval,
    profiler_enabled,
    serialize_polls,
)
from ..._wire.handle import BatchHandle, WorkerProgress
from . import ending_thread
from .index_queue import write_directly
from .results import WholeMessages
from .shutdown import (
    HandedShutdown,
    abandon_half_made,
    close_index_queues,
    close_loader,
    drop_held,
    pids_of,
    reap_workers,
    shut_down,
    shutting_down_python,
    unregister_workers,
)

__all__ = ["WORKERS_LOOKED_AT_S", "WorkersIter", "close_loader", "shut_down"]

#: How often a consumer waiting for a batch looks at the workers' states (torch: every 5 s).
WORKERS_LOOKED_AT_S = 0.25


class WorkersIter(MultiProcessingIter):
    """torch's multi-process iterator, with six changes.

    - Without a pin thread, the consumer's thread reads the result queue one whole message
      at a time (``results.WholeMessages``: an interrupt never leaves the pipe out of step),
      and a batch's segment is received (opened through its worker's ``/proc`` entry the
      first time, see ``Receiver.receive_now``) as soon as its handle comes out of the queue,
      as the pin thread does on a GPU machine, not only when the consumer reaches it: by then
      its worker may have exited (an iterable dataset's worker whose data has run out is told
      to exit at once) or died.
    - Batch indices are written to each worker's pipe by a Rust thread, not by a Python
      feeder thread per worker (``_main.epochs.index_queue``).
    - The first batches are dealt out from worker ``first`` on instead of worker 0 (a resumed
      iterable dataset's epoch, whose next batch is that worker's). torch deals to the
      workers in turn from ``_worker_queue_idx_cycle``, made afresh as each epoch starts: the
      first one made is turned on to ``first``.
    - ``__next__`` opens no profiler range around each batch when no profiler is recording.
    - A consumer waiting for a batch looks at the workers' states every
      :data:`WORKERS_LOOKED_AT_S`, not every 5 s (see ``_try_get_data``).
    """

    def __init__(self, loader: Any, first: int) -> None:
        self._pinpool_first = first
        self._pinpool_receiver = loader._pinpool_receiver
        self._pinpool_pid = os.getpid()
        t0 = _trace.on and _trace.now()
        try:
            super().__init__(loader)
        except BaseException:
            # Half made (a worker that could not start: a pickling error, no file descriptor
            # left): what torch made goes now, silently, and nothing is left for __del__.
            abandon_half_made(self)
            raise
        if not self._pin_memory:
            self._data_queue = WholeMessages(self._worker_result_queue)
        for w in self._workers:
            serialize_polls(w)  # (the ending thread reaps them, and the caller may join them)
        if not self._persistent_workers:
            ending_thread.start()  # (now, not at the epoch's end: see ending_thread's doc)
        if t0:
            _trace.span("workers.start", t0, workers=loader.num_workers)

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        if first_iter:  # the workers have started; nothing was sent to them yet
            for q in self._index_queues:
                write_directly(q)
        else:
            # Persistent workers, a new epoch: torch gets and drops what the last one left in
            # the result queue.
            self.__dict__["_pinpool_draining"] = True
        try:
            super()._reset(loader, first_iter)
        finally:
            self.__dict__["_pinpool_draining"] = False

    def __next__(self) -> Any:
        # torch's __next__ opens a profiler range (``record_function``) around each batch,
        # which costs the training thread a dispatcher call in and out even when no profiler
        # runs (docs/performance.md, "Measurements behind the code"). Without a profiler (and
        # in the cases where torch's does more: a first call, an iterable dataset's length
        # check) the same steps without it.
        if (
            profiler_enabled()
            or self._sampler_iter is None
            or self._IterableDataset_len_called is not None
        ):
            return super().__next__()
        data = self._next_data()
        self._num_yielded += 1
        return data

    def _try_get_data(self, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        # torch looks at its workers' states whenever a wait for data ends empty-handed, and
        # waits 5 s at a time (its status-check interval): a death its SIGCHLD handler's
        # error did not report (the handler raised in a finalizer or a weakref callback,
        # where Python only prints the error; or no SIGCHLD came: a forkserver's workers)
        # is then found up to 5 s late. The same wait, in slices of WORKERS_LOOKED_AT_S.
        timeout = args[0] if args else kwargs.get("timeout", mp_status_check_interval())
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            success, data = super()._try_get_data(max(min(left, WORKERS_LOOKED_AT_S), 0.0))
            if success or left <= WORKERS_LOOKED_AT_S:
                break
        if success and not self._pin_memory:
            handle = handle_of(data[1])
            if handle is not None:
                self._pinpool_receiver.receive_now(handle)
        return success, data

    def _shutdown_workers(self) -> None:
        # torch's shutdown can leave workers behind: one that outlives SIGTERM and its last
        # wait, and, were it run on the main thread, whatever a signal handler's exception
        # cut it short of (a SIGCHLD comes as each worker exits, and torch's own handler
        # raises if one has failed): workers left running, or exited with nobody to reap
        # them. See ``_shutdown_now``; what torch left is done after it, whatever it raised;
        # then the first exception is raised again.
        # (Nothing in a process forked from this one, where a copy of the iterator may be
        # collected: its workers and their done event are this process's.)
        self._shut_down(wait=True)

    def _shut_down(self, wait: bool) -> None:
        if getattr(self, "_pinpool_pid", None) != os.getpid():
            return
        ended = self.__dict__.get("_pinpool_ended")
        if ended is not None:
            # Begun at the epoch's end: the ending thread finishes it. A caller of torch's
            # _shutdown_workers finds it done when it returns, as torch's does (not the
            # collector's finalizer, nor the threads that finish it).
            if wait and not ending_thread.on_ending_thread() and not self._on_own_pin_thread():
                ended.wait()
            return
        if self.__dict__.get("_pinpool_shut_down"):
            return
        if self._ends_naturally():
            self._end_in_background()
            return
        t0 = _trace.on and _trace.now()
        try:
            self._shutdown_now()
        finally:
            if t0:
                _trace.span("workers.shutdown", t0, pids=pids_of(self))

    def _ends_naturally(self) -> bool:
        """Whether the epoch is over with nothing left in flight: workers not persistent,
        each task sent to them answered and taken, nothing shut down yet."""
        return (
            not self._persistent_workers
            and not getattr(self, "_shutdown", True)
            and self._rcvd_idx >= self._send_idx
            and not shutting_down_python()
        )

    def _end_in_background(self) -> None:
        """Hands the shutdown's waits to the ending thread (see the module's doc). The
        workers' pids leave torch's SIGCHLD check first: their exits no longer concern the
        training thread, whose batches are all in (or whose iterator is being collected)."""
        t0 = _trace.on and _trace.now()
        unregister_workers(self)
        self.__dict__["_pinpool_then"] = []
        self.__dict__["_pinpool_ended"] = ending_thread.hand_over(self._finish_ending)
        if t0:
            _trace.span("workers.shutdown", t0, background=True, pids=pids_of(self))

    def after_shutdown(self, then: Callable[[], None]) -> bool:
        """Has ``then`` called once the ending thread has shut the workers down; False
        (nothing done) where the shutdown was not handed to it."""
        if self.__dict__.get("_pinpool_ended") is None:
            return False
        with _THEN_LOCK:
            later = self.__dict__["_pinpool_then"]
            if later is not None:  # (None: the shutdown is done)
                later.append(then)
                return True
        then()
        return True

    def _finish_ending(self) -> None:
        t0 = _trace.on and _trace.now()
        try:
            self._shutdown_now()
            drop_held(self)
        except BaseException as exc:  # (nothing may escape the ending thread)
            _warn_ending(exc)
        finally:
            with _THEN_LOCK:
                later, self.__dict__["_pinpool_then"] = self.__dict__["_pinpool_then"], None
            for then in later:
                try:
                    then()
                except BaseException as exc:
                    _warn_ending(exc)
            if t0:
                _trace.span("workers.end", t0)

    def _shutdown_now(self) -> None:
        # A signal's Python handler runs in the main thread between any two steps of what
        # that thread runs (inside an ``except`` clause too), and a SIGCHLD comes as each
        # worker exits: no Python code there can both be cut short by its exception and be
        # sure to finish its steps. So the main thread hands the shutdown to the ending
        # thread, where no handler runs, and waits in a wait no handler cuts short
        # (``_native.Handoff``); a handler whose signal came meanwhile runs as the wait
        # returns, its exception going on to the caller once every worker is reaped (an
        # interrupt too: Ctrl-C waits for the shutdown, which torch's joins bound, 5 s a
        # worker that does not exit, and pinpool's kill after them).
        # (Should the ending thread not take the shutdown up soon, busy with another, the main
        # thread takes it back and has a thread of its own run it: a lock the main thread
        # holds might be what that other shutdown waits for.)
        if self.__dict__.get("_pinpool_shut_down"):
            return  # (done whole before: each step would find nothing to do)
        if self._on_own_pin_thread():
            # The collector ran this iterator's finalizer on its own pin thread (the iterator
            # in a reference cycle, collected where an allocation set the collector off).
            # torch's shutdown joins that thread, which cannot join itself: the ending thread
            # does it all (what is to follow it waits for it: ``after_shutdown``), once this
            # thread is back in its loop, where it sees the shutdown's done event and ends.
            # Nothing waits for it here: that would wait for ever.
            self._end_in_background()
            return
        if _on_main_thread_with_an_ending_thread():
            handed = HandedShutdown(self)
            ending_thread.hand_over(handed.run)
            if not handed.handoff.wait(_TAKEN_UP_S):
                try:
                    threading.Thread(
                        target=handed.run_taken_back, name="pinpool-workers-shutdown", daemon=True
                    ).start()
                except RuntimeError:  # (no thread can start: here, then)
                    handed.run_taken_back()
                handed.handoff.wait()
            errors = handed.errors
        else:
            errors = self._shutdown_steps()
        if errors:
            raise errors[0]

    def _on_own_pin_thread(self) -> bool:
        pin_thread = self.__dict__.get("_pin_memory_thread")
        return pin_thread is not None and pin_thread is threading.current_thread()

    def _shutdown_steps(self) -> list[BaseException]:
        """torch's shutdown, then pinpool's reaping and closing of what it left; the errors
        they raised (each step is done whatever the one before raised)."""
        errors: list[BaseException] = []
        try:
            super()._shutdown_workers()
        except BaseException as exc:
            errors.append(exc)
        try:
            reap_workers(self)
            close_index_queues(self)
        except BaseException as exc:
            errors.append(exc)
        if not errors and getattr(self, "_shutdown", False):
            self.__dict__["_pinpool_shut_down"] = True
        return errors

    def __del__(self) -> None:
        try:
            self._shut_down(wait=False)
        except BaseException as exc:
            if not _signals.hand_back(exc):
                raise

    @property  # type: ignore[override]
    def _worker_queue_idx_cycle(self) -> Iterator[int]:
        return self.__dict__["_pinpool_cycle"]  # type: ignore[no-any-return]

    @_worker_queue_idx_cycle.setter
    def _worker_queue_idx_cycle(self, cycle: Iterator[int]) -> None:
        for _ in range(self.__dict__.pop("_pinpool_first", 0)):
            next(cycle)
        self.__dict__["_pinpool_cycle"] = cycle


#: Guards each iterator's list of what to do after its shutdown on the ending thread.
_THEN_LOCK = threading.Lock()


def _warn_ending(exc: BaseException) -> None:
    warnings.warn(
        f"pinpool: the workers of an ended epoch could not all be shut down: {exc!r}",
        RuntimeWarning,
        stacklevel=2,
    )


def _on_main_thread_with_an_ending_thread() -> bool:
    """Whether a shutdown called here is handed to the ending thread (see
    ``WorkersIter._shutdown_now``): on the main thread, where signal handlers run, while the
    interpreter is not exiting (torch's shutdown does nothing then, and a daemon thread may
    not run again)."""
    return (
        threading.current_thread() is threading.main_thread()
        and not sys.is_finalizing()
        and not shutting_down_python()
    )


#: How long the main thread waits for the ending thread to take a shutdown up before doing it
#: itself (see ``WorkersIter._shutdown_now``).
_TAKEN_UP_S = 1.0


def handle_of(item: Any) -> BatchHandle | None:
    """The batch handle ``item`` is or carries, if any."""
    if isinstance(item, WorkerProgress):
        item = getattr(item, "batch", None)  # (a damaged one is refused in its turn)
    return item if isinstance(item, BatchHandle) else None
