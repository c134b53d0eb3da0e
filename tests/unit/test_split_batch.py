"""A split batch, in several slots (``PinPool.claim_split``, ``_main.route.split_batch``):
where it may be cut, that the pieces cover it, that its leaves view the right bytes, and that
bad cuts take nothing."""

from __future__ import annotations

import gc
import itertools
import mmap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pinpool import InvalidArgument
from pinpool._errors import ArgumentTypeError
from pinpool._main.route.split_batch import SplitBatch, cuts
from pinpool._wire.codec import LeafSpec

PAGE = mmap.PAGESIZE


def spec(offset: int, nbytes: int) -> LeafSpec:
    return LeafSpec(offset, nbytes, "numpy", "|u1", (nbytes,), None)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 300)), max_size=12))
def test_cuts_start_at_0_increase_end_at_the_batch_and_split_no_leaf(
    spans: list[tuple[int, int]],
) -> None:
    specs = [spec(o, n) for o, n in spans]
    need = max([o + n for o, n in spans] + [1])
    got = cuts(specs, need)
    assert got[0] == 0 and got[-1] == need
    assert all(a < b for a, b in itertools.pairwise(got))
    for c in got:
        for o, n in spans:
            assert not (n and o < c < o + n), (c, o, n)
    # Each cut inside the batch is where a leaf starts.
    assert set(got[1:-1]) <= {o for o, n in spans if n}


def holes(make_pool) -> tuple[object, list[object]]:
    """A pool of eight one-page slots, every other one given back: four one-page holes."""
    # One part (an arena is made in parts of whole largest slots, one per fault thread).
    pool = make_pool(8 * PAGE, 8, arena_bytes=8 * PAGE)
    assert pool.largest_slot == 8 * PAGE
    held = [pool.checkout(nbytes=PAGE) for _ in range(8)]
    for s in held[::2]:
        s.release()
    return pool, held[1::2]


def test_a_batch_no_hole_holds_goes_in_pieces_whose_leaves_view_their_bytes(make_pool) -> None:
    pool, kept = holes(make_pool)
    need = 3 * PAGE - 100
    specs = [spec(0, PAGE), spec(PAGE, PAGE - 36), spec(2 * PAGE, PAGE - 100)]
    assert pool.claim(need, overflow=True) == "overflow"
    pieces = SplitBatch.claimed(pool, specs, need)
    assert pieces is not None
    assert [(a, b) for a, b, _ in pieces.parts] == [(0, PAGE), (PAGE, 2 * PAGE), (2 * PAGE, need)]
    assert pool.stats()["slots_checked_out"] == 7
    for k, (_, _, slot) in enumerate(pieces.parts):
        np.frombuffer(slot, np.uint8)[:] = k + 1
    views = [pieces.host_leaf(s) for s in specs]
    for k, v in enumerate(views):
        assert v.shape == (specs[k].nbytes,) and (v == k + 1).all()
    # The views hold the slots; they go back once the last view dies.
    del pieces, v, views, slot
    gc.collect()
    assert pool.stats()["slots_checked_out"] == len(kept)


def test_a_leaf_no_hole_holds_takes_nothing(make_pool) -> None:
    pool, _ = holes(make_pool)
    before = pool.stats()
    specs = [spec(0, PAGE), spec(PAGE, 2 * PAGE)]
    assert SplitBatch.claimed(pool, specs, 3 * PAGE) is None
    assert SplitBatch.claimed(pool, [spec(0, 2 * PAGE)], 2 * PAGE) is None, "one leaf: no cut"
    after = pool.stats()
    for key in ("slots_checked_out", "bytes_free", "largest_free", "free_ranges"):
        assert after[key] == before[key], key


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ([], InvalidArgument),
        ([0], InvalidArgument),
        ([PAGE, 2 * PAGE], InvalidArgument),
        ([0, PAGE, PAGE], InvalidArgument),
        ([0, -1], InvalidArgument),
        ([0, 1 << 64], InvalidArgument),
        ([0, "4096"], ArgumentTypeError),
        ([0, 1.5], ArgumentTypeError),
        (None, TypeError),
    ],
)
def test_cuts_that_cannot_be_meant_are_refused_and_take_nothing(make_pool, bad, error) -> None:
    pool, _ = holes(make_pool)
    with pytest.raises(error):
        pool.claim_split(bad)
    assert pool.stats()["slots_checked_out"] == 4
