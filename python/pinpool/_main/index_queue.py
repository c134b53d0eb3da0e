"""Batch indices written to a worker's index queue by the thread that sends them.

torch sends every batch's indices to its worker through a ``multiprocessing.Queue``, whose
``put()`` only appends to a list and wakes the queue's feeder thread, which pickles the
indices and writes them to the worker's pipe. That thread needs the GIL to run: for every
batch one more thread wakes and takes the GIL from the training thread and torch's pin
thread (on the H200, torch's four feeder threads used 55 us of CPU per 512 KB batch, a sixth
of a batch's time, all of it under the GIL; ``benchmarks/results/h200-gil-free-views``).

:func:`write_directly` turns a queue into a :class:`DirectQueue`, whose ``put()`` pickles the
object and writes it to the pipe itself: a few microseconds on the calling thread, and no
other thread wakes. The worker's ``get()`` is unchanged (same pipe, same framing, same
semaphore).

Invariants:

- A message is written whole or not at all, under the queue's write lock, so it cannot
  interleave with another writer's.
- The calling thread never waits for the worker to read: a message is written directly only
  when every message the queue can hold at once fits in half the pipe's buffer together (the
  buffer's size is asked of the kernel: 64 KiB by default, a page for a user over the
  system's pipe quota). A bigger one (a huge index list) goes through the feeder thread, as torch
  would send it; from then on every message does, so that the worker receives them in the
  order they were put.
- ``close()`` closes the pipe's ends at once when no feeder thread was started (the feeder
  thread closes them when it exits otherwise), so no descriptor outlives the queue's use.
"""

from __future__ import annotations

import fcntl
import multiprocessing.queues
from multiprocessing.reduction import ForkingPickler
from queue import Full
from typing import Any

#: ``fcntl``'s F_GETPIPE_SZ on Linux (Python 3.10+ names it; the value is Linux's).
_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
#: The smallest buffer a pipe gets (one page): assumed where the kernel does not say.
_SMALLEST_PIPE = 4096


class DirectQueue(multiprocessing.queues.Queue):  # type: ignore[type-arg]
    """A ``multiprocessing.Queue`` whose small messages are written by the thread that puts
    them (see the module's doc). Set ``_pin_room`` before the first ``put``."""

    _pin_room: int

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:  # type: ignore[attr-defined]
            raise ValueError(f"Queue {self!r} is closed")
        data = ForkingPickler.dumps(obj)
        if self._thread is not None or len(data) > self._pin_room:  # type: ignore[attr-defined]
            super().put(obj, block, timeout)  # the feeder thread, in order from now on
            return
        # The worker's get() releases this semaphore for every message it reads.
        if not self._sem.acquire(block, timeout):  # type: ignore[attr-defined]
            raise Full
        lock = self._wlock  # type: ignore[attr-defined]
        if lock is None:  # (Windows: one writer per pipe there)
            self._writer.send_bytes(data)  # type: ignore[attr-defined]
            return
        with lock:
            self._writer.send_bytes(data)  # type: ignore[attr-defined]

    def close(self) -> None:
        feeder = self._thread  # type: ignore[attr-defined]
        super().close()
        if feeder is None:  # no feeder thread to close the pipe's ends on its way out
            self._writer.close()  # type: ignore[attr-defined]
            self._reader.close()  # type: ignore[attr-defined]


def write_directly(queue: Any, most_messages: int) -> bool:
    """Makes ``queue`` (a ``multiprocessing.Queue`` nothing was put on yet) write its messages
    from the putting thread, when at most ``most_messages`` can wait in it at once; returns
    whether it did (not for another kind of queue, or one already fed by its thread)."""
    if type(queue) is not multiprocessing.queues.Queue or queue._thread is not None:
        return False
    queue.__class__ = DirectQueue
    queue._pin_room = pipe_size(queue._writer.fileno()) // 2 // max(1, most_messages)
    return True


def pipe_size(fd: int) -> int:
    """The buffer of the pipe ``fd`` is an end of, in bytes."""
    try:
        return max(_SMALLEST_PIPE, fcntl.fcntl(fd, _GETPIPE_SZ))
    except OSError:
        return _SMALLEST_PIPE
