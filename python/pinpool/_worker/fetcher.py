"""The fetcher of a worker that streams: torch's worker loop asks its fetcher for each batch;
in a loader whose workers stream, that is :class:`StreamingFetcher`, which hands pinpool's
collate the batch's indices, not its samples (``_worker.streaming`` makes them one by one).

Invariants: the worker's ``get_worker_info().dataset`` is the caller's own dataset; torch's
fetcher is replaced only in a worker process, only where the dataset is map-style, samples
are batched and the collate is pinpool's, and at most once per process.
"""

from __future__ import annotations

from typing import Any

from .. import _torch_contract as torch_contract
from .._wire.handle import TaggedIndices, TaskedItems
from .collate import PinCollate
from .streaming import LazySamples


class StreamingFetcher:
    """torch's map-style fetcher, for pinpool's collate: ``fetch`` hands collate the indices
    (:class:`LazySamples`, with their zero-copy task, if the index list carries one) rather
    than the samples; a dataset with its own ``__getitems__`` gets its samples made by it, as
    torch's fetcher would (:class:`~pinpool._wire.handle.TaskedItems`). The dataset is the
    caller's own: ``get_worker_info().dataset`` in a worker is what they passed."""

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Any, drop_last: bool):
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last

    def fetch(self, possibly_batched_index: Any) -> Any:
        indices = possibly_batched_index
        task = indices.task if type(indices) is TaggedIndices else None
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems:
            return self.collate_fn(TaskedItems(getitems(list(indices)), task))
        return self.collate_fn(LazySamples(self.dataset, list(indices), task))


class StreamInWorkers:
    """The ``worker_init_fn`` of a loader whose workers stream: :func:`stream_in_this_worker`,
    then the caller's own (``init_fn``), if any."""

    def __init__(self, init_fn: Any) -> None:
        self.init_fn = init_fn

    def __call__(self, worker_id: int) -> None:
        stream_in_this_worker()
        if self.init_fn is not None:
            self.init_fn(worker_id)


def stream_in_this_worker() -> None:
    """Has torch's workers in this process fetch batches with :class:`StreamingFetcher` where
    the dataset is map-style, samples are batched and the collate is pinpool's (called in the
    worker, by its ``worker_init_fn``, before torch makes its fetcher). Elsewhere, torch's own
    fetcher."""
    kind = torch_contract.dataset_kind()
    if getattr(kind.create_fetcher, "_pinpool", False):
        return
    original = kind.create_fetcher

    def create_fetcher(
        dataset_kind: Any, dataset: Any, auto_collation: bool, collate_fn: Any, drop_last: bool
    ) -> Any:
        if dataset_kind == kind.Map and auto_collation and isinstance(collate_fn, PinCollate):
            return StreamingFetcher(dataset, auto_collation, collate_fn, drop_last)
        return original(dataset_kind, dataset, auto_collation, collate_fn, drop_last)

    create_fetcher._pinpool = True  # type: ignore[attr-defined]
    kind.create_fetcher = staticmethod(create_fetcher)
