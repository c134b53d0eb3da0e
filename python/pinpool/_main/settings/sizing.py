"""How big a loader's arena is, and the largest batch it takes: decided once, when the pool
is made (at the first batch, or when a worker tells that batch's size, or at once when the
sizes were given).

The arena is fixed: allocated once, never grown. Batches of any size up to the largest land
in it, each taking exactly its own bytes (rounded up to a page;
``src/allocation/extents.rs``). Without settings the arena holds the batches in flight
(``prefetch_factor x num_workers``, plus 4) at ``codec.HEADROOM`` (1.25) times the first
batch's size, and at least :data:`MIN_ARENA`, so that a first batch of a few kilobytes does
not leave room only for batches like it (token rows padded to a short first batch, say); the
largest batch is half the arena, at most :data:`LARGEST_DEFAULT` unless the first batch is
larger. In host memory only the first batches' room is made ready (faulted in and locked)
before the first batch, the rest part by part as claims need it, so there the floor costs
address space, not locked memory, where the batches stay small (a CUDA arena is made ready
whole: ``lazy_pool.ready_as_needed``). An arena sized automatically takes
at most :data:`MEMORY_SHARE` of the memory available, divided among the ranks on this host;
past that it is made smaller (down to two of the first batch) rather than refused.

The batches in flight are counted in whole parts: no batch crosses one of the arena's parts,
and a part may be as short as the largest batch, so an arena holds ``batches`` of the first
batch's room only if its largest-batch units, each holding as many as fit in it, hold them.

Settings: ``arena_bytes=`` (the whole arena, to the page) and ``max_batch_bytes=`` (the
largest batch, to the byte). ``slot_bytes=`` with ``num_slots=`` is the older form:
``num_slots`` batches of up to ``slot_bytes`` each (to the byte).

Invariants: an arena given is made as given, rounded up to a page; one sized automatically is
a whole multiple of its largest batch, which is a whole number of pages; the largest batch a
loader takes (``ArenaPlan.limit``) is the bytes given, not rounded; nothing here scales what a batch
or a worker tells (a batch's sample count, a hint) beyond the bytes that arrived.
"""

from __future__ import annotations

import dataclasses
import mmap

from ..._errors import NotEnoughMemory
from ..._native import available_memory
from ..._wire.codec import HEADROOM
from . import arguments

__all__ = ["HEADROOM", "ArenaPlan", "Sizing"]

#: The smallest arena sized automatically.
MIN_ARENA = 64 << 20
#: Where the arena is made ready as claims need it (host memory), the first batch's room is
#: made ready before the first batch is delivered (and each slot taken asks for the room of
#: one more past it: ``Pool::keep_room_ahead``): a first batch does not wait for the whole of
#: :data:`MIN_ARENA`, or for the next batches' room, to be faulted in and locked, and a
#: dataset of small batches locks only the room they use. (The figures: "Measurements behind
#: the code" in ``docs/performance.md``.)
READY_FIRST_BATCHES = 1
#: ... and at least this much.
READY_AT_LEAST = 2 << 20
#: An arena sized automatically may take at most this share of the memory available.
MEMORY_SHARE = 0.5
#: Batches in flight beyond ``prefetch_factor x num_workers``: those the consumer holds.
EXTRA_BATCHES = 4
#: A sized arena has an entry (a slot out or fenced at once) for each this many bytes of it,
#: and at least 64 (but ``num_slots=``, which is exact).
ENTRY_BYTES = 64 << 10
#: The most entries a sized arena has.
MAX_ENTRIES = 1 << 14
#: The default largest batch is half the arena, but at most this much (or the first batch
#: with headroom, if that is larger): the arena's parts are whole multiples of the largest
#: batch, and a big arena in many parts is faulted in and registered with the driver by as
#: many threads at once (in two parts, it is slower to make: docs/performance.md).
LARGEST_DEFAULT = 128 << 20

_PAGE = mmap.PAGESIZE


def _pages(n: int) -> int:
    return max(_PAGE, -(-int(n) // _PAGE) * _PAGE)


def _ready_first(room: int, arena: int) -> int:
    return min(arena, max(READY_AT_LEAST, READY_FIRST_BATCHES * room))


@dataclasses.dataclass(frozen=True)
class ArenaPlan:
    """What a loader's pool is made with: its arena, its largest slot, its entries."""

    #: The largest slot (a whole number of pages): the arena's parts hold whole ones.
    largest: int
    #: The arena's size (a whole number of pages, at least ``largest``).
    arena: int
    #: The most batches out at once.
    entries: int
    #: The largest batch the loader takes, in bytes (``max_batch_bytes=`` or ``slot_bytes=``
    #: as given; else ``largest``).
    limit: int = 0
    #: Where the arena is made ready as claims need it, the bytes ready before the first batch:
    #: :data:`READY_FIRST_BATCHES` of the first batch's room, at least
    #: :data:`READY_AT_LEAST`, at most the arena.
    ready_first: int = 0

    @property
    def largest_batch(self) -> int:
        """The largest batch the loader takes, in bytes."""
        return self.limit or self.largest


@dataclasses.dataclass(frozen=True)
class Sizing:
    """A loader's size settings, as given (checked by ``PoolSettings.checked``)."""

    arena_bytes: int | None = None
    max_batch_bytes: int | None = None
    slot_bytes: int | None = None
    num_slots: int | None = None
    #: Batches in flight at once (``prefetch_factor x num_workers``, or 1).
    in_flight: int = 1

    @property
    def known(self) -> bool:
        """Whether the pool can be made before any batch is seen."""
        return self.slot_bytes is not None or self.arena_bytes is not None

    @property
    def batches(self) -> int:
        """Batches out at once: in flight plus the consumer's."""
        return self.num_slots if self.num_slots is not None else self.in_flight + EXTRA_BATCHES

    def setting_to_take(self, need: int) -> str:
        """What makes the arena take a batch of ``need`` bytes: the setting to pass to
        ``pinpool.DataLoader``, or, where that arena would be over the memory this loader may
        take, that fact."""
        cap = self._memory_cap()
        if cap is not None and 2 * _pages(need) > cap:
            return (
                f"more memory: an arena holding batches of {need} bytes is over "
                f"{self._share_text()} of the memory available ({cap} bytes may be taken)"
            )
        if self.slot_bytes is not None:
            setting = f"slot_bytes={need}"
        elif self.arena_bytes is not None:
            setting = f"max_batch_bytes={need} and arena_bytes={2 * _pages(need)} (or more)"
        else:
            setting = f"max_batch_bytes={need} (or more)"
        return f"{setting} passed to pinpool.DataLoader"

    def plan(self, first: int) -> ArenaPlan:
        """The pool for a loader whose first batch has ``first`` bytes."""
        if self.slot_bytes is not None:
            largest = _pages(self.slot_bytes)
            arena = largest * self.batches
            plan = ArenaPlan(
                largest, arena, self.batches, self.slot_bytes, _ready_first(largest, arena)
            )
            self._within_memory(plan.arena, "slot_bytes= x num_slots=")
            return plan
        room = _pages(max(1, first) * HEADROOM)
        explicit = self.arena_bytes is not None or self.max_batch_bytes is not None
        arena = self.arena_bytes or max(MIN_ARENA, room * self.batches)
        if self.max_batch_bytes is not None:
            largest = _pages(self.max_batch_bytes)
        else:
            largest = _pages(max(room, min(arena // 2, LARGEST_DEFAULT)))
        if self.arena_bytes is None:
            arena = max(arena, 2 * largest)  # a batch of the largest size never waits alone
            # No batch crosses a part of the arena, and a part may be one largest batch long:
            # the batches in flight must fit whole units, each holding as many as fit in it
            # (batches of 84 MB leave 44 of a 128 MiB unit unused).
            per_unit = max(1, largest // room)
            arena = max(arena, -(-self.batches // per_unit) * largest)
            arena = -(-arena // largest) * largest
        else:
            arena = _pages(arena)  # as given (the last part holds the pages past whole units)
        cap = self._memory_cap()
        if cap is not None and arena > cap:
            if explicit:
                named = "arena_bytes=" if self.arena_bytes is not None else "max_batch_bytes="
                self._within_memory(arena, named)
            # Smaller: two of the largest batch that fits (the first batch too, if it does;
            # if not, it and those like it take memory of their own, by oversize=).
            largest = max(_PAGE, cap // 2 // _PAGE * _PAGE)
            arena = 2 * largest
        # Entries are cheap (a few words each): enough that the arena fills with batches of
        # ENTRY_BYTES before its entries run out, so a consumer that keeps many small batches
        # is bounded by the arena's bytes, as the user was told, not by a count of slots.
        entries = self.num_slots
        if entries is None:
            entries = min(MAX_ENTRIES, max(2 * self.batches, 64, arena // ENTRY_BYTES))
        return ArenaPlan(
            largest, arena, entries, self.max_batch_bytes or 0, _ready_first(room, arena)
        )

    def check(self) -> None:
        """Raises ``NotEnoughMemory`` now, naming the setting, if the sizes given make an arena
        over the memory this loader may take (a loader checks its settings when it is made)."""
        if self.slot_bytes is not None or self.arena_bytes is not None:
            self.plan(1)
        elif self.max_batch_bytes is not None:
            self.plan(self.max_batch_bytes)

    def _within_memory(self, arena: int, named: str) -> None:
        cap = self._memory_cap()
        if cap is not None and arena > cap:
            raise NotEnoughMemory(
                f"{named} makes an arena of {arena} bytes ({arena / 2**30:.2f} GiB), more than "
                f"{self._share_text()} of the memory available ({cap} bytes may be taken); "
                f"pass a smaller {named.split(' ')[0]} to pinpool.DataLoader"
            )

    def _memory_cap(self) -> int | None:
        available = available_memory()
        if available is None:
            return None
        return int(available * MEMORY_SHARE / arguments.local_world_size())

    def _share_text(self) -> str:
        ranks = arguments.local_world_size()
        each = f" (this rank's share: {ranks} ranks on this host)" if ranks > 1 else ""
        return f"{MEMORY_SHARE / ranks:.0%}{each}"
