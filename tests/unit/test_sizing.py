"""An arena sized automatically (``sizing.Sizing.plan``) holds the batches in flight in whole
parts; and the room a claim made ahead of the consumer leaves free (``_native.room_kept``) can
be kept (no free range is longer than one of the arena's parts) and is enough for the batch
the consumer waits for."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pinpool._main.settings import sizing
from pinpool._main.settings.sizing import HEADROOM, Sizing
from pinpool._native import room_kept

PAGE = 4096


@given(
    largest_seen=st.integers(1, 1 << 30),
    part_batches=st.integers(1, 8),
    parts=st.integers(1, 16),
    slack=st.integers(0, 1 << 20),
)
def test_the_room_kept_fits_in_one_part_and_holds_the_next_batch(
    largest_seen: int, part_batches: int, parts: int, slack: int
) -> None:
    # An arena's parts are whole multiples of its largest batch, which is at least any batch.
    largest = -(-(largest_seen + slack) // PAGE) * PAGE
    part = largest * part_batches
    arena = part * parts
    keep = room_kept(largest_seen, arena, part)
    one = -(-largest_seen // PAGE) * PAGE
    assert keep <= part, "no free range is longer than a part: a claim ahead could never keep it"
    assert keep <= max(arena - largest_seen, one)
    assert keep >= min(one, part), "never less than one batch: the awaited one must still fit"
    assert keep % PAGE == 0 or keep == arena - largest_seen, "whole pages"
    assert keep >= min(largest_seen * 3 // 2, part, arena - largest_seen), "half as much again"


@given(first=st.integers(1, 1 << 30), in_flight=st.integers(1, 64))
def test_an_automatic_arena_holds_its_batches_in_parts_one_batch_long(
    first: int, in_flight: int
) -> None:
    # No batch crosses a part, and a part may be one largest batch long (an arena made ready
    # in the background, or cut among more copy threads than it has such units): the
    # batches in flight, each of the first batch's room, must fit in whole units. (Batches
    # of 84 MB in an arena of six 128 MiB units: six fit, not the eight it was sized for.)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sizing, "available_memory", lambda: None)  # (no cap: the sizing alone)
        sized = Sizing(in_flight=in_flight)
        plan = sized.plan(first)
    room = -(-int(first * HEADROOM) // PAGE) * PAGE
    units = plan.arena // plan.largest
    assert plan.arena % plan.largest == 0
    assert plan.largest >= room
    assert units * (plan.largest // room) >= sized.batches, (plan, room)


@given(
    first=st.integers(1, 1 << 28),
    in_flight=st.integers(1, 64),
    arena_bytes=st.one_of(st.none(), st.integers(1, 1 << 34)),
)
def test_an_arena_runs_out_of_bytes_before_entries(
    first: int, in_flight: int, arena_bytes: int | None
) -> None:
    # A consumer that keeps many small batches is bounded by the arena's bytes: a sized
    # arena has an entry for each ENTRY_BYTES of it (up to MAX_ENTRIES), and at least two
    # for each batch out at once.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sizing, "available_memory", lambda: None)
        sized = Sizing(in_flight=in_flight, arena_bytes=arena_bytes)
        plan = sized.plan(first)
    assert plan.entries >= 2 * sized.batches
    assert plan.entries >= min(sizing.MAX_ENTRIES, plan.arena // sizing.ENTRY_BYTES)
    assert plan.entries <= max(sizing.MAX_ENTRIES, 2 * sized.batches)


def test_num_slots_is_the_number_of_entries() -> None:
    plan = Sizing(in_flight=4, slot_bytes=1 << 20, num_slots=7).plan(100)
    assert plan.entries == 7


@given(
    first=st.integers(1, 1 << 30),
    in_flight=st.integers(1, 64),
    arena_bytes=st.one_of(st.none(), st.integers(1, 1 << 34)),
    slot_bytes=st.one_of(st.none(), st.integers(1, 1 << 28)),
)
def test_what_is_made_ready_before_the_first_batch_is_its_room_not_the_arena(
    first: int, in_flight: int, arena_bytes: int | None, slot_bytes: int | None
) -> None:
    # Where the arena is made ready in the background, the first batch waits only for two of
    # its own room (at least READY_AT_LEAST) to be faulted in and locked, not for the 64 MiB
    # floor; never more than the arena.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sizing, "available_memory", lambda: None)
        num_slots = None if slot_bytes is None else 4
        sized = Sizing(
            in_flight=in_flight, arena_bytes=arena_bytes, slot_bytes=slot_bytes, num_slots=num_slots
        )
        plan = sized.plan(first)
    room = plan.largest if slot_bytes is not None else -(-int(first * HEADROOM) // PAGE) * PAGE
    assert 0 < plan.ready_first <= plan.arena
    first_room = sizing.READY_FIRST_BATCHES * room
    assert plan.ready_first == min(plan.arena, max(sizing.READY_AT_LEAST, first_room)), plan
    if plan.arena >= sizing.MIN_ARENA and first_room < sizing.READY_AT_LEAST:
        assert plan.ready_first < plan.arena // 8, "a small first batch waits for the floor"
