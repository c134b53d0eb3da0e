"""The workers' result queue as the consumer's thread reads it where torch's pin thread does not
run (:class:`WholeMessages`).

torch's iterator then gets each result straight from the ``multiprocessing`` queue on the
consumer's thread, and that queue reads a message in several reads from Python code: a signal
handler's exception (Ctrl-C) raised between two of them leaves the rest of the message in the
pipe, and every later read is out of step (``EOFError: Ran out of input``, pickle errors).
Here each message is read whole by one native call (``pinpool._native.read_message``): the
wait may end in the handler's exception, with nothing read; a message, once begun, is read
to its end whatever signal comes.

Invariants: only the consumer's thread reads the queue (no pin thread runs); each message
comes out whole, once, in order; a message whose handing over an interrupt cuts short, after
it was read, is lost as a whole (its batch handle, collected, hands its memory back), and the
pipe stays in step. The queue itself (its feeder, its closing) stays torch's: everything but
``get`` goes to it.
"""

from __future__ import annotations

import queue
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ..._native import read_message


class WholeMessages:
    """torch's result queue (``_worker_result_queue``), read one whole message at a time."""

    def __init__(self, results: Any) -> None:
        self.results = results

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The next result, as ``multiprocessing.Queue.get`` gives it: ``queue.Empty`` when
        none came in time."""
        fd = self.results._reader.fileno()  # (raises once the queue is closed)
        raw = read_message(fd, timeout if block else 0.0)
        if raw is None:
            raise queue.Empty
        return ForkingPickler.loads(raw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.results, name)
