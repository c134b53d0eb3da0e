"""The main process's side of one loader: where each batch handle from a worker is taken.

The receiver coordinates these steps for every batch
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
3. **The route** (:meth:`Receiver._route`, once the batch's memory is known, the one place it
   is decided): whether its bytes are copied in now, on a copy thread, or on their way to the
   device in the same call, and who sends it to the device (nobody: CPU views; the consumer's
   thread, in its turn; the taking thread; or torch, from memory the driver did not pin).
4. **Delivery** (``delivery.Delivery``): CPU views into the slot, or a copy on the device (for
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
from typing import Any, NamedTuple, cast

from ... import _trace
from ..._errors import PinPoolError
from ..._native import Copying, PinPool, SegmentCache, Slot
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

#: :attr:`Route.copy`: nothing to copy (a zero-copy slot, a batch collated here, no bytes).
NO_COPY = "none"
#: ... copied into its memory now, on this thread (by the copy threads from 1 MiB).
NOW = "now"
#: ... copied into its slot on a copy thread, which then hands the segment back; the consumer
#: waits for it (``Pending.wait``).
BACKGROUND = "background"
#: ... copied into its slot and on to the device in one call (:meth:`Receiver._send`).
WITH_SEND = "with-send"
#: :attr:`Route.sender`: none, the batch stays on the CPU (views of its memory).
NO_SEND = "none"
#: ... the consumer's thread, in its turn, on its current stream (a small batch in a slot the
#: driver pinned: :data:`CONSUMER_SENDS_UP_TO`).
CONSUMER = "consumer"
#: ... the taking thread, on the loader's copy stream, from a slot the driver pinned.
HERE = "here"
#: ... torch (``Tensor.to``), from memory the driver did not pin (an ordinary buffer).
BY_TORCH = "torch"

#: The ``how`` of a ``batch.copy`` event (see ``pinpool._trace.EVENTS``), by the memory the
#: batch was copied into.
_COPIED_INTO = {Slot: "slot", SplitBatch: "pieces"}


class Route(NamedTuple):
    """How one batch goes on once its memory is known, decided once (:meth:`Receiver._route`):
    how its bytes get into that memory, and who sends it to the device."""

    copy: str
    sender: str


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
        in order (the same rules as on a machine without an accelerator). How the batch goes
        from there is decided once, by :meth:`_route`."""
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
            if handle.slot is not None:
                t0 = _trace.on and _trace.now()
                memory, specs, need = self.intake.adopt(handle)
                if t0:
                    _trace.span("batch.adopt", t0, nbytes=need)
                route = self._route(memory, need, ahead)
            else:
                if handle._state == ARRIVED:
                    self.intake.receive(handle)  # (on the pin thread: its worker surely lives)
                pool, cache = self.pools.pool_for(int(handle.nbytes))
                specs, need = self.intake.segment_specs(handle)
                # A CPU batch no one free range holds may go to several (SplitBatch); one for
                # the device goes to ordinary memory then, copied to the device from there.
                split = None if self.mode.on_device else specs
                memory = self.pools.claim(pool, need, ahead, split) if need else None
                if memory is TAKE_IN_TURN:
                    return handle
                route = self._route(memory, need, ahead, copied=True)
                if route.copy == WITH_SEND:
                    assert isinstance(memory, Slot)  # (one the driver pinned)
                    return self._send(handle, specs, memory, need, ahead)
                copying = self._copy_in(cache, handle, memory, need, route)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                handle._cut = type(exc)
            self.intake.drop(handle)
            raise
        self.intake.drop(handle, handed_back=copying is not None)
        return self._deliver(handle.tree, specs, memory, need, route, copying)

    def _route(
        self, memory: Any, need: int, ahead: bool, copied: bool = False, local: bool = False
    ) -> Route:
        """How a batch of ``need`` bytes in ``memory`` goes on (see :class:`Route`): the one
        place this is decided. ``copied``: its bytes are in a worker's segment (copy mode),
        else in ``memory`` already (a zero-copy slot, or, ``local``, collated on the
        consumer's thread, which sends it at once)."""
        pinned = isinstance(memory, Slot) and self.mode.on_device and memory.device is not None
        if not self.mode.on_device or memory is None:
            sender = NO_SEND
        elif not pinned:
            sender = BY_TORCH
        elif need <= CONSUMER_SENDS_UP_TO and not local:
            sender = CONSUMER
        else:
            sender = HERE
        if not copied or memory is None:
            copy = NO_COPY
        elif sender == HERE:
            copy = WITH_SEND  # into the slot and on to the device: one call (Receiver._send)
        elif ahead and isinstance(memory, Slot) and sender in (NO_SEND, CONSUMER):
            # The pin thread goes on to the next batch; the consumer waits (Pending.wait),
            # and sends a small batch for the device from the slot.
            copy = BACKGROUND
        else:
            copy = NOW
        return Route(copy, sender)

    def _deliver(
        self,
        tree: Any,
        specs: list[codec.LeafSpec],
        memory: Any,
        need: int,
        route: Route,
        copying: Copying | None = None,
    ) -> Pending:
        """The batch over ``memory``, handed on as its route says."""
        if route.sender == CONSUMER:
            # Sent on the consumer's thread as it is yielded (Pending.wait).
            return Pending(
                None,
                copying=copying,
                later=(tree, specs, memory, need),
                delivery=self.deliver,
                counts=self.deliver,
                nbytes=need,
            )
        t0 = _trace.on and _trace.now()
        if route.sender == HERE:  # (its bytes in the slot already: nothing to copy first)
            pending = self.deliver.send(tree, specs, memory, need, None)
        else:
            pending = self.deliver(tree, specs, memory, need, copying)
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
        assert cache is not None  # (made before the claim)
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

    def take_in_turn(self, handle: BatchHandle) -> Any:
        """The handle's batch, on the consumer's thread and in its turn: taken, and handed
        over to the consumer (``Pending.wait``)."""
        pending: Pending = self.take(handle, ahead=False)
        return pending.wait()

    def _copy_in(
        self, cache: SegmentCache, handle: BatchHandle, memory: Any, need: int, route: Route
    ) -> Copying | None:
        """Copy mode: the segment's batch copied into ``memory`` (a slot, an ordinary buffer,
        or pieces), now or on a copy thread as ``route`` says; the latter's
        :class:`~pinpool._native.Copying` (the segment then goes back to its worker from
        the copy thread)."""
        key = (handle.worker, handle.segment)
        copying: Copying | None = None
        t0 = _trace.on and _trace.now()
        if isinstance(memory, SplitBatch):
            memory.copy_in(cache, key)
        elif route.copy == BACKGROUND:
            copying = cache.copy(key, memory, [(0, 0, need)], then_hand_back=True)
        elif isinstance(memory, Slot):
            cache.copy(key, memory, [(0, 0, need)])
        elif memory is not None:
            cache.copy(key, memory.numpy(), [(0, 0, need)])
        if t0 and memory is not None:
            how = "background" if copying is not None else _COPIED_INTO.get(type(memory), "buffer")
            _trace.span("batch.copy", t0, nbytes=need, how=how)
        return copying

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
        route = self._route(memory, p.nbytes, ahead=False, local=True)
        return self._deliver(p.tree, p.specs, memory, p.nbytes, route)

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
