"""Shutting a ``pinpool.DataLoader``'s workers down: the steps after torch's own shutdown
(reaping every worker, closing the index queues), the shutdown the main thread hands to the
ending thread, undoing a half-made iterator, and the loader's finalizer. The ending thread
itself is ``ending_thread``'s (a module apart: ``import pinpool`` imports it without torch).

Invariants: after :func:`reap_workers` every worker of the iterator has exited and been reaped
(told to exit, then killed after torch's status-check interval); after :func:`shut_down` the
iterator holds no batch (each may hold a slot); :func:`close_loader` stops the workers before
the receiver closes, so that no worker writes into a slot taken back. Nothing runs while the
interpreter exits (torch's shutdown does nothing then either), and nothing here imports
``workers``: the iterator class calls these, never the other way round.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import queue
import time
from typing import Any

from ..._errors import PinPoolError
from ..._native import Handoff
from ..._torch_contract import mp_status_check_interval, python_exit_status, remove_worker_pids
from ..route.receiver import Receiver


class HandedShutdown:
    """A worker shutdown handed to the ending thread by the main thread, which waits on
    ``handoff`` (and may take it back, to have a thread of its own run it: see
    ``WorkersIter._shutdown_now``)."""

    def __init__(self, it: Any) -> None:
        self.it: Any = it  # (a ``workers.WorkersIter``; None once let go)
        self.errors: list[BaseException] = []
        self.handoff = Handoff()

    def run(self) -> None:
        """On the ending thread: the shutdown, unless the main thread took it back."""
        if self.handoff.take():
            self._steps()

    def run_taken_back(self) -> None:
        """The shutdown the main thread took back."""
        self._steps()

    def _steps(self) -> None:
        """Shuts the workers down, keeping what the steps raised. The iterator is let go
        before the main thread is woken, so that it goes there, as the caller's finalizer
        returns (the finalizers of its queues and processes with it)."""
        it, self.it = self.it, None
        try:
            if it is not None:
                self.errors.extend(it._shutdown_steps())
        except BaseException as exc:  # (nothing may escape a thread of pinpool's)
            self.errors.append(exc)
        finally:
            del it
            self.handoff.finish()


def shutting_down_python() -> bool:
    """Whether the interpreter is exiting (torch's worker shutdown then does nothing)."""
    status = python_exit_status()
    return status is True or status is None


def unregister_workers(it: Any) -> None:
    """Takes the workers of torch's iterator ``it`` out of torch's SIGCHLD check, where they
    are registered under the iterator's id (torch refuses an id registered twice): from here
    on torch's handler raises nothing for them."""
    if it.__dict__.get("_worker_pids_set"):
        remove_worker_pids(id(it))
        it.__dict__["_worker_pids_set"] = False


def abandon_half_made(it: Any) -> None:
    """Undoes what torch's ``__init__`` made of an iterator before it raised: its workers
    unregistered from torch's SIGCHLD check (keyed by the iterator's id, which a later
    iterator may be given: torch refuses an id registered twice), stopped (told to, then
    killed) and reaped, its pin thread stopped as torch's shutdown stops it, its queues
    closed; the iterator then counts as shut down (its finalizer does nothing). Nothing here
    raises: the ``__init__``'s error is the one the caller gets."""
    d = it.__dict__
    d["_pinpool_shut_down"] = True
    d["_shutdown"] = True
    try:
        unregister_workers(it)  # (torch's _reset raised: a sampler refused to start)
        done = d.get("_workers_done_event")
        if done is not None:
            done.set()
        for w in d.get("_workers", ()):
            if w.pid is not None and w.exitcode is None:
                w.kill()
            w.join(mp_status_check_interval())
        pin_thread = d.get("_pin_memory_thread")
        if pin_thread is not None:
            d["_pin_memory_thread_done_event"].set()
            d["_worker_result_queue"].put((None, None))  # (wakes it from its wait)
            pin_thread.join(mp_status_check_interval())
        for q in (*d.get("_index_queues", ()), d.get("_worker_result_queue")):
            if q is not None:
                q.cancel_join_thread()
                q.close()
    except Exception:  # (what could not be undone goes with the process)
        pass


def reap_workers(it: Any) -> None:
    """Makes sure every worker of torch's iterator ``it`` has exited, and reaps it: a worker
    torch did not get to tell is told now; one still running after torch's status-check
    interval is killed."""
    if shutting_down_python():
        return
    unregister_workers(it)
    workers = list(getattr(it, "_workers", ()))
    pending = [w for w in workers if w.pid is not None and not _reaped(w)]
    if not pending:
        return
    interval = mp_status_check_interval()
    done = getattr(it, "_workers_done_event", None)
    if done is not None and not done.is_set():
        done.set()
    queues = list(getattr(it, "_index_queues", ()))
    for w, q in zip(workers, queues, strict=False):
        if w in pending and not getattr(q, "_closed", True):
            try:
                q.put(None)  # (a second one, if torch sent it already, is never read)
            except (PinPoolError, OSError, ValueError):
                pass  # (closed: the wait below ends in a kill)
    deadline = time.monotonic() + interval
    running = {w.sentinel: w for w in pending}
    while running and (left := deadline - time.monotonic()) > 0:
        for ready in multiprocessing.connection.wait(list(running), left):
            del running[ready]  # type: ignore[arg-type]
    for w in running.values():
        w.kill()
    # Each has exited, or is exiting: wait until the kernel has made it a zombie, and reap it.
    deadline = time.monotonic() + interval
    for w in pending:
        while not _reaped(w) and time.monotonic() < deadline:
            time.sleep(0.001)
        w.join(0)  # (forgets it: multiprocessing's list of children)


def _reaped(w: Any) -> bool:
    """Whether worker process ``w`` has exited and been reaped. By anyone: a signal handler's
    exception can cut multiprocessing's own reaping short after the wait that reaped the
    worker, before it kept the status (then it takes the worker for alive ever after)."""
    return w.exitcode is not None or not os.path.exists(f"/proc/{w.pid}")


def close_index_queues(it: Any) -> None:
    """torch closes the index queues last: should its shutdown stop before, their writer
    threads and descriptors still end now, not whenever the iterator is collected. And the
    result queue's feeder is not waited for at the interpreter's exit: with a pin thread,
    torch's shutdown puts one message on that queue here and cancels the wait only after
    joining the pin thread; cut short in between, the exit would wait for a feeder that can
    be stuck for ever (a worker that died holding the queue's write lock: torch's hazard)."""
    if shutting_down_python():
        return
    for q in getattr(it, "_index_queues", ()):
        q.cancel_join_thread()
        q.close()
    results = getattr(it, "_worker_result_queue", None)
    if results is not None:
        results.cancel_join_thread()


def shut_down(inner: Any) -> None:
    """Shuts a torch iterator's workers down and drops the batches it still holds (its pin
    thread took them ahead, or they arrived out of order): each may hold a slot."""
    # (pinpool's own shutdown leaves one the ending thread has begun to it: only a caller of
    # torch's _shutdown_workers waits for that, as torch's own does the work before it returns)
    own = getattr(inner, "_shut_down", None)
    shutdown = getattr(inner, "_shutdown_workers", None)
    if shutdown is None:
        return
    try:
        if own is not None:
            own(wait=False)
        else:
            shutdown()
    finally:
        drop_held(inner)


def pids_of(inner: Any) -> tuple[int | None, ...]:
    """The pids of an iterator's workers (for the trace)."""
    return tuple(getattr(w, "pid", None) for w in getattr(inner, "_workers", ()))


def drop_held(inner: Any) -> None:
    """Drops the batches a shut-down torch iterator still holds."""
    data = getattr(inner, "_data_queue", None)
    if isinstance(data, queue.Queue):  # the pin thread's output (in-process, not a pipe)
        while True:
            try:
                data.get_nowait()
            except queue.Empty:
                break
    task_info = getattr(inner, "_task_info", None)
    if isinstance(task_info, dict):
        task_info.clear()


def close_loader(receiver: Receiver) -> None:
    """The loader's finalizer: its workers stop (none may write into a slot taken back
    then), then its receiver closes."""
    if receiver.pid != os.getpid():
        return
    try:
        if receiver.grants is not None:
            receiver.grants.stop()  # (no worker waits for room at the desk while it stops)
        inner = receiver.iterator() if receiver.iterator is not None else None
        if inner is not None:
            shut_down(inner)
    finally:
        receiver.close()
