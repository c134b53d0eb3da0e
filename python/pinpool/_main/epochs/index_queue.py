"""Batch indices written to a worker's index queue by a Rust thread, not a Python one.

torch sends every batch's indices to its worker through a ``multiprocessing.Queue``, whose
``put()`` appends them to a list and wakes the queue's feeder thread, which pickles them and
writes them to the worker's pipe. That thread needs the GIL: for every batch one more Python
thread wakes and takes the GIL from the training thread and torch's pin thread. Writing on
the training thread instead costs it the write and the worker's wake-up. (The figures for
both: ``docs/performance.md``, "Measurements behind the code".)

:func:`write_directly` turns a queue into a :class:`DirectQueue`, whose ``put()`` pickles the
object (with a pickler kept for the queue: the reducers registered by then are the ones it
uses) and hands the bytes to a :class:`~pinpool._native.PipeWriter`: a thread in Rust,
without the GIL, frames and writes them to the same pipe. The worker's ``get()`` is unchanged
(same pipe, same framing, same semaphore).

Invariants:

- Messages reach the pipe whole and in the order they were put (the writer is the pipe's only
  writer from the moment the queue is turned: nothing was put on it before).
- ``put()`` never waits for the worker, whatever the message's size; the writer's thread does.
- ``close()`` lets the writer finish what was put (the exit message torch sends last), giving
  up on a pipe that stays full with nobody reading, then closes the pipe's ends: no
  descriptor outlives the queue's use. Each end is closed exactly once, by ``close()`` or
  as the queue goes (in a reference cycle too), never by the ``Connection``'s own finalizer.
"""

from __future__ import annotations

import io
import threading
import weakref
from multiprocessing.reduction import ForkingPickler
from queue import Full
from typing import Any

from ... import _trace
from ..._native import PipeWriter
from ..._torch_contract import MultiprocessingQueue


class DirectQueue(MultiprocessingQueue):  # type: ignore[type-arg]
    """A ``multiprocessing.Queue`` whose messages are written by a Rust thread (see the
    module's doc). Made by :func:`write_directly`."""

    _pinpool_writer: PipeWriter
    #: Closes the pipe's ends, once (see :func:`write_directly`).
    _pinpool_ends: weakref.finalize
    _pinpool_pickler: tuple[io.BytesIO, ForkingPickler, threading.Lock]

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        t0 = _trace.on and _trace.now()
        if self._closed:  # type: ignore[attr-defined]
            raise ValueError(f"Queue {self!r} is closed")
        data = self._dumps(obj)  # (an object that cannot be pickled raises here, not later)
        # The worker's get() releases this semaphore for every message it reads.
        if not self._sem.acquire(block, timeout):  # type: ignore[attr-defined]
            raise Full
        self._pinpool_writer.send(data)
        if t0:
            _trace.span("index.put", t0, nbytes=len(data))

    def _dumps(self, obj: Any) -> bytes:
        """``ForkingPickler.dumps(obj)``, by a pickler kept for the queue: making one copies
        copyreg's whole dispatch table and torch's reducers, most of a put's pickling."""
        buf, pickler, lock = self._pinpool_pickler
        # Another thread is pickling: one of its own. Or the buffer is closed: a queue in a
        # reference cycle, whose objects the collector finalizes in any order (the BytesIO may
        # go before the iterator whose shutdown puts the workers' exit messages).
        if buf.closed or not lock.acquire(blocking=False):
            return bytes(ForkingPickler.dumps(obj))
        try:
            buf.seek(0)
            buf.truncate()
            pickler.dump(obj)
            return buf.getvalue()
        finally:
            pickler.clear_memo()  # (the memo would keep the message's objects alive)
            lock.release()

    def close(self) -> None:
        """Closes the queue (again: a no-op); the writer's thread and descriptor end here
        whatever happens first."""
        try:
            super().close()
        finally:
            self._pinpool_writer.close()
            self._pinpool_ends()  # (once: later calls do nothing)


def _close_ends(reader: Any, writer: Any) -> None:
    """Closes a queue's two ends of its pipe (each once, whatever the other's close raised)."""
    try:
        reader.close()
    finally:
        writer.close()


def write_directly(queue: Any) -> bool:
    """Makes ``queue`` (a ``multiprocessing.Queue`` nothing was put on yet) write its messages
    through a :class:`~pinpool._native.PipeWriter`; returns whether it did (not for another
    kind of queue, or one already fed by its thread)."""
    if type(queue) is not MultiprocessingQueue or queue._thread is not None:
        return False
    queue._pinpool_writer = PipeWriter(queue._writer.fileno())
    # The pipe's ends are closed once, by close() or as the queue goes, never by their own
    # finalizers: in a reference cycle the collector finalizes every object in it before it
    # clears any, in no set order, and a ``Connection`` finalized there closes its
    # descriptor but keeps its number, so the queue's close() (as the iterator's shutdown
    # runs) would close that number again: EBADF, or another file that took the number since.
    # (torch's own queues escape this: their feeder thread holds their ends.)
    queue._pinpool_ends = weakref.finalize(queue, _close_ends, queue._reader, queue._writer)
    buf = io.BytesIO()
    queue._pinpool_pickler = (buf, ForkingPickler(buf), threading.Lock())
    queue.__class__ = DirectQueue
    return True
