"""One epoch of a ``pinpool.DataLoader``: torch's iterator, wrapped (:class:`LoaderIter`).

Each item torch's machinery produces is handed over to the consumer (``delivery.hand_to_consumer``),
counted for ``state_dict()`` (``resume.epoch.Epoch``), and the epoch's end shuts the workers down
(unless they persist) and takes back what they held.

Invariants: every batch yielded, and every index list torch passed while raising, is counted
in the epoch before ``__next__`` returns or raises; the end's clean-up runs once, in the
process that iterated, and takes back only what this iterator's own workers held (another
iterator of the same loader may still be running).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from typing import Any

from ... import _signals, _trace
from ..._errors import PinPoolError
from ..._torch_contract import RERAISE_CODE
from ..._wire.handle import WorkerProgress
from ..resume.checkpoint import Epoch
from ..route.delivery import hand_to_consumer
from ..route.grants import TaskTagger
from .workers import WorkersIter, shut_down


class LoaderIter:
    """Wraps torch's iterator: hands each batch over and cleans up at the end."""

    def __init__(self, loader: Any, inner: Iterator[Any], epoch: Epoch) -> None:
        self._loader = loader
        self._inner = inner
        self._epoch = epoch  # counts the batches and samples yielded, for state_dict()
        self._ended = False
        loader._pinpool_receiver.iterator = weakref.ref(inner)
        self._mark = loader._pinpool_receiver.fallbacks_mark()
        sampler = getattr(inner, "_index_sampler", None)
        #: Zero-copy: told, once each batch is handed over (in the arena, taken in its turn),
        #: the task the consumer waits for next: the one whose worker may take the room kept
        #: for it. Not sooner: a later batch's worker would take the room this batch, still in
        #: its worker's segment, waits for.
        self._head = sampler if type(sampler) is TaskTagger else None

    def __iter__(self) -> LoaderIter:
        return self

    def __getattr__(self, name: str) -> Any:
        # Every attribute of torch's iterator (its workers, their state, its pin thread, its
        # shutdown flag), at every moment of its life, is read on torch's iterator.
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(inner, name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self.__dict__.get("_inner"))))

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __next__(self) -> Any:
        t0 = _trace.on and _trace.now()
        try:
            item = next(self._inner)
        except StopIteration:
            self._epoch.ended = True
            self._end()
            self._loader._pinpool_receiver.epoch_ended(self._mark)
            raise
        except BaseException as exc:
            # (torch may have passed a batch as it raised, a worker's exception: it is gone)
            self._epoch.took(_taken(self._inner), raised=True)
            _unkeep(exc)
            raise
        try:
            if isinstance(item, WorkerProgress):
                workers = self._loader.num_workers
                item, worker, state = item.fields(workers)
                self._epoch.delivered(worker, state, workers)
            batch = hand_to_consumer(item)
        finally:
            self._epoch.took(_taken(self._inner), raised=False)
        if self._head is not None:
            self._head.set_head(self._inner._rcvd_idx)
        if t0:
            _trace.span("loader.next", t0)
        return batch

    def _end(self) -> None:
        receiver = self._loader._pinpool_receiver
        if self._ended or receiver.pid != os.getpid():
            return
        self._ended = True
        if self._loader.persistent_workers:
            return
        # Only what this iterator's workers had, once they have exited: another iterator of
        # the same loader may still be running.
        sampler = getattr(self._inner, "_index_sampler", None)
        owners = sampler.owners if isinstance(sampler, TaskTagger) else []
        grants = receiver.grants
        if grants is not None:
            for owner in owners:  # (its workers' requests for room are answered now)
                grants.stop(owner)

        def take_back() -> None:
            if grants is not None:
                for owner in owners:
                    grants.close(owner)
            receiver.retire_segments(dead_only=True)

        # (At an epoch's natural end the workers are shut down on a thread of their own; and
        # where the shutdown is called on the iterator's own pin thread.)
        if isinstance(self._inner, WorkersIter) and self._inner.after_shutdown(take_back):
            return
        later = False
        try:
            shut_down(self._inner)
            later = isinstance(self._inner, WorkersIter) and self._inner.after_shutdown(take_back)
        finally:
            if not later:
                take_back()

    def __del__(self) -> None:
        try:
            self._end()
        except PinPoolError:
            pass  # (what it would have cleaned up is gone: a closed pool, say)
        except BaseException as exc:
            if not _signals.hand_back(exc):
                raise


def _taken(inner: Any) -> int | None:
    """The index lists torch's iterator has passed this epoch, yielded or raised (in order):
    its ``_rcvd_idx`` with workers; None without, where each is passed as it is drawn."""
    taken = getattr(inner, "_rcvd_idx", None)
    return taken if type(taken) is int else None


def _unkeep(exc: BaseException) -> None:
    """torch raises a worker's exception again from ``ExceptionWrapper.reraise``, whose frame
    keeps it in a local: a cycle (the exception, its traceback, that frame) that keeps every
    frame of the traceback, torch's iterator's among them, and so its workers, until the
    garbage collector runs (never, where it is disabled), after the consumer has dropped the
    exception and the iterator. That frame's locals (the wrapper, the message, the exception
    itself) are cleared here."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _RERAISE:
            tb.tb_frame.clear()
        tb = tb.tb_next


_RERAISE = RERAISE_CODE if RERAISE_CODE is not None else _unkeep.__code__
