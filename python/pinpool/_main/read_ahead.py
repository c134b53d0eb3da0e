"""Where torch's pin thread does not run, the consumer's thread takes from the workers' result
queue what is waiting there, as that thread would (:class:`ReadAhead`).

Each time the consumer's thread gets an item from the result queue, it also gets, without
waiting, every item already behind it, and takes each batch ahead in the order they came
(``BatchHandle.pin_memory``, as torch's pin thread calls it: the copy out of the worker's
segment runs on a copy thread without the GIL, no slot is waited for, room is kept for the
batch the consumer waits for), then keeps them and returns them one per call, in that order.
The consumer's thread so gets the copies made ahead that the pin thread would make, without
the pin thread's cost: two threads handing the GIL to each other for every batch
(docs/performance.md, "Without torch's pin thread").

Invariants: every item got from the result queue is returned, once, in the order it came, or
dropped with the iterator's held batches at shutdown (``worker_shutdown.drop_held``) or when a
persistent iterator starts its next epoch (torch drops the last one's leftovers then); what
getting one raised (other than the queue's being empty) is raised after them; an item is kept
before anything is done with it, so that an exception raised while it is taken ahead (a signal
handler's too) loses nothing: the item then stays as it came; what a batch's take ahead raised
(other than a signal handler's exception) is raised in that batch's turn, as it is
(``delivery.RaisedAhead``), as its take in turn would have raised it. A kept error keeps no
frame (where it was raised is in a note): frames keep their callers', the iterator's among
them, and a kept error would hold the iterator in a cycle.
"""

from __future__ import annotations

import queue
import traceback
from collections import deque
from typing import Any

from .._signals import signal_of
from .._wire.handle import BatchHandle, WorkerProgress
from .delivery import RaisedAhead
from .receiver import Receiver


class ReadAhead:
    """The items got from one iterator's result queue ahead of the consumer, in order."""

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        #: (index, item) pairs, as torch's result queue gives them, oldest first.
        self.waiting: deque[tuple[Any, Any]] = deque()
        #: What getting an item without waiting raised (not the queue's being empty): raised
        #: by :meth:`next` once the items got before it are returned.
        self.failed: Exception | None = None

    def next(self) -> tuple[Any, Any] | None:
        """The oldest item kept (taken from the kept ones), or None when none is."""
        if self.waiting:
            return self.waiting.popleft()
        failed, self.failed = self.failed, None
        if failed is None:
            return None
        try:
            raise failed
        finally:
            failed = None  # (this frame, in its traceback, must not keep it: no cycle)

    def take_in(self, got: tuple[Any, Any], results: Any) -> None:
        """Keeps ``got``, the item the consumer's thread just got from ``results`` (the
        workers' result queue), and every item waiting behind it, got without waiting; takes
        each batch ahead, in the order they came, as torch's pin thread would."""
        while True:
            self.waiting.append(got)  # (kept first: see the module's doc)
            self._take_last()
            try:
                got = results.get(block=False)
            except queue.Empty:
                return
            except Exception as exc:  # (torch's own get raises it, in its turn: see next())
                self.failed = _without_frames(exc)
                return

    def _take_last(self) -> None:
        """Takes the newest item kept ahead, if it is a batch."""
        index, item = self.waiting[-1]
        handle = handle_of(item)
        if handle is None:
            return
        try:
            taken = item.pin_memory()
        except Exception as exc:
            if signal_of(exc) is not None:
                raise  # (a signal handler's: see pinpool._signals)
            taken = RaisedAhead(_without_frames(exc))
            if isinstance(item, WorkerProgress):
                taken = WorkerProgress(taken, item.worker, item.state)
        self.waiting[-1] = (index, taken)

    def drop(self) -> None:
        """Drops what is kept (the iterator is shut down: each may hold a slot)."""
        self.waiting.clear()
        self.failed = None


def _without_frames(exc: Exception) -> Exception:
    """``exc``, kept to be raised later, without its frames (and those of the exceptions it
    chains to): each frame keeps its caller's, up to the iterator's own, which keeps this
    read-ahead, so the error would keep the iterator, and its workers, in a cycle until the
    collector runs (never, where it is disabled). Where each was raised is kept as a note."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        chained = todo.pop()
        if id(chained) in seen:
            continue
        seen.add(id(chained))
        tb = chained.__traceback__
        if tb is not None:
            where = "".join(traceback.format_tb(tb)).rstrip()
            chained.add_note(f"(taken ahead of its turn by pinpool; raised at:\n{where})")
            chained.__traceback__ = None
        del tb
        todo += [e for e in (chained.__cause__, chained.__context__) if e is not None]
    return exc


def handle_of(item: Any) -> BatchHandle | None:
    """The batch handle ``item`` is or carries, if any."""
    if isinstance(item, WorkerProgress):
        item = getattr(item, "batch", None)  # (a damaged one is refused in its turn)
    return item if isinstance(item, BatchHandle) else None
