"""The main process's side of one loader: where each batch handle from a worker is taken.

One path for every batch (:meth:`Receiver.take`):

1. **Its memory.** A batch written into a zero-copy slot adopts that slot
   (``tickets.Tickets.adopt``); a batch in a worker's segment gets a slot checked out
   (``PinPool.claim``: the rules in Rust, waiting without the GIL) and is copied in by the
   segment cache's copy threads, without the GIL. The first time a segment is seen it is
   opened through ``/proc/<worker pid>/fd`` and checked to be real (sealed, as long as
   claimed, its header intact) before its claims size the pool. On torch's pin thread, a
   batch that stays on the CPU is copied in the background: the pin thread goes on to the
   next batch, the copy thread hands the segment back, and the consumer's thread waits for
   the copy (``delivery.Landing``) before it yields the batch.
2. **Its delivery** (``delivery.Delivery``): CPU views into the slot, or a copy on the device.

The segment is then handed back to its worker; nothing is unmapped per batch (retired
segments are unmapped on the Rust reclaimer thread).

Invariants: every field of a handle is checked before it is used; a handle is taken or
dropped at most once (its ``_state`` goes to 0), and a taken or dropped handle's segment is
handed back and its unused slot taken back, whatever fails on the way; the pool is made once,
at the first batch (or at once when its sizes are known).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any, cast

import torch

from .. import _trace
from .._errors import BatchTooLarge, OutOfBounds, PinPoolError, PoolExhausted, WorkerLost
from .._native import (
    SEGMENT_DATA_OFFSET,
    PinPool,
    SegmentCache,
    Sent,
    Slot,
    check_segment,
    cuda_available,
)
from .._stats import LoaderStats
from .._wire import codec, peer
from .._wire.handle import ARRIVED, HELD, BatchHandle, SlotTicket
from .._wire.pool_hint import PoolHint
from .delivery import Delivery, Landing, Local
from .sizing import Plan, Sizing, room_kept, ticket_bytes
from .tickets import Tickets

_log = logging.getLogger("pinpool")


class _Later:
    """What the pin thread gets instead of a slot: decode this batch in the consumer's turn."""


_LATER = _Later()


class _Send:
    """A segment's batch to be copied into its slot and on to the device in one call."""

    __slots__ = ("cache", "key")

    def __init__(self, cache: SegmentCache, key: tuple[int, int]) -> None:
        self.cache, self.key = cache, key

    def __call__(
        self, slot: Slot, target: torch.Tensor, need: int, stream: torch.cuda.Stream
    ) -> Sent:
        return self.cache.copy_to_device(self.key, slot, [(0, 0, need)], target, need, stream)


class Receiver:
    """The pool, the segment cache, the zero-copy tickets and the delivery of one loader."""

    def __init__(
        self,
        token: str,
        *,
        pool: PinPool | None,
        sizing: Sizing,
        pool_device: int | None,
        device: torch.device | None,
        copy_threads: int | None,
        slot_timeout: float | None,
        overflow: str,
        oversize: str,
        pool_hint: PoolHint | None = None,
    ) -> None:
        self.token = token
        #: Where a worker tells the first batch's size early (None: the pool's size is known).
        self.pool_hint = pool_hint
        self.pid = os.getpid()  # finalizers run in a forked child do nothing
        self._overflow = overflow
        self._oversize = oversize
        self.overflow_batches = 0
        self.zero_copy_batches = 0
        self.tickets = Tickets()
        self.deliver = Delivery(device)
        # Worker key -> pid, for the workers whose segments are mapped here.
        self._worker_pids: dict[int, int] = {}
        self._lock = threading.Lock()
        self._own_pool = pool is None
        #: Set by :meth:`close`: no segment is opened after it (nothing would retire it).
        self.closed = False
        self.pool = pool
        self.cache: SegmentCache | None = None
        self.sizing = sizing
        #: The pool's plan once it is made (None for a pool given by the caller).
        self.plan: Plan | None = None
        #: The pool was made from a worker's hint, and no real batch has arrived since.
        self._provisional = False
        #: The largest batch seen so far, in bytes, and the last few batches' sizes (zero-copy
        #: tickets and the room claims ahead leave are sized from them).
        self.largest_seen = 0
        self._recent: collections.deque[int] = collections.deque(maxlen=32)
        self._pool_device = pool_device
        self._copy_threads = copy_threads
        self._slot_timeout = slot_timeout
        #: The loader's current torch iterator (a weak reference), set and used by the loader.
        self.iterator: Any = None

    # -- the pool ---------------------------------------------------------------------------

    def ensure(self, nbytes: int, hinted: bool = False) -> tuple[PinPool, SegmentCache]:
        """The pool and segment cache, made on first use, sized for a first batch of
        ``nbytes`` (see ``sizing``).

        A pool made from a worker's hint (``hinted``) is provisional until a real batch, whose
        bytes a checked segment or this process backs, arrives: if the hint was wrong (the
        real batch larger than the pool takes, or the pool more than twice what the real
        batch would have made) and nothing has used the pool yet, it is made again from the
        real batch. A hint speeds the first batch up; it cannot fail it, nor keep an arena
        its batches do not need."""
        pool, cache = self.pool, self.cache
        if pool is not None and cache is not None and not self._provisional:
            return pool, cache  # made already: no lock needed
        if _trace.on:
            _trace.event("pool.ensure", nbytes=nbytes, hinted=hinted)
        with self._lock:
            if self._provisional and not hinted:
                self._provisional = False
                self._replace_if_wrong(nbytes)
            if self.pool is None:
                plan = self.sizing.plan(nbytes)
                t0 = _trace.on and _trace.now()
                self.pool = PinPool(
                    plan.largest,
                    plan.entries,
                    # (None: torch sees no CUDA device, so neither does the pool.)
                    device="cpu" if self._pool_device is None else self._pool_device,
                    copy_threads=self._copy_threads,
                    background=background_arena(self._pool_device),
                    arena_bytes=plan.arena,
                )
                if t0:
                    _trace.span(
                        "pool.make", t0, **_made(self.pool, nbytes, hinted, self._pool_device)
                    )
                self.plan = plan
                self._provisional = hinted
                if nbytes > 0 and not hinted:
                    self._seen(nbytes)
                _log.info(
                    "made the loader's pool at its first batch (%d bytes): an arena of %d "
                    "bytes for batches of up to %d bytes, %s memory (%s), %d copy threads",
                    nbytes,
                    self.pool.arena_bytes,
                    self.pool.largest_slot,
                    self.pool.memory,
                    self.pool.backend,
                    self.pool.copy_threads,
                )
            if self.cache is None:
                self.cache = SegmentCache(self.pool)
            return self.pool, self.cache

    def _replace_if_wrong(self, nbytes: int) -> None:
        """Drops a pool made from a hint that the first real batch, of ``nbytes``, shows
        wrong, if nothing has used it (see :meth:`ensure`). Called under the lock."""
        pool, plan = self.pool, self.plan
        if pool is None or plan is None or not self._own_pool:
            return
        real = self.sizing.plan(nbytes)
        if plan.largest >= nbytes and plan.arena <= 2 * real.arena:
            return  # right, or near enough
        if pool.stats()["checkouts"] or (self.cache is not None and len(self.cache)):
            return  # used already: it stays
        _log.warning(
            "a worker announced batches of a size the first batch did not have: the pool made "
            "ahead (%d bytes, batches of up to %d) is made again for the real one (%d bytes)",
            plan.arena,
            plan.largest,
            nbytes,
        )
        pool.close()
        self.pool = self.cache = self.plan = None

    @property
    def max_batch(self) -> int:
        """The largest batch the pool takes (0 before it exists)."""
        if self.plan is not None:
            return self.plan.largest
        return self.pool.largest_slot if self.pool is not None else 0

    def make_pool_ahead(self) -> None:
        """Has the pool made as soon as a worker tells the first batch's size, while that
        batch is still being made (``_wire.pool_hint``); a no-op once it exists."""
        if self.pool_hint is not None and self.pool is None:
            self.pool_hint.watch(self._ensure_hinted, lambda: self.pool is None and not self.closed)

    def _ensure_hinted(self, nbytes: int, count: int) -> None:
        del count  # (sized from the bytes announced, never scaled by a sample count)
        with self._lock:
            if self.closed or self.pool is not None or nbytes <= 0:
                return  # (a batch without arrays needs no pool)
        self.ensure(nbytes, hinted=True)
        if self.closed and self.pool is not None and self._own_pool:
            self.pool.close()  # (closed while it was being made)

    # -- a batch from a worker --------------------------------------------------------------

    def take(self, handle: BatchHandle, ahead: bool) -> Any:
        """The handle's batch, delivered; or, with ``ahead``, the handle itself when no slot
        is at hand now.

        ``ahead``: called by torch's pin thread, which takes batches as they arrive, ahead of
        the consumer and in any order. It never waits for a slot that only the consumer can
        give back, nor decides on overflow: when every slot is held by a batch, the handle
        itself is returned, and the consumer's thread takes it when it reaches that batch,
        in order (the same rules as on a machine without an accelerator). Nor does it wait
        for a copy into a slot whose batch stays on the CPU: it returns a
        :class:`~pinpool._main.delivery.Landing`, which the consumer's thread waits for.

        A batch for the device whose slot the driver pinned is copied into the slot and on
        to the device in one call without the GIL (``SegmentCache.copy_to_device``), as it is
        delivered; its segment goes back after that."""
        if not handle._state:
            raise PinPoolError("this batch handle was taken or dropped already")
        pending = None
        if handle.slot is None and handle.segment is None and handle.worker is None:
            return self._inline(handle)
        try:
            if handle.slot is not None:
                t0 = _trace.on and _trace.now()
                memory, specs, need = self._adopt(handle)
                if t0:
                    _trace.span("batch.adopt", t0, nbytes=need)
            else:
                got = self._copy_in(handle, ahead)
                if got is _LATER:
                    return handle
                memory, specs, need, pending = got
        except BaseException:
            self.drop(handle)
            raise
        if isinstance(pending, _Send):
            try:
                return self.deliver.send(handle.tree, specs, memory, need, pending)
            finally:
                self.drop(handle)
        self.drop(handle, handed_back=pending is not None)
        t0 = _trace.on and _trace.now()
        batch = self.deliver(handle.tree, specs, memory, need)
        if t0:
            _trace.span("batch.deliver", t0, nbytes=need)
        return batch if pending is None else Landing(batch, pending)

    def _inline(self, handle: BatchHandle) -> Any:
        """A batch without arrays, carried whole by its handle: no memory, no pool."""
        handle._state = 0
        if handle.specs:
            raise OutOfBounds("corrupt batch handle: arrays, but no slot nor segment")
        return self.deliver(handle.tree, [], None, 0)

    def _adopt(self, handle: BatchHandle) -> tuple[Slot | None, list[codec.LeafSpec], int]:
        """Zero-copy: the slot the worker wrote the batch into, checked."""
        if handle.segment is not None or handle.worker is not None:
            raise OutOfBounds("corrupt batch handle: it names both a slot and a segment")
        slot = self.tickets.adopt(handle.slot)
        specs = codec.checked_specs(handle.specs, slot.nbytes)
        need = codec.extent(specs)
        self._seen(need)
        self.zero_copy_batches += 1
        if need == 0:
            slot.release()
            return None, specs, 0
        return slot, specs, need

    def _copy_in(self, handle: BatchHandle, ahead: bool) -> Any:
        """Copy mode: a slot (or an ordinary buffer) with the segment's batch copied in;
        or still being copied in (then also its :class:`~pinpool._native.Copying`, and the
        segment goes back to its worker from the copy thread); or to be copied in as it is
        sent to the device (then also a :class:`_Send`); or :data:`_LATER`."""
        if handle._state == ARRIVED:
            self._receive(handle)
        pool, cache = self.ensure(int(handle.nbytes))
        limit = int(handle.total_len) - SEGMENT_DATA_OFFSET
        specs = codec.checked_specs(handle.specs, limit)
        need = codec.extent(specs)
        memory = self._claim(pool, need, ahead) if need else None
        if memory is _LATER:
            return _LATER
        key = (handle.worker, handle.segment)
        pending: Any = None
        t0 = _trace.on and _trace.now()
        if isinstance(memory, Slot):
            if self.deliver.device is not None and memory.device is not None:
                pending = _Send(cache, key)  # (Delivery.send calls it)
            elif ahead and self.deliver.device is None:
                # The pin thread goes on to the next batch; the consumer waits (see Landing).
                pending = cache.copy_to_slot_then_release(key, memory, [(0, 0, need)])
            else:
                cache.copy_to_slot(key, memory, [(0, 0, need)])
        elif memory is not None:
            cache.copy_to_buffer(key, memory.numpy(), [(0, 0, need)])
        if t0 and memory is not None:
            _trace.span("batch.copy", t0, nbytes=need, how=_copy_how(memory, pending))
        return memory, specs, need, pending

    def _receive(self, handle: BatchHandle) -> None:
        """Checks the handle's segment fields and takes hold of its segment (opening and
        mapping it the first time it is seen)."""
        t0 = _trace.on and _trace.now()
        try:
            worker, segment = int(handle.worker), int(handle.segment)
            total_len, nonce = int(handle.total_len), int(handle.nonce)
            nbytes = int(handle.nbytes)
            count = None if handle.count is None else int(handle.count)
            first = handle.origin is not None
            pid, fd = (int(x) for x in handle.origin) if first else (0, 0)
            retired = tuple(int(sid) for sid in handle.retired)
            unused = None if handle.unused is None else tuple(int(x) for x in handle.unused)
        except (TypeError, ValueError, OverflowError) as exc:
            raise OutOfBounds(f"corrupt batch handle: {exc}") from None
        if self.closed:
            raise PinPoolError("the loader was closed: its batches can no longer be taken")
        if not (
            0 <= worker < 1 << 64
            and 0 <= segment < 1 << 32
            and SEGMENT_DATA_OFFSET < total_len
            and 0 <= nonce < 1 << 64
            and 0 <= nbytes <= total_len - SEGMENT_DATA_OFFSET
            and (count is None or count > 0)  # (a dataset's __getitems__ may make more)
            and (not first or (0 < pid < 1 << 31 and 0 <= fd < 1 << 31))
            and all(0 <= sid < 1 << 32 for sid in retired)
            and (unused is None or (len(unused) == 3 and all(0 <= x < 1 << 64 for x in unused)))
        ):
            raise OutOfBounds("corrupt batch handle: a field is out of range")
        # What the rest of the handle's life uses: checked values, not what was sent.
        handle.worker, handle.segment, handle.retired, handle.unused = (
            worker,
            segment,
            retired,
            unused,
        )
        handle.total_len, handle.nbytes, handle.count = total_len, nbytes, count
        key = (worker, segment)
        if not first:
            # A segment mapped before: the pool exists, and copies are checked against the
            # real mapping, whatever the handle claims.
            if self.cache is None or key not in self.cache:
                raise PinPoolError(f"segment {key} was never received by this process")
            handle._state = HELD
            if t0:
                _trace.span("batch.receive", t0, first=False)
            return
        try:
            own = peer.open_fd_of(pid, fd)
        except OSError as exc:
            if exc.errno in peer.OUT_OF_FDS:  # not a dead worker: say what to raise
                raise peer.out_of_fds(exc, pid) from None
            if not peer.alive(pid):
                raise WorkerLost(
                    f"DataLoader worker (pid {pid}) exited before the main process could "
                    "take its batch"
                ) from None
            raise OutOfBounds(f"corrupt batch handle: cannot open its segment: {exc}") from None
        try:
            # The segment is checked to be real before its claims size the pool.
            check_segment(key, own, total_len, nonce)
            _, cache = self.ensure(nbytes)
        except BaseException:
            os.close(own)
            raise
        cache.insert(key, own, total_len, nonce)  # owns the fd from here
        self._worker_pids[worker] = pid
        handle._state = HELD
        if t0:
            _trace.span("batch.receive", t0, first=True)

    def receive_now(self, handle: BatchHandle) -> None:
        """Takes hold of a copy-mode handle's segment as the handle arrives, ahead of taking
        its batch (its worker may exit or die before the consumer reaches it). pinpool's own
        error is left for :meth:`take` to raise, in turn (the handle stays as it came); any
        other exception (one a signal handler raised here: see ``pinpool._signals``) goes on
        at once."""
        if handle._state == ARRIVED and handle.slot is None and handle.segment is not None:
            try:
                self._receive(handle)
            except PinPoolError:
                pass

    def drop(self, handle: BatchHandle, handed_back: bool = False) -> None:
        """Ends the handle's life here: hands its segment back to its worker (unless a copy
        thread does, ``handed_back``), drops what the worker retired, takes back a zero-copy
        slot the batch did not use."""
        state, handle._state = handle._state, 0
        if not state:
            return
        if handle.slot is not None:
            self.tickets.unassign(handle.slot)  # (only if not adopted)
            return
        if state == ARRIVED:
            try:
                self._receive(handle)  # a segment first seen here must still go back
            except PinPoolError:
                return  # a corrupt handle, or a worker gone: nothing of it is held here
            handle._state = 0
        cache = self.cache
        if cache is None:
            return
        try:
            if not handed_back:
                cache.release((handle.worker, handle.segment))
        except PinPoolError:
            pass  # already retired with the whole worker
        for sid in handle.retired:
            cache.retire((handle.worker, sid))
        if handle.unused is not None:
            # A zero-copy batch too large for its ticket came through a segment instead.
            self.tickets.too_small += 1
            self.tickets.unassign(handle.unused)

    # -- a batch collated here (num_workers=0) ----------------------------------------------

    def encode_local(self, batch: Any, count: int | None, threads: int = 1) -> Local:
        """Writes a batch collated (or received) in this process straight into a slot, its
        arrays of at least ``codec.GATHER_MIN`` bytes by ``threads`` copy threads without the
        GIL. A batch without arrays makes no pool (the first batch with arrays sizes it)."""
        p = codec.plan(batch, keep_strides=True)  # torch's pin_memory keeps each layout
        if not p.specs:
            return Local(self.deliver(p.tree, p.specs, None, 0))
        del count  # (sized from the bytes, never scaled by a sample count)
        pool, _ = self.ensure(p.nbytes)
        memory = self._claim(pool, p.nbytes) if p.nbytes else None
        t0 = _trace.on and _trace.now()
        if memory is not None:
            codec.write(p, memory, threads)
        if t0 and memory is not None:
            _trace.span("batch.copy", t0, nbytes=p.nbytes, how="local")
        return Local(self.deliver(p.tree, p.specs, memory, p.nbytes))

    # -- slots --------------------------------------------------------------------------------

    def _claim(self, pool: PinPool, need: int, ahead: bool = False) -> Any:
        """A slot of ``need`` bytes, or (by the overflow rules) an ordinary buffer. The rules
        are applied in Rust (``PinPool.claim``), which waits without the GIL.

        With ``ahead`` (torch's pin thread, taking a batch the consumer may not want yet),
        the slot must leave room for another batch as large as the largest seen (that room
        is kept for the batch the consumer waits for, which may still be on its way), and
        nothing waits for the consumer: it returns :data:`_LATER` instead of waiting,
        overflowing or raising."""
        largest = self.max_batch or pool.largest_slot
        if need > largest:
            if ahead:
                return _LATER  # the error or the ordinary buffer belongs to this batch's turn
            if self._oversize == "copy":
                return self._overflow_buffer(need)
            raise BatchTooLarge(
                f"a batch needs {need} bytes but the loader's arena takes batches of up to "
                f"{largest} bytes; pass {self.sizing.setting_names()} (at least {need}) to "
                "pinpool.DataLoader, or oversize='copy' to put such batches in ordinary memory",
                need,
                largest,
            )
        reserve = room_kept(max(self.largest_seen, need), pool.arena_bytes) if ahead else 0
        t0 = _trace.on and _trace.now()
        try:
            got = pool.claim(
                need,
                reserve=reserve,
                timeout=self._slot_timeout,
                overflow=self._overflow == "copy" and not ahead,
                defer=ahead,
            )
        except PoolExhausted:
            raise PoolExhausted(
                f"no room for a batch of {need} bytes after {self._slot_timeout} s: the "
                f"arena ({pool.arena_bytes} bytes) is held by batches that are still alive; "
                "keep fewer batches, or pass arena_bytes= to pinpool.DataLoader"
            ) from None
        if t0:
            _trace.span("slot.claim", t0, nbytes=need, ahead=ahead, got=_claimed(got))
        if got == "later":
            return _LATER  # (seen in its turn)
        self._seen(need)
        if got == "overflow":
            # Every byte is held by batches the consumer keeps alive: waiting could wait
            # forever (list(loader) does this). Use ordinary memory for this one.
            return self._overflow_buffer(need)
        return got

    def _seen(self, need: int) -> None:
        self.largest_seen = max(self.largest_seen, need)
        self._recent.append(need)

    def assign_ticket(self, owner: int) -> SlotTicket | None:
        """A zero-copy ticket for the next batch of sampler ``owner``, sized from the last
        few batches (``sizing.ticket_bytes``), leaving room for batches that come through
        copy mode (``sizing.room_kept``); None sends the batch through copy mode."""
        pool = self.pool
        if pool is None:
            return self.tickets.assign(None, owner, 0, 0)
        arena = pool.arena_bytes
        if self.sizing.slot_bytes is not None:
            size = self.max_batch  # equal slots (slot_bytes=): a ticket is one
        else:
            # Most of the recent batches fit (three in four): a long tail's rare giants go
            # through copy mode rather than make every ticket giant. None seen yet: the
            # largest, as far as the share allows.
            ordered = sorted(self._recent) or [self.max_batch]
            recent = ordered[len(ordered) * 3 // 4]
            size = ticket_bytes(recent, self.max_batch, arena, self.sizing.in_flight)
        # (Never no reserve: the last entry and some bytes stay for copy-mode batches.)
        reserve = max(1, room_kept(self.largest_seen, arena))
        t0 = _trace.on and _trace.now()
        ticket = self.tickets.assign(pool, owner, size, reserve)
        if t0:
            _trace.span("ticket.assign", t0, nbytes=size, got=ticket is not None)
        return ticket

    def _overflow_buffer(self, need: int) -> torch.Tensor:
        self.overflow_batches += 1
        if self.overflow_batches == 1:
            _log.warning(
                "a batch did not get a pinned slot and went into ordinary memory; see "
                "DataLoader(overflow=..., oversize=..., arena_bytes=..., max_batch_bytes=...)"
            )
        return torch.empty(need, dtype=torch.uint8)

    # -- the end ------------------------------------------------------------------------------

    def retire_segments(self, dead_only: bool = False) -> None:
        """Unmaps (on the reclaimer thread) the segments of workers that have exited (of every
        worker with ``dead_only=False``)."""
        if self.cache is None:
            return
        if not dead_only:
            self.cache.retire_all()
            self._worker_pids.clear()
            return
        for worker, pid in list(self._worker_pids.items()):
            if not peer.alive(pid):
                self.cache.retire_all(worker)
                del self._worker_pids[worker]

    def close(self) -> None:
        """Takes back every zero-copy slot, retires every segment and closes the pool if it
        is the loader's own. The loader shuts its workers down first: none may write into a
        slot taken back here."""
        if self.pid != os.getpid():
            return
        t0 = _trace.on and _trace.now()
        with self._lock:  # (a pool being made ahead is made first)
            self.closed = True
        if self.pool_hint is not None:
            self.pool_hint.close()
        self.tickets.drop()
        self.retire_segments()
        if self.pool is not None and self._own_pool:
            # Returns at once: segments are unmapped, and the arena is freed, on background
            # threads (see wait_for_releases).
            self.pool.close()
        if t0:
            _trace.span("loader.close", t0)

    def stats(self) -> LoaderStats:
        """The pool's counters (once it exists) plus the loader's own."""
        out: dict[str, Any] = dict(self.pool.stats()) if self.pool is not None else {}
        out["batches"] = self.deliver.batches
        out["bytes"] = self.deliver.bytes
        out["overflow_batches"] = self.overflow_batches
        out["zero_copy_batches"] = self.zero_copy_batches
        out["zero_copy_fallbacks"] = self.tickets.fallbacks + self.tickets.too_small
        out["zero_copy_no_ticket"] = self.tickets.fallbacks
        out["zero_copy_ticket_too_small"] = self.tickets.too_small
        out["segments_cached"] = len(self.cache) if self.cache is not None else 0
        return cast(LoaderStats, out)


def background_arena(device: int | None) -> bool:
    """Whether the loader's arena is made ready in the background (the first 16 MiB, at
    least one part, at once, the rest while the first batches flow) or whole before the
    first batch is delivered.

    Whole, wherever the arena is pinned through the CUDA driver: registering the rest while
    batches flow contends with the copies for the driver, stalling the main thread and
    cutting throughput, while the whole arena is ready by the first batch anyway. In the
    background where there is no driver to contend with (host memory): there it shortens the
    time to the first batch. (The figures: ``docs/performance.md``, "Measurements behind the
    code".)"""
    return device is None or not cuda_available()


def _made(pool: PinPool, nbytes: int, hinted: bool, device: int | None) -> dict[str, Any]:
    """The ``pool.make`` event's details (see ``pinpool._trace.EVENTS``)."""
    return {
        "nbytes": nbytes,
        "hinted": hinted,
        "arena_bytes": pool.arena_bytes,
        "largest": pool.largest_slot,
        "background": background_arena(device),
    }


def _claimed(got: Any) -> str:
    """The ``slot.claim`` event's ``got``: ``"slot"``, ``"later"`` or ``"overflow"``."""
    return got if isinstance(got, str) else "slot"


def _copy_how(memory: Any, pending: Any) -> str:
    """The ``batch.copy`` event's ``how`` (see ``pinpool._trace.EVENTS``)."""
    if isinstance(pending, _Send):
        return "device"
    if pending is not None:
        return "background"
    return "slot" if isinstance(memory, Slot) else "buffer"
