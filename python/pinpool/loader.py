"""``pinpool.DataLoader``: torch's DataLoader, with batches landing in pinned arena slots.

This is the module that subclasses torch's DataLoader and its multi-process iterator (their
set-up, index sampler, shutdown and queues); the private torch names it uses come from
``_torch_contract``, which lists them all. Where each step of a batch's trip happens:

1. **Worker** (``_worker``): :class:`~pinpool._worker.collate.PinCollate` collates the
   batch and writes it into its place, the zero-copy slot handed out with its indices or one
   of the worker's reused segments (``_worker.places``); torch's result queue carries a small
   :class:`~pinpool._wire.handle.BatchHandle`.
2. **Wire** (``_wire``): the handle, the leaf specs and their checks.
3. **Main process** (``_main``): torch's pin-memory thread (or, on a machine without an
   accelerator, the iterating thread) calls the handle's ``pin_memory()``, and the loader's
   :class:`~pinpool._main.receiver.Receiver` takes the batch: it adopts its zero-copy slot,
   or checks a slot out (waiting without the GIL) and has the Rust copy threads copy the
   segment in; it hands the segment back to its worker. ``_main.delivery`` then rebuilds the
   batch as views into the slot (which returns to the pool, fenced on torch's current
   stream, when the last view dies) or copies it to the device on the loader's copy stream.

Everything else (samplers, worker start-up and shutdown, errors, timeouts, ordering,
persistent workers) is torch's own machinery, unchanged. Checkpoint and resume
(``state_dict``/``load_state_dict``) is ``_main.resume``: the index sampler torch reads as its
iterator starts records each epoch's random states, the loader counts the samples it yields,
and a resumed epoch's sampler skips the samples already yielded.
"""

from __future__ import annotations

import uuid
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch
import torch.utils.data
from torch.utils.data import default_collate, default_convert

from . import _signals, _torch_versions, _trace
from ._main import settings
from ._main.grants import TaskTagger
from ._main.loader_iter import LoaderIter
from ._main.pool_settings import PoolSettings
from ._main.receiver import Receiver
from ._main.resume import EpochSampler, LoadWorkerState, Resume, check, unsupported
from ._main.workers import WorkersIter, close_loader, shut_down
from ._native import PinPool
from ._stats import LoaderStats
from ._wire import registry
from ._wire.pool_hint import PoolHint
from ._worker.collate import PinCollate
from ._worker.fetcher import StreamInWorkers

_torch_versions.check(torch.__version__)

__all__ = ["DataLoader", "PinCollate"]

_T_co = TypeVar("_T_co", covariant=True)


class DataLoader(torch.utils.data.DataLoader[_T_co]):
    """A drop-in ``torch.utils.data.DataLoader`` whose batches land in pinned arena slots.

    Takes torch's arguments (``pin_memory`` is implied and ignored), plus:

    - ``device``: None (default) yields pinned CPU batches, views into slots; a CUDA device
      yields batches already on it, safe to use on the consumer's current stream.
    - ``arena_bytes``, ``max_batch_bytes``: the size of the fixed arena batches land in, and
      the largest batch it takes. Batches of any size up to that land in it, each taking its
      own bytes. Default (see ``pinpool._main.sizing``): room for the batches in flight
      plus 4 at 1.25 times the first batch's size, at least 64 MiB, at most half the memory
      available; the largest batch is half the arena (at most 128 MiB, unless the first
      batch is larger).
    - ``pool``: an existing :class:`~pinpool.PinPool` to use; ``slot_bytes`` and
      ``num_slots``: the older sizing, ``num_slots`` batches of up to ``slot_bytes`` each.
    - ``copy_threads``: threads copying batches into slots (default: up to 8).
    - ``overflow``: what happens to a batch when the arena is held by batches the consumer
      keeps alive (``list(loader)`` does that): ``"copy"`` (default) puts it in ordinary,
      unpinned memory, counted in ``stats()["overflow_batches"]``; ``"wait"`` waits up to
      ``slot_timeout`` seconds (None: forever) for one to die, then raises
      :class:`~pinpool.PoolExhausted`. Slots still fenced by GPU work are always waited for.
    - ``oversize``: a batch larger than the largest the arena takes gets memory of its own,
      pinned by torch's caching host allocator where there is a CUDA device (``"pin"``,
      default) or ordinary memory (``"copy"``), counted in ``stats()["oversize_batches"]`` and
      warned about once, naming the setting that would keep it in the arena; ``"error"``
      raises :class:`~pinpool.BatchTooLarge` naming that setting.
    - ``zero_copy``: workers write batches straight into the arena, each into a slot of its
      own size granted when the worker knows that size (map-style datasets with batching and
      ``num_workers > 0``; the pool must be a memfd: ``cuda-register`` or ``host``). Batches
      that find no room (the first ones, before the pool exists, among them) go through copy
      mode, counted in ``stats()["zero_copy_fallbacks"]``.
    - ``keep_worker_memory``: workers keep memory their items were made in (up to twice the
      largest batch, at most 1 GiB each) for the next batch's items, rather than give it
      back to the kernel and fault fresh pages in for every batch (glibc's trim and mmap
      thresholds; see ``pinpool._worker.heap``). False leaves the workers' allocator alone.
    - ``worker_copy_threads``: threads each worker copies a batch's big arrays with (its
      stacks, into its segment or its zero-copy slot), without the GIL. Default:
      ``$PINPOOL_WORKER_COPY_THREADS``, else the cores per worker, from 2 to 4.
    - ``stream_samples``: with torch's default collation, workers copy each sample's big
      arrays into the batch's shared memory as soon as the sample is made, while they are
      still in the CPU's cache, instead of making every sample first and stacking them after
      (see ``pinpool._worker.streaming``; the batch is the same, bit for bit). Map-style
      datasets with batching and ``num_workers > 0``: None (the default) streams there;
      False never; True where it cannot apply warns.

    A setting given that cannot apply warns once, saying why (``zero_copy=True`` without
    workers, say: ``settings.ignored``), or raises when it contradicts another (sizes given
    with ``pool=``). In the workers, ``get_worker_info().dataset`` is your dataset, as with
    torch's loader.
    """

    # Set in __init__ through __dict__ (see there).
    _pin_receiver: Receiver
    _pin_collate: PinCollate
    _pin_streams: bool
    _pin_tagging: bool
    _pin_resume: Resume

    def __init__(
        self,
        dataset: torch.utils.data.Dataset[_T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = True,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        pool: PinPool | None = None,
        arena_bytes: int | None = None,
        max_batch_bytes: int | None = None,
        slot_bytes: int | None = None,
        num_slots: int | None = None,
        device: str | torch.device | int | None = None,
        copy_threads: int | None = None,
        slot_timeout: float | None = 60.0,
        overflow: Literal["copy", "wait"] = "copy",
        oversize: Literal["pin", "copy", "error"] = "pin",
        zero_copy: bool = False,
        keep_worker_memory: bool = True,
        worker_copy_threads: int | None = None,
        stream_samples: bool | None = None,
    ) -> None:
        if isinstance(collate_fn, PinCollate):  # a rebuilt loader handed pinpool's own back
            collate_fn = collate_fn.collate_fn
        if collate_fn in (default_collate, default_convert):
            collate_fn = None  # torch's default: pinpool's own, bit for bit, streamed
        settings.check_bool("zero_copy", zero_copy)
        settings.check_bool("keep_worker_memory", keep_worker_memory)
        settings.check_bool("stream_samples", stream_samples, none_ok=True)
        settings.check_int("worker_copy_threads", worker_copy_threads, 1, 64, none_ok=True)
        in_flight = (prefetch_factor or 2) * num_workers if num_workers > 0 else 1
        pool_settings = PoolSettings.checked(
            pool=pool,
            arena_bytes=arena_bytes,
            max_batch_bytes=max_batch_bytes,
            slot_bytes=slot_bytes,
            num_slots=num_slots,
            copy_threads=copy_threads,
            slot_timeout=slot_timeout,
            overflow=overflow,
            oversize=oversize,
            device=device,
            in_flight=in_flight,
        )
        token = uuid.uuid4().hex
        # Without sizes the pool is sized from the first batch: a worker tells that size as
        # soon as it knows it (_wire.pool_hint).
        hint = PoolHint() if num_workers > 0 and not pool_settings.known else None
        auto_collation = batch_size is not None or batch_sampler is not None
        batched_map_style = (
            auto_collation
            and num_workers > 0
            and not isinstance(dataset, torch.utils.data.IterableDataset)
        )
        receiver = Receiver(
            token, pool_settings, pool_hint=hint, zero_copy=bool(zero_copy) and batched_map_style
        )
        streams = stream_samples is not False and collate_fn is None
        iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        resume = Resume(iterable, num_workers)
        # Whether the workers hand collate the indices, not the samples (the dataset they get
        # stays the caller's own: _worker.fetcher.StreamingFetcher).
        worker_streams = batched_map_style and bool(streams or zero_copy)
        collate = PinCollate(
            token,
            collate_fn,
            auto_collation=auto_collation,
            ring_size=(prefetch_factor or 2) + 2,
            keep_worker_memory=keep_worker_memory,
            worker_copy_threads=settings.worker_copy_threads(worker_copy_threads, num_workers),
            stream_samples=stream_samples is not False,
            report_state=resume.worker_states
            and unsupported(dataset, iterable, num_workers, in_order) is None,
            pool_hint=hint,
            desk=receiver.grants.desk if receiver.grants is not None else None,
        )
        # torch's own attributes say what the caller asked for (loader.collate_fn is theirs,
        # or torch's default): frameworks rebuild a loader from them (see _get_iterator).
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=torch.accelerator.is_available(),
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            in_order=in_order,
        )
        # pinpool's own arguments, as given, are public attributes too, so that a loader
        # rebuilt from its attributes (Lightning, accelerate) gets the same settings; a rebuilt
        # loader shares a pool only if the caller gave one ("pool" in vars(); loader.pool, the
        # property, is the pool in use). Set in __dict__, past any __setattr__: Lightning
        # records attributes set after torch's __init__ and sets them again on a rebuilt
        # loader, which must not get this one's internals.
        self.__dict__.update(
            pool=pool,
            arena_bytes=arena_bytes,
            max_batch_bytes=max_batch_bytes,
            slot_bytes=slot_bytes,
            num_slots=num_slots,
            device=device,
            copy_threads=copy_threads,
            slot_timeout=slot_timeout,
            overflow=overflow,
            oversize=oversize,
            zero_copy=zero_copy,
            keep_worker_memory=keep_worker_memory,
            worker_copy_threads=worker_copy_threads,
            stream_samples=stream_samples,
            _pin_receiver=receiver,
            _pin_collate=collate,
            _pin_streams=worker_streams,
            _pin_tagging=receiver.grants is not None,
            _pin_resume=resume,
            _pin_wrap=False,
        )
        _keep_for_lightning(self)
        # Every setting given does something here, or the caller hears why it does not.
        for why in settings.ignored(
            dataset=dataset,
            num_workers=num_workers,
            auto_collation=auto_collation,
            collate_fn=collate_fn,
            pool=pool,
            zero_copy=zero_copy,
            stream_samples=stream_samples,
            worker_copy_threads=worker_copy_threads,
            pin_memory=pin_memory,
            pin_memory_device=pin_memory_device,
        ):
            warnings.warn(f"pinpool.DataLoader: {why}", UserWarning, stacklevel=2)
        registry.register(token, receiver)
        if pool_settings.known:
            receiver.pools.pool_for(0)  # sizes known: make the pool now, so batch 1 has a slot too
        weakref.finalize(self, _signals.finalizing, close_loader, receiver)

    def __iter__(self) -> LoaderIter:  # type: ignore[override]
        t0 = _trace.on and _trace.now()
        resume = self._pin_resume
        resume.start(self)
        if resume.worker_start is not None and self._iterator is not None:
            # A resumed iterable dataset's workers load their states as they start: a
            # persistent iterator's workers have started.
            try:
                shut_down(self._iterator)
            finally:
                self._iterator = None
        self._pin_receiver.pools.make_ahead()
        # torch reads _index_sampler as its iterator starts (a persistent one keeps it).
        self.__dict__["_pin_wrap"] = True
        try:
            inner = super().__iter__()
        finally:
            self.__dict__["_pin_wrap"] = False
        assert resume.current is not None
        if t0:
            _trace.span("loader.iter", t0)
        return LoaderIter(self, inner, resume.current)

    @property
    def state_dict(self) -> Callable[[], dict[str, Any]]:
        """``state_dict()``: where the loader is (mid-epoch or between epochs), as plain data:
        after :meth:`load_state_dict` into a loader made with the same arguments (the batch
        size may differ), its next iteration starts at the first sample this one had not yet
        yielded (``pinpool._main.resume``); a loader whose order differs refuses the state.
        An IterableDataset resumes from its own ``state_dict()`` (each worker's copy, with
        workers); one without ``state_dict()``/``load_state_dict()`` cannot resume: both
        attributes raise ``NotResumable``, a NotImplementedError and an AttributeError
        (``hasattr`` is False)."""
        check(self._pin_why_not())
        return self._pin_state_dict

    @property
    def load_state_dict(self) -> Callable[[dict[str, Any]], None]:
        """``load_state_dict(state)``: the next iteration resumes where ``state`` (from
        :meth:`state_dict`) was taken; once it has drawn its order, torch's global RNG is as it
        was then."""
        check(self._pin_why_not())
        return self._pin_load_state_dict

    def _pin_load_state_dict(self, state: dict[str, Any]) -> None:
        self._pin_resume.load_state_dict(state, self)

    def _pin_state_dict(self) -> dict[str, Any]:
        kept = self.persistent_workers and self.num_workers > 0 and self._iterator is not None
        return self._pin_resume.state_dict(self, self.dataset, kept)

    def _pin_why_not(self) -> str | None:
        resume = self._pin_resume
        in_order = getattr(self, "in_order", True)
        return unsupported(self.dataset, resume.iterable, self.num_workers, in_order)

    def _get_iterator(self) -> Any:
        # torch's iterator reads loader.collate_fn and loader.worker_init_fn once, as it
        # starts, and hands them to the workers: for that moment only, they are what the
        # workers need (pinpool's collate around the caller's; a worker_init_fn that has the
        # workers stream, and a resumed iterable dataset's workers load their states, before
        # the caller's own runs). The dataset is the caller's.
        own_collate, own_init = self.collate_fn, self.worker_init_fn
        object.__setattr__(self, "collate_fn", self._pin_collate)
        start, self._pin_resume.worker_start = self._pin_resume.worker_start, None
        init = own_init
        if start is not None:
            init = LoadWorkerState(start.states, init)
        if getattr(self, "_pin_streams", False):
            init = StreamInWorkers(init)
        object.__setattr__(self, "worker_init_fn", init)
        try:
            if self.num_workers == 0:
                return super()._get_iterator()
            self.check_worker_number_rationality()  # (as torch's _get_iterator)
            return WorkersIter(self, start.first if start is not None else 0)
        finally:
            object.__setattr__(self, "collate_fn", own_collate)
            object.__setattr__(self, "worker_init_fn", own_init)

    @property
    def _index_sampler(self) -> Any:
        # torch reads this when it starts an epoch; in zero-copy mode every index list it
        # hands a worker carries its task.
        base = super()._index_sampler
        if self.__dict__.get("_pin_wrap"):  # records, and skips what a resumed epoch yielded
            base = EpochSampler(base, self._pin_resume, self)
        grants = self._pin_receiver.grants
        if grants is not None and getattr(self, "_pin_tagging", False):
            return TaskTagger(base, grants)
        return base

    @property
    def pool(self) -> PinPool | None:
        """The pool batches land in (None until the first batch when it is made lazily)."""
        return self._pin_receiver.pool

    def stats(self) -> LoaderStats:
        """The loader's own counters (``batches``, ``bytes``, ``overflow_batches``,
        ``zero_copy_batches``, ``zero_copy_fallbacks`` (of which ``zero_copy_no_grant`` and
        ``zero_copy_outgrown``), ``segments_cached``) plus its pool's, once the pool
        exists (:class:`~pinpool.LoaderStats`)."""
        return self._pin_receiver.stats()


#: pinpool's own __init__ arguments, beside torch's.
PINPOOL_ARGUMENTS = (
    "pool",
    "arena_bytes",
    "max_batch_bytes",
    "slot_bytes",
    "num_slots",
    "device",
    "copy_threads",
    "slot_timeout",
    "overflow",
    "oversize",
    "zero_copy",
    "keep_worker_memory",
    "worker_copy_threads",
    "stream_samples",
)


def _keep_for_lightning(loader: DataLoader) -> None:
    """Lightning, inside its ``*_dataloader`` hooks, wraps the ``__init__`` of every
    DataLoader class that exists when the hook starts, to record the arguments a loader was
    made with and rebuild it from them (with a distributed sampler, say). When pinpool was
    first imported inside the hook, only torch's ``__init__`` was wrapped, and it recorded
    the arguments pinpool passed to torch: pinpool's own are added here, so that the rebuilt
    loader has the same settings whatever the import order."""
    saved = loader.__dict__.get("__pl_saved_kwargs")
    if isinstance(saved, dict):
        for name in PINPOOL_ARGUMENTS:
            saved.setdefault(name, loader.__dict__[name])
