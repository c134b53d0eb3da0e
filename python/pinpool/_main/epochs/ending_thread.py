"""One thread per process that runs worker shutdowns: those of ended epochs, and the rest.

At an epoch's natural end the training thread only hands the rest of its workers' shutdown
(torch's joins, pinpool's reaping and taking back) to this thread, so that the final
``next()`` waits for none of it (see ``workers``). Any other shutdown called on the main
thread (an epoch left early, an error, the loader's deletion) runs here too, the main thread
waiting for it: no signal handler runs on this thread, to cut it short. The thread is started
once, when the first loader with workers starts them, rather than at the epoch's end: a
thread started then would hold the GIL for up to a switch interval before the training
thread could go on.

The thread is this module; the steps it runs are ``shutdown``'s. The two are apart because
``import pinpool`` imports this one (``pinpool.wait_for_freed_pools``) and must not need torch,
while the steps read torch's internals.

Invariants: each handed-over shutdown runs once, in the order handed over, and its event is
set when it has run (whatever it raised); :func:`wait_all` returns once every shutdown handed
over before it was called has run (only the interpreter's exit waits for it in pinpool: the
workers of an ended epoch have no task left, so nothing else has to wait for their exit;
tests use it to count what they leave); a process forked from this one starts a thread of
its own (the parent's is not running there) and inherits no pending shutdown; nothing here
imports torch, or a module that does.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable

from ..._native import wait_for_freed_pools as _freed

#: Guards the thread's start. Re-entrant: a collection set off while it is held can run,
#: on the same thread, a finalizer that hands a shutdown over.
_lock = threading.RLock()
_pid = 0
_thread: threading.Thread | None = None
_work: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = queue.SimpleQueue()
#: Each handed-over shutdown's event until it has run. No lock: its appends and removals are
#: each one step under the GIL, and a lock held around them could be wanted by a finalizer
#: that a collection runs meanwhile, or by the ending thread while the main thread waits.
_pending: list[threading.Event] = []


def start() -> None:
    """Starts this process's ending thread if it is not running yet."""
    global _pid, _thread, _work
    if _running_here():
        return
    with _lock:
        if _running_here():
            return
        if _pid == 0:
            # The interpreter's exit waits for what was handed over: the thread is a daemon,
            # and one still joining workers as the interpreter tears down (torch, CUDA, the
            # pool's native objects) can crash it. (Before torch's own exit handler, which
            # turns its shutdown into a no-op: handlers run last registered first.)
            atexit.register(wait_all)
        _pid = os.getpid()
        _work = queue.SimpleQueue()
        _pending.clear()
        _thread = threading.Thread(target=_run, args=(_work,), name="pinpool-workers-end")
        _thread.daemon = True
        _thread.start()


def _running_here() -> bool:
    thread = _thread
    return _pid == os.getpid() and thread is not None and thread.is_alive()


def hand_over(finish: Callable[[], None]) -> threading.Event:
    """Has the ending thread call ``finish``; the event is set once it has."""
    start()
    done = threading.Event()
    item = (finish, done)
    _pending.append(done)
    _work.put(item)
    return done


def on_ending_thread() -> bool:
    """Whether the caller is this process's ending thread."""
    return _thread is threading.current_thread()


def wait_all(timeout: float | None = None) -> bool:
    """Waits until every shutdown handed over so far has run (at once on the ending thread),
    at most ``timeout`` seconds (None: as long as it takes); whether they all have."""
    if on_ending_thread():
        return True
    pending = list(_pending) if _pid == os.getpid() else []
    deadline = None if timeout is None else time.monotonic() + timeout
    for done in pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not done.wait(left):
            return False
    return True


def wait_for_freed_pools(timeout: float | None = None) -> bool:
    """``pinpool.wait_for_freed_pools``: waits until every pool dropped so far is freed, at
    most ``timeout`` seconds (None: as long as it takes); whether it was.

    An ended epoch's iterator, which holds its loader's pool, goes once the ending thread
    has shut its workers down: that is waited for first, within the same ``timeout``."""
    if timeout is not None and not timeout >= 0:  # (negative or NaN: refused, as ever)
        return _freed(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    if not wait_all(timeout):
        return False
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    return _freed(left)


def _run(work: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]]) -> None:
    while True:
        finish, done = work.get()
        try:
            finish()  # (it reports its own errors)
        except BaseException as exc:  # (one that escaped all the same: the thread goes on)
            warnings.warn(
                f"pinpool: a worker shutdown failed: {exc!r}", RuntimeWarning, stacklevel=1
            )
        finally:
            del finish  # (no reference to the iterator kept while waiting for the next)
            with contextlib.suppress(ValueError):  # (gone if a fork's start cleared it)
                _pending.remove(done)
            done.set()
