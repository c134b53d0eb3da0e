"""Where torch's pin thread does not run, the consumer's thread takes from the workers' result
queue what is waiting there, as that thread would (:class:`ConsumerIntake`).

Each time the consumer's thread gets an item from the result queue, it also gets, without
waiting, every item already behind it, and takes each batch ahead in the order they came
(``BatchHandle.pin_memory``, as torch's pin thread calls it: the copy out of the worker's
segment runs on a copy thread without the GIL, no slot is waited for, room is kept for the
batch the consumer waits for), then keeps them and returns them one per call, in that order.
The consumer's thread so gets the copies made ahead that the pin thread would make, without
the pin thread's cost: two threads handing the GIL to each other for every batch
(docs/performance.md, "Without torch's pin thread").

Invariants: every item got from the result queue is returned, once, in the order it came, or
dropped with the iterator's held batches at shutdown (``workers._drop_held``); what getting
one raised (other than the queue's being empty) is raised after them; an item is kept
before anything is done with it, so that an exception raised while it is taken ahead (a signal
handler's too) loses nothing: the item then stays as it came; what a batch's take ahead raised
(other than a signal handler's exception) is raised in that batch's turn, as it is
(``delivery.RaisedAhead``), as its take in turn would have raised it.
"""

from __future__ import annotations

import queue
from collections import deque
from typing import Any

from .._signals import signal_of
from .._wire.handle import BatchHandle, WorkerProgress
from .delivery import RaisedAhead
from .receiver import Receiver


class ConsumerIntake:
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
        if failed is not None:
            raise failed
        return None

    def take_in(self, got: tuple[Any, Any], results: Any, stop_at_big: bool) -> bool:
        """Keeps ``got``, the item the consumer's thread just got from ``results`` (the
        workers' result queue), and every item waiting behind it, got without waiting; takes
        each batch ahead, in the order they came, as torch's pin thread would. With
        ``stop_at_big``, stops at a big batch (``Receiver.big``): it is kept as it came (its
        segment received), and True returned."""
        while True:
            self.waiting.append(got)  # (kept first: see the module's doc)
            if self._take_last(stop_at_big):
                return True
            try:
                got = results.get(block=False)
            except queue.Empty:
                return False
            except Exception as exc:  # (torch's own get raises it, in its turn: see next())
                self.failed = exc
                return False

    def _take_last(self, stop_at_big: bool) -> bool:
        """Takes the newest item kept ahead, if it is a batch; True (nothing taken) if it is
        a big one and ``stop_at_big``."""
        index, item = self.waiting[-1]
        handle = _handle(item)
        if handle is None:
            return False
        if stop_at_big:
            self.receiver.receive_now(handle)
            if self.receiver.big(handle):
                return True
        try:
            taken = item.pin_memory()
        except Exception as exc:
            if signal_of(exc) is not None:
                raise  # (a signal handler's: see pinpool._signals)
            taken = RaisedAhead(exc)
            if isinstance(item, WorkerProgress):
                taken = WorkerProgress(taken, item.worker, item.state)
        self.waiting[-1] = (index, taken)
        return False

    def drop(self) -> None:
        """Drops what is kept (the iterator is shut down: each may hold a slot)."""
        self.waiting.clear()
        self.failed = None


def _handle(item: Any) -> BatchHandle | None:
    """The batch handle ``item`` is or carries, if any."""
    if isinstance(item, WorkerProgress):
        item = getattr(item, "batch", None)  # (a damaged one is refused in its turn)
    return item if isinstance(item, BatchHandle) else None
