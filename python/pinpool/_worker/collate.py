"""pinpool's ``collate_fn``: collate a batch, write it into its destination, return a small handle.

torch calls :class:`PinCollate` in each worker (and in the main process with
``num_workers=0``). In a worker the batch is collated the way torch would (the user's
``collate_fn``, or ``default_collate`` with its stacks deferred so that they are made straight
in shared memory, or sample by sample with streaming collation, see ``streaming``) and written
where ``destination`` chooses; torch's result queue then carries a
:class:`~pinpool._wire.handle.BatchHandle` instead of the batch. In the main process the batch
goes straight into a slot of the loader's pool (``receiver.Receiver.encode_local``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils.data

from .. import _trace
from .._torch_contract import default_convert
from .._wire import codec, registry
from .._wire.handle import BatchHandle, TaskedItems, WorkerProgress
from .._wire.pool_hint import PoolHint
from . import destination, streaming
from .heap import keep_freed_memory


class PinCollate:
    """The ``collate_fn`` pinpool gives torch.

    ``collate_fn`` is the user's (None: torch's default); ``auto_collation`` says whether
    torch batches samples (``batch_size`` or ``batch_sampler`` given); ``ring_size`` is the
    number of segments each worker keeps for this loader; ``report_state``: each worker's
    batch goes out with its dataset's ``state_dict()`` (a resumable ``IterableDataset``);
    ``pool_hint``: where a worker tells its first batch's size early (when it streams);
    ``desk``: zero-copy, where a worker asks for a slot for a batch whose indices carry a task
    (``_worker.desk``: the main process's grant desk and the loader's table there)."""

    def __init__(
        self,
        token: str,
        collate_fn: Callable[[Any], Any] | None,
        auto_collation: bool,
        ring_size: int,
        keep_worker_memory: bool = True,
        worker_copy_threads: int = 1,
        stream_samples: bool = True,
        report_state: bool = False,
        pool_hint: PoolHint | None = None,
        desk: tuple[bytes, int] | None = None,
        unpinned: bool = False,
    ) -> None:
        self.token = token
        self.desk = desk
        self.pool_hint = pool_hint
        self.report_state = report_state
        self.stream_samples = stream_samples
        self.collate_fn = collate_fn
        self.auto_collation = auto_collation
        self.ring_size = ring_size
        self.keep_worker_memory = keep_worker_memory
        self.worker_copy_threads = worker_copy_threads
        #: ``pin_memory=False``: the batch goes out as torch's collation makes it.
        self.unpinned = unpinned

    def __call__(self, data: Any) -> Any:
        try:
            return self._collate(data)
        except streaming.DatasetStopped as stopped:
            # As torch's fetcher: the dataset's StopIteration out of fetch() (it ends the
            # epoch), not a RuntimeError.
            raise stopped.stop from None

    def _collate(self, data: Any) -> Any:
        # Only pinpool's own carriers have a task (a user's batch may have such an attribute).
        task = data.task if isinstance(data, (streaming.LazySamples, TaskedItems)) else None
        in_worker = torch.utils.data.get_worker_info() is not None
        if isinstance(data, streaming.LazySamples):
            if self.stream_samples and self.collate_fn is None and in_worker:
                made = self._stream(data)
                if isinstance(made, BatchHandle):
                    return made
                data = made
            else:
                data = list(data)
        elif isinstance(data, TaskedItems):
            data = data.items  # what torch would give collate
        # Samples in the batch, when the data is a list of them (a dataset's own __getitems__
        # may return a whole batch instead).
        count = len(data) if self.auto_collation and isinstance(data, (list, tuple)) else None
        if self.collate_fn is not None:
            batch = self.collate_fn(data)
        elif self.unpinned and self.auto_collation:
            batch = torch.utils.data.default_collate(data)
        elif self.auto_collation:
            batch = codec.default_collate_deferred(data)
        else:
            batch = default_convert(data)
        if self.unpinned:
            return self._with_state(batch) if in_worker else batch
        if not in_worker:
            return registry.lookup(self.token).encode_local(batch, count)
        p = codec.plan(batch, keep_strides=True)
        if self.pool_hint is not None:
            if task is not None and p.specs:
                # Zero-copy: the main process makes its pool from the first hint, and this
                # batch's request for room waits for it.
                self.pool_hint.send(p.nbytes, count or 1)
            else:
                self.pool_hint.pass_turn()  # (a first batch not streamed: no hint from later ones)
        if self.keep_worker_memory:
            keep_freed_memory(p.nbytes)
        threads = self.worker_copy_threads
        handle = destination.write(self.token, self.ring_size, p, task, self.desk, count, threads)
        return self._with_state(handle)

    def _with_state(self, batch: Any) -> Any:
        """What a worker sends for ``batch``: with its dataset's state where it reports it."""
        if not self.report_state:
            return batch
        # The samples are drawn (torch's fetcher draws them all, then collates): the dataset's
        # state is now the state after this batch.
        info = torch.utils.data.get_worker_info()
        assert info is not None
        dataset: Any = info.dataset
        return WorkerProgress(batch, info.id, dataset.state_dict())

    def _stream(self, samples: streaming.LazySamples) -> BatchHandle | list[Any]:
        """Makes the samples and collates them as torch's ``default_collate`` would,
        streaming their big arrays into the batch's destination as each sample is made.

        Returns the batch's handle, or the samples themselves (made, in order) when the batch
        must be collated the ordinary way (no big arrays, or samples unlike the first)."""
        count = len(samples)
        rest = iter(samples)
        if count == 0:
            return []
        first = next(rest)
        layout = streaming.plan_layout(first, count)
        if layout is None:
            return [first, *rest]
        if self.keep_worker_memory:
            keep_freed_memory(layout.nbytes)
        if self.pool_hint is not None:
            # The main process may make its pool while this batch is made (once a worker).
            # (The spare: numbers, which become tensors of 8 bytes a sample.)
            self.pool_hint.send(layout.batch_bytes() + _STREAM_SPARE, count)
        # A granted slot holds the batch as the first sample foretells it (the rest outgrowing
        # it moves to a segment); a segment has room to spare for the rest.
        dest = destination.Destination(
            self.token,
            self.ring_size,
            layout.batch_bytes(),
            samples.task,
            self.desk,
            segment_bytes=layout.nbytes + _STREAM_SPARE,
        )
        box = [first]
        del first  # the samples are freed as they are streamed
        threads = self.worker_copy_threads
        try:
            dest.allow()
            t0 = _trace.on and _trace.now()
            batch, made = streaming.collate_streaming(
                streaming.owned(box, rest), layout, dest.memory, threads, dest
            )
            if t0:
                _trace.span("worker.stream", t0, count=count)
            if batch is None:
                dest.abandon()
                assert made is not None
                return made
            p = codec.plan(batch, start=layout.nbytes, keep_strides=True)
            if p.nbytes > len(dest.memory):  # the rest does not fit: a bigger segment
                dest.grow(p.nbytes, keep=layout.nbytes)
            t0 = _trace.on and _trace.now()
            codec.write(p, dest.memory, threads)
            if t0:
                _trace.span("worker.write", t0, nbytes=p.nbytes)
        except BaseException:
            dest.abandon()
            raise
        return dest.send(p, count)


#: Room a streamed batch's segment gets after its big arrays, for the rest of the batch.
_STREAM_SPARE = 1 << 20
