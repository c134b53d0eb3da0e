"""One thread per process that finishes the worker shutdowns of ended epochs.

At an epoch's natural end the training thread only hands the rest of its workers' shutdown
(torch's joins, pinpool's reaping and taking back) to this thread, so that the final
``next()`` waits for none of it (see ``_main.workers``). The thread is started once, when the
first loader with workers starts them, rather than at the epoch's end: a thread started then
would hold the GIL for up to a switch interval before the training thread could go on.

Invariants: each handed-over shutdown runs once, in the order handed over, and its event is
set when it has run (whatever it raised); :func:`wait_all` returns once every shutdown handed
over before it was called has run (only the interpreter's exit waits for it in pinpool: the
workers of an ended epoch have no task left, so nothing else has to wait for their exit;
tests use it to count what they leave); a process forked from this one starts a thread of
its own (the parent's is not running there) and inherits no pending shutdown.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from collections.abc import Callable

from .._native import wait_for_freed_pools as _freed

_lock = threading.Lock()
_pid = 0
_thread: threading.Thread | None = None
_work: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = queue.SimpleQueue()
_pending: list[threading.Event] = []


def start() -> None:
    """Starts this process's ending thread if it is not running yet."""
    global _pid, _thread, _work
    with _lock:
        if _pid == os.getpid() and _thread is not None:
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


def hand_over(finish: Callable[[], None]) -> threading.Event:
    """Has the ending thread call ``finish``; the event is set once it has."""
    start()
    done = threading.Event()
    with _lock:
        _pending.append(done)
        _work.put((finish, done))
    return done


def on_ending_thread() -> bool:
    """Whether the caller is this process's ending thread."""
    return _thread is threading.current_thread()


def wait_all(timeout: float | None = None) -> bool:
    """Waits until every shutdown handed over so far has run (at once on the ending thread),
    at most ``timeout`` seconds (None: as long as it takes); whether they all have."""
    if on_ending_thread():
        return True
    with _lock:
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
            finish()  # (it reports its own errors: nothing escapes it)
        finally:
            del finish  # (no reference to the iterator kept while waiting for the next)
            with _lock:
                if done in _pending:
                    _pending.remove(done)
            done.set()
