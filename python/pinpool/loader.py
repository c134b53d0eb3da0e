"""``pinpool.DataLoader``: torch's DataLoader, with batches landing in pinned arena slots.

This is the module that subclasses torch's DataLoader and its multi-process iterator (their
set-up, index sampler, shutdown and queues); the private torch names it uses come from
``_torch_contract``, which lists them all. Where each step of a batch's trip happens:

1. **Worker** (``_worker``): :class:`~pinpool._worker.collate.PinCollate` collates the
   batch and writes it into its place, the zero-copy slot handed out with its indices or one
   of the worker's reused segments (``_worker.destination``); torch's result queue carries a small
   :class:`~pinpool._wire.handle.BatchHandle`.
2. **Wire** (``_wire``): the handle, the leaf specs and their checks.
3. **Main process** (``_main``, its batch route ``_main.route``): torch's pin-memory thread
   (or, on a machine without an accelerator, the iterating thread) calls the handle's
   ``pin_memory()``, and the loader's :class:`~pinpool._main.route.receiver.Receiver` takes the
   batch: it adopts its zero-copy slot, or checks a slot out (waiting without the GIL) and has
   the Rust copy threads copy the segment in; it hands the segment back to its worker.
   ``_main.route.delivery`` then rebuilds the batch as views into the slot (which returns to
   the pool, fenced on torch's current stream, when the last view dies) or copies it to the
   device on the loader's copy stream.

Everything else (samplers, worker start-up and shutdown, errors, timeouts, ordering,
persistent workers) is torch's own machinery, unchanged. Checkpoint and resume
(``state_dict``/``load_state_dict``) is ``_main.resume``: the index sampler torch reads as its
iterator starts records each epoch's random states, the loader counts the samples it yields,
and a resumed epoch's sampler skips the samples already yielded.
"""

from __future__ import annotations

import textwrap
import uuid
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch
import torch.utils.data
from torch.utils.data import default_collate, default_convert

from . import _signals, _torch_versions, _trace
from ._main.epochs.loader_iter import LoaderIter
from ._main.epochs.workers import WorkersIter, close_loader, shut_down
from ._main.resume.checkpoint import (
    EpochSampler,
    LoadWorkerState,
    Resume,
    raise_if_not_resumable,
    unsupported,
)
from ._main.route.grants import TaskTagger
from ._main.route.receiver import Receiver
from ._main.settings import arguments
from ._main.settings.delivery_mode import DeliveryMode
from ._main.settings.pool_settings import POOL_ARGUMENTS, PoolSettings
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

    Takes torch's arguments, plus pinpool's own,
    each declared once, with its default, its check and what it does, in
    ``pinpool._main.settings.arguments.ARGUMENTS`` (listed below; the user guide's options
    table says more). What they resolve to on this machine is the loader's delivery mode
    (``delivery_mode.DeliveryMode``: copy or zero-copy, torch's pin thread or the consumer's,
    pinned CPU batches or a CUDA device).

    A setting given that cannot apply warns once, saying why (``zero_copy=True`` without
    workers, say: ``arguments.ignored``), or raises when it contradicts another (sizes given
    with ``pool=``). In the workers, ``get_worker_info().dataset`` is your dataset, as with
    torch's loader. ``pin_memory`` is True unless given (or unless torch's deprecated
    ``pin_memory_device`` is given alone: it keeps torch's default then, False):
    ``pin_memory=False`` means what it means to torch's loader, batches as torch gives them,
    unpinned and outside the arena (pinpool's own arguments then do nothing, and ``device=``
    is refused).

    pinpool's arguments:

    """

    # Set in __init__ through __dict__ (see there).
    _pinpool_receiver: Receiver
    _pinpool_collate: PinCollate
    _pinpool_streams: bool
    _pinpool_tagging: bool
    _pinpool_resume: Resume

    def __init__(
        self,
        dataset: torch.utils.data.Dataset[_T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool | None = None,
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
        # pinpool's own arguments, by name, as given (each declared in arguments.ARGUMENTS).
        given = arguments.given(locals())
        if pin_memory is None:
            pin_memory = not pin_memory_device  # (alone, torch's deprecated argument pins nothing)
        unpinned = not pin_memory  # torch's loader, as it is: see arguments.UNPINNED
        if unpinned:
            zero_copy, stream_samples = False, False
            arguments.check_unpinned(given)
        if isinstance(collate_fn, PinCollate):  # a rebuilt loader handed pinpool's own back
            collate_fn = collate_fn.collate_fn
        if collate_fn in (default_collate, default_convert):
            collate_fn = None  # torch's default: pinpool's own, bit for bit, streamed
        arguments.check_given({k: v for k, v in given.items() if k not in POOL_ARGUMENTS})
        in_flight = (prefetch_factor or 2) * num_workers if num_workers > 0 else 1
        pool_settings = PoolSettings.checked(given, in_flight=in_flight)
        token = uuid.uuid4().hex
        # Without sizes the pool is sized from the first batch: a worker tells that size as
        # soon as it knows it (_wire.pool_hint).
        hint = PoolHint() if num_workers > 0 and not pool_settings.known and not unpinned else None
        shape = arguments.Shape(
            iterable=isinstance(dataset, torch.utils.data.IterableDataset),
            num_workers=num_workers,
            auto_collation=batch_size is not None or batch_sampler is not None,
            collate_fn=collate_fn,
            pool=pool,
        )
        mode = DeliveryMode.resolve(zero_copy=zero_copy, device=pool_settings.device, shape=shape)
        receiver = Receiver(token, pool_settings, mode, pool_hint=hint)
        streams = stream_samples is not False and collate_fn is None
        resume = Resume(shape.iterable, num_workers)
        # Whether the workers hand collate the indices, not the samples (the dataset they get
        # stays the caller's own: _worker.fetcher.StreamingFetcher).
        worker_streams = shape.batched_map_style and bool(streams or zero_copy)
        collate = PinCollate(
            token,
            collate_fn,
            auto_collation=shape.auto_collation,
            ring_size=(prefetch_factor or 2) + 2,
            keep_worker_memory=keep_worker_memory,
            worker_copy_threads=arguments.worker_copy_threads(worker_copy_threads, num_workers),
            stream_samples=stream_samples is not False,
            report_state=resume.worker_states
            and unsupported(dataset, shape.iterable, num_workers, in_order) is None,
            pool_hint=hint,
            desk=receiver.grants.desk if receiver.grants is not None else None,
            unpinned=unpinned,
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
            pin_memory=bool(pin_memory),
            pin_memory_device=pin_memory_device,
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
            given,
            _pinpool_receiver=receiver,
            _pinpool_collate=collate,
            _pinpool_streams=worker_streams,
            _pinpool_tagging=mode.zero_copy,
            _pinpool_resume=resume,
            _pinpool_wrap=False,
        )
        _keep_for_lightning(self)
        # Every setting given does something here, or the caller hears why it does not.
        for why in arguments.ignored(
            dataset=dataset,
            num_workers=num_workers,
            auto_collation=shape.auto_collation,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            **given,
        ):
            warnings.warn(f"pinpool.DataLoader: {why}", UserWarning, stacklevel=2)
        registry.register(token, receiver)
        if pool_settings.known and not unpinned:
            receiver.pools.pool_for(0)  # sizes known: make the pool now, so batch 1 has a slot too
        weakref.finalize(self, _signals.finalizing, close_loader, receiver)

    def __iter__(self) -> LoaderIter:  # type: ignore[override]
        t0 = _trace.on and _trace.now()
        resume = self._pinpool_resume
        resume.start(self)
        if resume.worker_start is not None and self._iterator is not None:
            # A resumed iterable dataset's workers load their states as they start: a
            # persistent iterator's workers have started.
            try:
                shut_down(self._iterator)
            finally:
                self._iterator = None
        self._pinpool_receiver.pools.make_from_first_hint()
        # torch reads _index_sampler as its iterator starts (a persistent one keeps it).
        self.__dict__["_pinpool_wrap"] = True
        try:
            inner = super().__iter__()
        finally:
            self.__dict__["_pinpool_wrap"] = False
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
        raise_if_not_resumable(self._pinpool_why_not())
        return self._pinpool_state_dict

    @property
    def load_state_dict(self) -> Callable[[dict[str, Any]], None]:
        """``load_state_dict(state)``: the next iteration resumes where ``state`` (from
        :meth:`state_dict`) was taken; once it has drawn its order, torch's global RNG is as it
        was then."""
        raise_if_not_resumable(self._pinpool_why_not())
        return self._pinpool_load_state_dict

    def _pinpool_load_state_dict(self, state: dict[str, Any]) -> None:
        self._pinpool_resume.load_state_dict(state, self)

    def _pinpool_state_dict(self) -> dict[str, Any]:
        kept = self.persistent_workers and self.num_workers > 0 and self._iterator is not None
        return self._pinpool_resume.state_dict(self, self.dataset, kept)

    def _pinpool_why_not(self) -> str | None:
        resume = self._pinpool_resume
        in_order = getattr(self, "in_order", True)
        return unsupported(self.dataset, resume.iterable, self.num_workers, in_order)

    def _get_iterator(self) -> Any:
        # torch's iterator reads loader.collate_fn and loader.worker_init_fn once, as it
        # starts, and hands them to the workers: for that moment only, they are what the
        # workers need (pinpool's collate around the caller's; a worker_init_fn that has the
        # workers stream, and a resumed iterable dataset's workers load their states, before
        # the caller's own runs). The dataset is the caller's.
        # And torch's pin step runs where pinpool's mode has it run (torch's iterator reads
        # loader.pin_memory): where an accelerator is present; or where torch is to warn about
        # a pin_memory_device given with pin_memory=True, which it does in its own words.
        own_collate, own_init, pinned = self.collate_fn, self.worker_init_fn, self.pin_memory
        torch_pins = self._pinpool_receiver.mode.pin_thread or bool(self.pin_memory_device)
        object.__setattr__(self, "pin_memory", bool(pinned) and torch_pins)
        object.__setattr__(self, "collate_fn", self._pinpool_collate)
        start, self._pinpool_resume.worker_start = self._pinpool_resume.worker_start, None
        init = own_init
        if start is not None:
            init = LoadWorkerState(start.states, init)
        if getattr(self, "_pinpool_streams", False):
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
            object.__setattr__(self, "pin_memory", pinned)

    @property
    def _index_sampler(self) -> Any:
        # torch reads this when it starts an epoch; in zero-copy mode every index list it
        # hands a worker carries its task.
        base = super()._index_sampler
        if self.__dict__.get("_pinpool_wrap"):  # records, and skips what a resumed epoch yielded
            base = EpochSampler(base, self._pinpool_resume, self)
        grants = self._pinpool_receiver.grants
        if grants is not None and getattr(self, "_pinpool_tagging", False):
            return TaskTagger(base, grants)
        return base

    @property
    def pool(self) -> PinPool | None:
        """The pool batches land in (None until the first batch when it is made lazily)."""
        return self._pinpool_receiver.pool

    def stats(self) -> LoaderStats:
        """The loader's own counters (``batches``, ``bytes``, ``overflow_batches``,
        ``zero_copy_batches``, ``zero_copy_fallbacks`` (of which ``zero_copy_no_grant`` and
        ``zero_copy_outgrown``), ``segments_cached``) plus its pool's, once the pool
        exists (:class:`~pinpool.LoaderStats`)."""
        return self._pinpool_receiver.stats()


#: pinpool's own __init__ arguments, beside torch's (declared in ``arguments.ARGUMENTS``).
PINPOOL_ARGUMENTS = tuple(a.name for a in arguments.ARGUMENTS)

DataLoader.__doc__ = (DataLoader.__doc__ or "") + textwrap.indent(arguments.argument_docs(), "    ")


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
