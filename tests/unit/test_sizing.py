"""The room a claim made ahead of the consumer leaves free (``sizing.room_kept``): it must be
possible to keep (no free range is longer than one of the arena's parts) and enough for the
batch the consumer waits for."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pinpool._main.sizing import room_kept

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
    assert keep <= part, "no free range is longer than a part: a claim ahead could never keep it"
    assert keep <= arena - largest_seen
    assert keep >= min(largest_seen, arena - largest_seen), "the next batch must still fit"
