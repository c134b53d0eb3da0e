"""The main process's side of one loader: where each batch handle from a worker is taken.

The receiver coordinates three steps, each its own module, for every batch
(:meth:`Receiver.take`):

1. **Intake** (``intake.Intake``): the handle is checked and becomes "this memory, these leaf
   specs, from this source": a zero-copy slot it adopts, or a worker's segment it takes hold
   of, or no memory at all.
2. **The lazy pool** (``lazy_pool.LazyPool``): the pool is made at the first batch (or from a
   worker's hint, or at once when its sizes are known), and a copy-mode batch gets a slot
   checked out (``PinPool.claim``: the rules in Rust, waiting without the GIL) or an ordinary
   buffer, into which the segment cache's copy threads copy the segment, without the GIL. On
   torch's pin thread, a batch that stays on the CPU is copied in the background: the pin
   thread goes on to the next batch, the copy thread hands the segment back, and the
   consumer's thread waits for the copy before it yields the batch.
3. **Delivery** (``delivery.Delivery``): CPU views into the slot, or a copy on the device (for
   a segment's batch in a slot the driver pinned, straight from the segment through the slot
   to the device in one call); either way one ``delivery.Pending``.

The segment is then handed back to its worker; nothing is unmapped per batch (retired
segments are unmapped on the Rust reclaimer thread).

Invariants: a handle is taken or dropped at most once, and whatever fails on the way it is
dropped (its segment handed back, its unused slot taken back: ``intake``); the pool is made
in one place only (``lazy_pool``); what :meth:`Receiver.take` returns is a
``delivery.Pending``, or, ahead of the consumer, the handle itself, to be taken in its turn.
"""

from __future__ import annotations

import os
from typing import Any, cast

from ... import _trace
from ..._errors import PinPoolError
from ..._native import PinPool, SegmentCache, Slot
from ..._stats import LoaderStats
from ..._wire import codec
from ..._wire.handle import ARRIVED, BatchHandle
from ..._wire.pool_hint import PoolHint
from ..settings.delivery_mode import DeliveryMode
from ..settings.pool_settings import PoolSettings
from . import notices
from .delivery import Delivery, Pending
from .grants import LoaderGrants
from .intake import Intake
from .lazy_pool import TAKE_IN_TURN, LazyPool
from .split_batch import SplitBatch

#: Batches bound for the device of at most this many bytes are sent by the consumer's thread,
#: in its turn, on its current stream (torch's pin thread only has them copied into their slot
#: ahead): for a small batch, a stream of its own, its event and the hand-over between the
#: threads cost more than the copy gains from running beside the consumer's work.
CONSUMER_SENDS_UP_TO = 1 << 20


class Receiver:
    """The intake, the lazy pool, the zero-copy grants and the delivery of one loader."""

    def __init__(
        self,
        token: str,
        settings: PoolSettings,
        mode: DeliveryMode,
        pool_hint: PoolHint | None = None,
    ) -> None:
        self.token = token
        self.pid = os.getpid()  # finalizers run in a forked child do nothing
        #: How the loader's batches reach the consumer (``delivery_mode.DeliveryMode``).
        self.mode = mode
        #: Zero-copy: the loader's grants (None in copy mode).
        self.grants = LoaderGrants() if mode.zero_copy else None
        self.pools = LazyPool(settings, pool_hint, self.grants)
        self.intake = Intake(self.pools, self.grants)
        self.deliver = Delivery(mode)
        self.pools.batches_ahead = self.deliver.taken_ahead  # (no cycle: the delivery's own)
        #: The loader's current torch iterator (a weak reference), set and used by the loader.
        self.iterator: Any = None
        #: Whether the loader warned that zero-copy fell back (:meth:`epoch_ended`).
        self.fallbacks_warned = False

    @property
    def pool(self) -> PinPool | None:
        """The pool (None until it is made)."""
        return self.pools.pool

    @property
    def cache(self) -> SegmentCache | None:
        """The segment cache (None until the pool is made)."""
        return self.pools.cache

    @property
    def closed(self) -> bool:
        """Set by :meth:`close`: no segment is opened after it (nothing would retire it)."""
        return self.pools.closed

    # -- a batch from a worker --------------------------------------------------------------

    def take(self, handle: BatchHandle, ahead: bool) -> Any:
        """The handle's batch, delivered (a ``delivery.Pending``); or, with ``ahead``, the
        handle itself when no slot is at hand now.

        ``ahead``: called by torch's pin thread, which takes batches as they arrive, ahead of
        the consumer and in any order. It never waits for a slot that only the consumer can
        give back, nor decides on overflow: when every slot is held by a batch, the handle
        itself is returned, and the consumer's thread takes it when it reaches that batch,
        in order (the same rules as on a machine without an accelerator). Nor does it wait
        for a copy into a slot whose batch stays on the CPU or is a small one for the device
        (:data:`CONSUMER_SENDS_UP_TO`): the consumer's thread waits for it, and sends the
        latter on its current stream (``Pending.wait``), a small zero-copy batch too (adopted
        here).

        A bigger batch for the device whose slot the driver pinned is copied into the slot
        and on to the device in one call without the GIL (``SegmentCache.copy_to_device``),
        as it is delivered; its segment goes back after that."""
        if not handle._state:
            cut = getattr(handle, "_cut", None)
            if cut is not None:
                # An interrupt cut this batch's taking short (its memory is back): the
                # consumer meets it again, in a storm of interrupts say, as that interrupt.
                raise cut("this batch was lost to an interrupt that cut its taking short")
            raise PinPoolError("this batch handle was taken or dropped already")
        if handle.slot is None and handle.segment is None and handle.worker is None:
            self.intake.inline(handle)
            return self.deliver(handle.tree, [], None, 0)
        copying = None
        try:
            consumer_sends = self.mode.on_device and self._consumer_sends(handle)
            if handle.slot is not None:
                t0 = _trace.on and _trace.now()
                memory, specs, need = self.intake.adopt(handle)
                if t0:
                    _trace.span("batch.adopt", t0, nbytes=need)
            else:
                got = self._copy_in(handle, ahead, consumer_sends)
                if got is TAKE_IN_TURN:
                    return handle
                memory, specs, need, copying = got
                if not consumer_sends and copying is None and self._pinned_slot_to_device(memory):
                    return self._send(handle, specs, memory, need, ahead)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                handle._cut = type(exc)
            self.intake.drop(handle)
            raise
        self.intake.drop(handle, handed_back=copying is not None)
        if consumer_sends and self._pinned_slot_to_device(memory):
            # Sent on the consumer's thread as it is yielded (Pending.wait).
            later = (handle.tree, specs, memory, need)
            return Pending(
                None,
                copying=copying,
                later=later,
                delivery=self.deliver,
                counts=self.deliver,
                nbytes=need,
            )
        t0 = _trace.on and _trace.now()
        pending = self.deliver(handle.tree, specs, memory, need, copying)
        if t0:
            _trace.span("batch.deliver", t0, nbytes=need)
        return pending

    def _send(
        self, handle: BatchHandle, specs: list[codec.LeafSpec], slot: Slot, need: int, ahead: bool
    ) -> Pending:
        """A big segment's batch, for the device, in a slot the driver pinned: into the slot
        and on to the device. Ahead of the consumer (torch's pin thread), on a copy thread,
        so that the pin thread goes on to the next batch (``Delivery.start_sending``; the copy
        thread hands the segment back); else, or for a batch whose leaves are not views of one
        allocation, in one call here, as it is delivered."""
        cache = self.pools.cache
        assert cache is not None  # (made by _copy_in)
        source = (cache, (handle.worker, handle.segment))
        started = None
        try:
            if ahead:
                started = self.deliver.start_sending(specs, slot, need, source)
            if started is None:
                return self.deliver.send(handle.tree, specs, slot, need, source)
        finally:
            # Handed back by the copy thread once started (never twice).
            self.intake.drop(handle, handed_back=started is not None)
        return self.deliver.finish_sending(handle.tree, slot, need, started)

    def _consumer_sends(self, handle: BatchHandle) -> bool:
        """Whether a batch bound for the device is small enough for the consumer's thread to
        send it (:data:`CONSUMER_SENDS_UP_TO`); a segment's batch has its segment opened
        first, here on the pin thread, while its worker surely lives."""
        if handle.slot is None and handle._state == ARRIVED:
            self.intake.receive(handle)
        try:
            return int(handle.nbytes) <= CONSUMER_SENDS_UP_TO
        except (TypeError, ValueError, OverflowError):
            return False  # (a corrupt zero-copy handle: refused as it is adopted)

    def take_in_turn(self, handle: BatchHandle) -> Any:
        """The handle's batch, on the consumer's thread and in its turn: taken, and handed
        over to the consumer (``Pending.wait``)."""
        pending: Pending = self.take(handle, ahead=False)
        return pending.wait()

    def _pinned_slot_to_device(self, memory: Any) -> bool:
        """Whether a segment's batch in ``memory`` goes to the device straight from the
        segment (a slot the driver pinned, a device to deliver on): then nothing copies it
        into the slot first."""
        return isinstance(memory, Slot) and self.mode.on_device and memory.device is not None

    def _copy_in(self, handle: BatchHandle, ahead: bool, consumer_sends: bool) -> Any:
        """Copy mode: a slot (or an ordinary buffer) with the segment's batch copied in; or
        still being copied in (then also its :class:`~pinpool._native.Copying`, and the
        segment goes back to its worker from the copy thread); or, for a big batch sent to
        the device from a slot the driver pinned, nothing copied yet (see :meth:`take`); or
        :data:`~pinpool._main.route.lazy_pool.TAKE_IN_TURN`. ``consumer_sends``: a batch for the
        device the consumer's thread sends (:data:`CONSUMER_SENDS_UP_TO`)."""
        if handle._state == ARRIVED:
            self.intake.receive(handle)
        pool, cache = self.pools.pool_for(int(handle.nbytes))
        specs, need = self.intake.segment_specs(handle)
        # A CPU batch no one free range holds may go to several (SplitBatch); one for the device
        # goes to ordinary memory then, copied to the device from there.
        split = None if self.mode.on_device else specs
        memory = self.pools.claim(pool, need, ahead, split) if need else None
        if memory is TAKE_IN_TURN:
            return TAKE_IN_TURN
        key = (handle.worker, handle.segment)
        copying: Any = None
        t0 = _trace.on and _trace.now()
        if isinstance(memory, Slot):
            pinned = self._pinned_slot_to_device(memory)
            if pinned and not consumer_sends:
                pass  # (Delivery.send copies it)
            elif ahead and (not self.mode.on_device or pinned):
                # The pin thread goes on to the next batch; the consumer waits (Pending.wait),
                # and sends a small batch for the device from the slot.
                copying = cache.copy_to_slot_then_release(key, memory, [(0, 0, need)])
            else:
                cache.copy_to_slot(key, memory, [(0, 0, need)])
        elif isinstance(memory, SplitBatch):
            memory.copy_in(cache, key)
        elif memory is not None:
            cache.copy_to_buffer(key, memory.numpy(), [(0, 0, need)])
        if t0 and memory is not None:
            _trace.span(
                "batch.copy", t0, nbytes=need, how=self._copy_how(memory, copying, consumer_sends)
            )
        return memory, specs, need, copying

    def _copy_how(self, memory: Any, copying: Any, consumer_sends: bool) -> str:
        """The ``batch.copy`` event's ``how`` (see ``pinpool._trace.EVENTS``)."""
        if copying is not None:
            return "background"
        if not consumer_sends and self._pinned_slot_to_device(memory):
            return "device"
        if isinstance(memory, SplitBatch):
            return "pieces"
        return "slot" if isinstance(memory, Slot) else "buffer"

    def receive_now(self, handle: BatchHandle) -> None:
        """Takes hold of a copy-mode handle's segment as the handle arrives, ahead of taking
        its batch (``Intake.receive_now``)."""
        self.intake.receive_now(handle)

    def drop(self, handle: BatchHandle, handed_back: bool = False) -> None:
        """Ends the handle's life here (``Intake.drop``)."""
        self.intake.drop(handle, handed_back)

    # -- a batch collated here (num_workers=0) ----------------------------------------------

    def encode_local(self, batch: Any, count: int | None, threads: int = 1) -> Pending:
        """Writes a batch collated (or received) in this process straight into a slot, its
        arrays of at least ``codec.GATHER_MIN`` bytes by ``threads`` copy threads without the
        GIL. A batch without arrays makes no pool (the first batch with arrays sizes it)."""
        p = codec.plan(batch, keep_strides=True)  # torch's pin_memory keeps each layout
        if not p.specs:
            return self.deliver(p.tree, p.specs, None, 0)
        del count  # (sized from the bytes, never scaled by a sample count)
        pool, _ = self.pools.pool_for(p.nbytes)
        memory = self.pools.claim(pool, p.nbytes) if p.nbytes else None
        if memory is not None:
            t0 = _trace.on and _trace.now()
            codec.write(p, memory, threads)
            if t0:
                _trace.span("batch.copy", t0, nbytes=p.nbytes, how="local")
        return self.deliver(p.tree, p.specs, memory, p.nbytes)

    # -- the end ------------------------------------------------------------------------------

    def retire_segments(self, dead_only: bool = False) -> None:
        """Unmaps (on the reclaimer thread) the segments of workers that have exited (of every
        worker with ``dead_only=False``)."""
        self.intake.retire_segments(dead_only)

    def close(self) -> None:
        """Takes back every zero-copy slot, retires every segment and closes the pool if it
        is the loader's own. The loader shuts its workers down first: none may write into a
        slot taken back here."""
        if self.pid != os.getpid():
            return
        t0 = _trace.on and _trace.now()
        self.pools.close()
        if self.grants is not None:
            self.grants.close()
        self.retire_segments()
        # Returns at once: segments are unmapped, and the arena is freed, on background
        # threads (see wait_for_freed_pools).
        self.pools.close_pool()
        if t0:
            _trace.span("loader.close", t0)

    def fallbacks_mark(self) -> tuple[int, int]:
        """The batches handed over and the zero-copy fallbacks so far (an epoch's start)."""
        grants = self.grants
        fell = grants.no_grant + grants.outgrown if grants is not None else 0
        return self.deliver.handed, fell

    def epoch_ended(self, mark: tuple[int, int]) -> None:
        """Warns (once per loader) where zero-copy fell back for more than a quarter of the
        batches handed over since ``mark`` (:meth:`fallbacks_mark`, as the epoch started)."""
        (handed_now, fell_now), (handed_then, fell_then) = self.fallbacks_mark(), mark
        handed, fell = handed_now - handed_then, fell_now - fell_then
        if self.grants is None or self.fallbacks_warned or fell * 4 <= handed:
            return
        self.fallbacks_warned = True
        notices.queue(
            f"pinpool: zero-copy fell back for {fell} of the epoch's {handed} batches: "
            "their workers wrote them outside the arena and they were copied in (a batch got "
            "no slot, or outgrew the one it got); stats()['zero_copy_no_grant'] and "
            "['zero_copy_outgrown'] say which (warned once per loader)"
        )
        notices.give_due()

    def stats(self) -> LoaderStats:
        """The pool's counters (once it exists) plus the loader's own."""
        pool, cache = self.pools.pool, self.pools.cache
        out: dict[str, Any] = dict(pool.stats()) if pool is not None else {}
        deliver = self.deliver
        out["batches"] = deliver.handed
        out["bytes"] = deliver.handed_bytes
        out["batches_ahead"] = deliver.batches - deliver.handed
        out["overflow_batches"] = self.pools.overflow_batches
        out["split_batches"] = self.pools.split_batches
        out["oversize_batches"] = self.pools.oversize_batches
        out["zero_copy_batches"] = self.intake.zero_copy_batches
        grants = self.grants
        no_grant, outgrown = (grants.no_grant, grants.outgrown) if grants else (0, 0)
        out["zero_copy_fallbacks"] = no_grant + outgrown
        out["zero_copy_no_grant"] = no_grant
        out["zero_copy_outgrown"] = outgrown
        out["segments_cached"] = len(cache) if cache is not None else 0
        return cast(LoaderStats, out)
