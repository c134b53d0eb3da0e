"""The size of a loader's first batch, told by a worker before the batch is complete.

Without ``slot_bytes=`` a loader's pool is sized from its first batch. Made when that batch
arrives, the arena (pinned and registered) is on the first batch's critical path. A worker
that streams samples knows the batch's size after its first sample
(``streaming.plan_layout``), while the rest are still to be made and copied: it sends that
size through a pipe, and a thread of the main process makes the pool meanwhile (the figures:
``docs/performance.md``, "Measurements behind the code").

Invariants:

- Only a hint. A batch that arrives before the pool is made waits for it (``LazyPool.pool_for``
  holds its lock), and a batch that does not fit the pool it sized goes where any batch too
  large goes. Without a hint (a user's ``collate_fn``, unstreamed batches) the first batch
  sizes the pool, as before. A hint is checked (two positive ints) and its pool refused like
  any (``BatchTooLarge`` for an arena over the memory's share): the error is logged.
- A worker never waits here: its end of the pipe is non-blocking, each worker process sends
  at most one hint, for its first batch only, and a full or closed pipe loses it.
- The main process's thread waits without the GIL, makes at most one pool, and ends (closing
  the pipe's reading end) once the pool exists, whoever made it, or the loader is closed.
  The writing end stays open in the main process until the loader is closed: workers started
  later (by spawn or a forkserver) get a duplicate of it as they start.
- Pickled outside the start of a worker process (a copy of the loader, say) the hint carries
  no pipe.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import struct
import threading
from collections.abc import Callable
from typing import Any

from .._errors import PinPoolError
from .._torch_contract import get_spawning_popen

_log = logging.getLogger("pinpool")
_FORMAT = "<qq"  # batch bytes, samples
#: How often the waiting thread looks whether it is still needed, in seconds.
_POLL_S = 0.01


class PoolHint:
    """A pipe from the workers to the main process for the first batch's size."""

    def __init__(self) -> None:
        reader, writer = multiprocessing.Pipe(duplex=False)
        os.set_blocking(writer.fileno(), False)  # (the workers' ends share this flag)
        self._reader: multiprocessing.connection.Connection | None = reader
        self._writer: multiprocessing.connection.Connection | None = writer
        self._sent_by: int | None = None  # the worker process that sent its hint
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        spawning = get_spawning_popen() is not None
        return {"writer": self._writer if spawning else None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A worker's copy: it only sends.
        self._reader, self._writer = None, state["writer"]
        self._sent_by, self._thread, self._closed = None, None, True
        self._lock = threading.Lock()

    # -- in a worker ---------------------------------------------------------------------

    def send(self, nbytes: int, count: int) -> None:
        """Tells the main process the size of this worker process's first batch (never
        waits). Later calls, and calls after :meth:`pass_turn`, send nothing: the hint of a
        later, larger batch could otherwise size the pool before the first batch does."""
        writer = self._writer
        if writer is None or self._sent_by == os.getpid():
            return
        self._sent_by = os.getpid()
        try:
            writer.send_bytes(struct.pack(_FORMAT, nbytes, count))
        except (OSError, ValueError):
            pass  # full, closed, or the main process has stopped listening

    def pass_turn(self) -> None:
        """This worker process's first batch goes without a hint (it was not streamed)."""
        self._sent_by = os.getpid()

    # -- in the main process -------------------------------------------------------------

    def watch(self, make: Callable[[int, int], Any], wanted: Callable[[], bool]) -> None:
        """Starts the thread that calls ``make(nbytes, count)`` for the first hint, if one
        comes while ``wanted()`` (once; the thread ends as soon as it is not wanted)."""
        with self._lock:
            if self._thread is not None or self._closed or self._reader is None:
                return
            self._thread = threading.Thread(
                target=self._wait, args=(make, wanted), name="pinpool-pool-hint", daemon=True
            )
            self._thread.start()

    def _wait(self, make: Callable[[int, int], Any], wanted: Callable[[], bool]) -> None:
        reader = self._reader
        assert reader is not None
        try:
            while not self._closed and wanted():
                if not reader.poll(_POLL_S):  # (without the GIL)
                    continue
                raw = reader.recv_bytes(64)
                if len(raw) != struct.calcsize(_FORMAT):
                    _log.warning(
                        "pinpool: a worker sent a malformed pool hint (%d bytes)", len(raw)
                    )
                    return
                nbytes, count = struct.unpack(_FORMAT, raw)
                if nbytes > 0 and count > 0 and not self._closed:
                    make(nbytes, count)
                return
        except (PinPoolError, OSError, EOFError, MemoryError, struct.error) as exc:
            # (a hint is only a hint: the first batch sizes the pool. The message only: a
            # record holding the exception would keep its frames alive.)
            _log.warning(
                "pinpool: could not make the pool ahead of the first batch (%s): %s",
                type(exc).__name__,
                str(exc) or "no reason given",
            )
        finally:
            with self._lock:
                self._reader = None
            reader.close()

    def close(self) -> None:
        """Stops listening and closes the main process's ends of the pipe (waiting for the
        thread, which looks every 10 ms, to close its own)."""
        with self._lock:
            self._closed = True
            writer, self._writer = self._writer, None
            thread, reader = self._thread, self._reader
            if thread is None:
                self._reader = None
        if writer is not None:
            writer.close()
        if thread is not None:
            if thread is not threading.current_thread():
                thread.join(1.0)
        elif reader is not None:
            reader.close()
