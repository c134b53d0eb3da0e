"""A loader's pool, made lazily: sized and made once (at the first batch, from a worker's hint,
or at once when its sizes are known), replaced only if a hint turns out wrong, and the claims
made on it.

:meth:`LazyPool.pool_for` is the one place a loader's :class:`~pinpool._native.PinPool` is
made (sized by ``sizing``), with its :class:`~pinpool._native.SegmentCache`.
:meth:`LazyPool.claim` checks a slot out of it by the overflow and oversize rules (in Rust,
waiting without the GIL), or hands out an ordinary buffer (an overflow, counted). A zero-copy
loader's grants come from the pool once it is made.

Invariants: the pool is made once, under the lock, and never grown; a pool made from a hint
is provisional until a real batch arrives, and is made again from that batch only if the hint
was wrong and nothing has used it (a hint speeds the first batch up, it can neither fail it
nor keep an arena its batches do not need); no pool is made after :meth:`LazyPool.close`, and
a pool of the caller's is never closed here; what sizes a pool is bytes that arrived (or were
announced), never scaled by a sample count.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from ... import _trace
from ..._errors import BatchTooLarge, PoolExhausted
from ..._native import PinPool, SegmentCache, cuda_available, room_kept
from ..._wire.codec import LeafSpec
from ..._wire.pool_hint import PoolHint
from ..settings.pool_settings import PoolSettings
from ..settings.sizing import ArenaPlan
from . import notices
from .grants import LoaderGrants
from .split_batch import SplitBatch

_log = logging.getLogger("pinpool")


class _TakeInTurn:
    """What a claim made ahead of the consumer gets instead of a slot: the batch is to be
    taken in its turn, on the consumer's thread."""


#: See :class:`_TakeInTurn`.
TAKE_IN_TURN = _TakeInTurn()


class LazyPool:
    """The pool and segment cache of one loader, made on first use, and its claims."""

    def __init__(
        self,
        settings: PoolSettings,
        pool_hint: PoolHint | None = None,
        grants: LoaderGrants | None = None,
    ) -> None:
        self.settings = settings
        self.grants = grants
        self.sizing = settings.sizing
        #: Where a worker tells the first batch's size early (None: the pool's size is known).
        self.pool_hint = pool_hint
        self._lock = threading.Lock()
        self._own_pool = settings.pool is None
        #: Set by :meth:`close`: no pool is made after it.
        self.closed = False
        self.pool = settings.pool
        self.cache: SegmentCache | None = None
        #: The pool's plan once it is made (None for a pool given by the caller).
        self.plan: ArenaPlan | None = None
        #: The pool was made from a worker's hint, and no real batch has arrived since.
        self._provisional = False
        #: The largest batch seen so far, in bytes (the room claims ahead leave is sized from
        #: it).
        self.largest_seen = 0
        self.overflow_batches = 0
        #: Batches the consumer waited for that no one free range held, in pieces instead.
        self.split_batches = 0
        #: Batches larger than the arena takes, given memory of their own.
        self.oversize_batches = 0
        #: How many batches the loader holds in slots ahead of the consumer (taken ahead, not
        #: yet handed over): set by the receiver, which knows.
        self.batches_ahead: Callable[[], int] = lambda: 0

    # -- making the pool ----------------------------------------------------------------------

    def pool_for(self, nbytes: int, hinted: bool = False) -> tuple[PinPool, SegmentCache]:
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
                device = self.settings.pool_device
                as_needed = ready_as_needed(device)
                t0 = _trace.on and _trace.now()
                self.pool = PinPool(
                    plan.largest,
                    plan.entries,
                    # (None: torch sees no CUDA device, so neither does the pool.)
                    device="cpu" if device is None else device,
                    copy_threads=self.settings.copy_threads,
                    background=as_needed,
                    arena_bytes=plan.arena,
                    ready_first=plan.ready_first,
                )
                if t0:
                    _trace.span("pool.make", t0, **_made(self.pool, nbytes, hinted, as_needed))
                self.plan = plan
                self._provisional = hinted
                if nbytes > 0 and not hinted:
                    self.seen(nbytes)
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
                if self.grants is not None:
                    self.grants.use_pool(self.pool, self.max_batch)
            return self.pool, self.cache

    def _replace_if_wrong(self, nbytes: int) -> None:
        """Drops a pool made from a hint that the first real batch, of ``nbytes``, shows
        wrong, if nothing has used it (see :meth:`pool_for`). Called under the lock."""
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
        """The largest batch the pool takes, in bytes, exactly (0 before it exists): the
        size given (``max_batch_bytes=``, ``slot_bytes=``, a pool of the caller's
        ``slot_bytes``), else the largest slot of the arena."""
        if self.plan is not None:
            return self.plan.largest_batch
        return self.pool.slot_bytes if self.pool is not None else 0

    def make_from_first_hint(self) -> None:
        """Has the pool made as soon as a worker tells the first batch's size, while that
        batch is still being made (``_wire.pool_hint``); a no-op once it exists."""
        if self.pool_hint is not None and self.pool is None:
            if self.grants is not None:
                # The workers' first requests wait for the pool their hints make.
                self.grants.pool_coming(True)
            self.pool_hint.watch(self.make_from_hint, lambda: self.pool is None and not self.closed)

    def make_from_hint(self, nbytes: int, count: int) -> None:
        """The pool hint's callback: the pool, made for a first batch of ``nbytes``."""
        del count  # (sized from the bytes announced, never scaled by a sample count)
        try:
            with self._lock:
                if self.closed or self.pool is not None or nbytes <= 0:
                    return  # (a batch without arrays needs no pool)
            self.pool_for(nbytes, hinted=True)
            if self.closed and self.pool is not None and self._own_pool:
                self.pool.close()  # (closed while it was being made)
        finally:
            if self.pool is None and self.grants is not None:
                self.grants.pool_coming(False)  # (none made: the workers' requests go on)

    # -- claims on it -------------------------------------------------------------------------

    def claim(
        self, pool: PinPool, need: int, ahead: bool = False, specs: list[LeafSpec] | None = None
    ) -> Any:
        """A slot of ``need`` bytes, or (by the overflow rules) an ordinary buffer. The rules
        are applied in Rust (``PinPool.claim``), which waits without the GIL. Where the
        rules would overflow and the batch's leaves (``specs``) are given, the batch goes to
        several slots if the free ranges hold its leaves
        (:class:`~pinpool._main.route.split_batch.SplitBatch`).

        With ``ahead`` (torch's pin thread, taking a batch the consumer may not want yet),
        the slot must leave room for another batch as large as the largest seen (that room
        is kept for the batch the consumer waits for, which may still be on its way), and
        nothing waits for the consumer: it returns :data:`TAKE_IN_TURN` instead of waiting,
        overflowing or raising."""
        largest = self.max_batch or pool.largest_slot
        timeout = self.settings.slot_timeout
        if need > largest:
            if ahead:
                return TAKE_IN_TURN  # the error or the buffer of its own belongs to its turn
            if self.settings.oversize != "error":
                return self.oversize_buffer(need, largest)
            raise BatchTooLarge(
                f"a batch needs {need} bytes but the loader's arena takes batches of up to "
                f"{largest} bytes; it takes {self.sizing.setting_to_take(need)}, or leave "
                "oversize= at 'pin' to give such batches pinned memory of their own",
                need,
                largest,
            )
        seen = max(self.largest_seen, need)
        reserve = room_kept(seen, pool.arena_bytes, pool.largest_slot) if ahead else 0
        t0 = _trace.on and _trace.now()
        try:
            got = pool.claim(
                need,
                reserve=reserve,
                timeout=timeout,
                overflow=self.settings.overflow == "copy" and not ahead,
                defer=ahead,
            )
        except PoolExhausted:
            raise PoolExhausted(
                f"no room for a batch of {need} bytes after {timeout} s in the loader's arena "
                f"({pool.arena_bytes} bytes): {self.who_holds(pool)}; keep fewer batches, or "
                "pass arena_bytes= to pinpool.DataLoader"
            ) from None
        if t0:
            _trace.span("slot.claim", t0, nbytes=need, ahead=ahead, got=_claimed(got))
        if got == "later":
            return TAKE_IN_TURN  # (seen in its turn)
        self.seen(need)
        if got == "overflow":
            # No free range holds it, and none will before the consumer takes it: batches it
            # keeps alive (list(loader) does this), or batches taken for later turns, hold
            # the rest. Waiting could wait forever: the free ranges, else ordinary memory.
            pieces = SplitBatch.claimed(pool, specs, need) if specs else None
            if pieces is not None:
                self.split_batches += 1
                return pieces
            return self.overflow_buffer(need, pool)
        return got

    def who_holds(self, pool: PinPool) -> str:
        """Who holds the arena's room now: the batches the consumer holds, apart from those the
        loader holds (taken ahead of the consumer, granted to workers) and fenced slots."""
        s = pool.stats()
        ahead = self.batches_ahead()
        granted = self.grants.outstanding if self.grants is not None else 0
        yours = max(0, s["slots_checked_out"] - ahead - granted)
        return (
            f"{yours} batches you hold and {ahead + granted} the loader holds ({ahead} taken "
            f"ahead of you, {granted} granted to workers) have {s['bytes_checked_out']} bytes "
            f"checked out, {s['bytes_fenced']} wait for their fences, {s['largest_free']} are "
            "free in one range"
        )

    def seen(self, need: int) -> None:
        """A batch of ``need`` bytes arrived."""
        if need > self.largest_seen:
            self.largest_seen = need

    def oversize_buffer(self, need: int, largest: int) -> torch.Tensor:
        """Memory of its own for a batch larger than the arena takes: pinned by torch's caching
        host allocator (``oversize="pin"``, where there is a CUDA device), else ordinary
        memory; counted, warned about once with the setting that would keep it in the arena."""
        self.oversize_batches += 1
        pinned = self.settings.oversize == "pin" and self.settings.pool_device is not None
        if self.oversize_batches == 1:
            notices.queue(
                f"pinpool: a batch of {need} bytes is larger than the largest the loader's "
                f"arena takes ({largest}): it went to {'pinned' if pinned else 'ordinary'} "
                "memory of its own, outside the arena; to keep such batches in the arena, it "
                f"takes {self.sizing.setting_to_take(need)} (warned once per loader; "
                "stats()['oversize_batches'] counts them)"
            )
        return torch.empty(need, dtype=torch.uint8, pin_memory=pinned)

    def overflow_buffer(self, need: int, pool: PinPool) -> torch.Tensor:
        """Ordinary memory for a batch that gets no slot (counted, warned about once)."""
        self.overflow_batches += 1
        if self.overflow_batches == 1:
            notices.queue(
                f"pinpool: a batch of {need} bytes found no free range in the loader's arena "
                f"and went into ordinary memory, outside it ({self.who_holds(pool)}); see "
                "DataLoader(arena_bytes=..., overflow=...) (warned once per loader; "
                "stats()['overflow_batches'] counts them)"
            )
        return torch.empty(need, dtype=torch.uint8)

    # -- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        """No pool is made from now on (one being made ahead is made first, and closed by
        :meth:`make_from_hint`), and the hint's thread stops."""
        with self._lock:  # (a pool being made ahead is made first)
            self.closed = True
        if self.pool_hint is not None:
            self.pool_hint.close()

    def close_pool(self) -> None:
        """Closes the pool if it is the loader's own (after :meth:`close` and whatever the
        receiver must take back first). Returns at once: the arena is freed on a background
        thread, once the last batch that views it dies."""
        if self.pool is not None and self._own_pool:
            self.pool.close()


def ready_as_needed(device: int | None) -> bool:
    """Whether the loader's arena is made ready as claims need it (the first batches' room at
    once, ``ArenaPlan.ready_first``, the rest part by part when a claim finds no room) or
    whole before the first batch is delivered.

    As needed on host memory: the first batch waits only for its own room, and a dataset of
    small batches locks only the room they use, not the arena's floor. Whole wherever the
    arena is pinned through the CUDA driver: registering a part while batches flow holds the
    driver, and the copies and the main thread's CUDA calls wait for it (made ready in the
    background, it stalled the main thread; ``docs/performance.md``, "Measurements behind the
    code"); on demand there it is not measured yet."""
    return device is None or not cuda_available()


def _made(pool: PinPool, nbytes: int, hinted: bool, as_needed: bool) -> dict[str, Any]:
    """The ``pool.make`` event's details (see ``pinpool._trace.EVENTS``)."""
    return {
        "nbytes": nbytes,
        "hinted": hinted,
        "arena_bytes": pool.arena_bytes,
        "largest": pool.largest_slot,
        "as_needed": as_needed,
    }


def _claimed(got: Any) -> str:
    """The ``slot.claim`` event's ``got``: ``"slot"``, ``"later"`` or ``"overflow"``."""
    return got if isinstance(got, str) else "slot"
