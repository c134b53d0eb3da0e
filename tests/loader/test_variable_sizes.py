"""Batches whose size varies, in the one fixed arena, with default settings.

The two workloads users meet: dynamic padding (token rows of varying length, each batch
padded to its longest row, short batches first) and detection-style batches (lists of images
of varying height and width). Every batch must land in the arena (no overflow into ordinary
memory), bit for bit what torch's own DataLoader gives, in copy mode and in zero-copy mode;
the arena never grows; zero-copy batches are each written into a slot of their own size. And a
generated test: random batch sizes, both modes, against torch.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.utils.data
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_datasets import array_leaves, assert_same, in_pool

import pinpool
from pinpool import BatchTooLarge
from pinpool._main.settings.sizing import MIN_ARENA, READY_AT_LEAST
from pinpool._native import cuda_available

MODES = pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero-copy"])


class TokenRows(torch.utils.data.Dataset):
    """Row ``i`` is ``lengths[i]`` int64 token ids (``i * 7 + position``)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(self.lengths[i], dtype=torch.int64) + i * 7


def pad_collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dynamic padding: every row padded to the batch's longest, with an attention mask."""
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.int64)
    mask = torch.zeros(len(rows), longest, dtype=torch.bool)
    for k, r in enumerate(rows):
        ids[k, : len(r)] = r
        mask[k, : len(r)] = True
    return {"input_ids": ids, "attention_mask": mask}


class Images(torch.utils.data.Dataset):
    """Image ``i`` is a uint8 (3, h, w) tensor of ``sizes[i]``, with its index as a label."""

    def __init__(self, sizes: list[tuple[int, int]]) -> None:
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> dict[str, Any]:
        h, w = self.sizes[i]
        return {"image": torch.full((3, h, w), i % 251, dtype=torch.uint8), "label": i}


def list_collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Detection-style: the images stay a list (no two alike), the labels a tensor."""
    return {
        "images": [x["image"] for x in items],
        "labels": torch.tensor([x["label"] for x in items]),
    }


def batch_bytes(batch: Any) -> int:
    return sum(leaf.nbytes for leaf in array_leaves(batch))


def run_against_torch(dataset: Any, **kw: Any) -> tuple[Any, list[int]]:
    """Both loaders over one epoch in lockstep: every batch the same, and every pinpool
    batch in the arena while alive. Returns the pinpool loader and each batch's size."""
    ours = ("zero_copy", "arena_bytes")
    ref = torch.utils.data.DataLoader(dataset, **{k: v for k, v in kw.items() if k not in ours})
    pin = pinpool.DataLoader(dataset, **kw)
    arena = None
    sizes = []
    r = p = leaves = None
    for r, p in zip(ref, pin, strict=True):
        assert_same(r, p)
        leaves = [x for x in array_leaves(p) if x.nbytes]
        assert all(in_pool(pin.pool, x) for x in leaves), "a batch left the arena"
        arena = arena or pin.pool.arena_bytes
        assert pin.pool.arena_bytes == arena, "the arena changed size"
        sizes.append(batch_bytes(p))
    del r, p, leaves
    gc.collect()
    stats = pin.stats()
    assert stats["overflow_batches"] == 0
    assert stats["slots_checked_out"] == 0
    # (the parts no claim needed are not made ready)
    ready = stats["bytes_free"] + stats["bytes_fenced"]
    assert ready + stats["bytes_preparing"] == stats["arena_bytes"]
    return pin, sizes


@MODES
def test_dynamic_padding_600x_the_first_batch(zero_copy: bool) -> None:
    # Short rows first (the first batch is 8 rows of 16 tokens: 1.2 KiB), then longer ones,
    # up to rows of 40,000 tokens: the last batches are 600 and more times the first.
    lengths = [16] * 8 + [16 + (i * 997) % 40_000 for i in range(8, 64)] + [40_000] * 16
    pin, sizes = run_against_torch(
        TokenRows(lengths),
        batch_size=8,
        num_workers=2,
        collate_fn=pad_collate,
        zero_copy=zero_copy,
    )
    assert max(sizes) >= 600 * sizes[0], sizes
    assert pin.pool.arena_bytes == MIN_ARENA  # sized from the small first batch
    if zero_copy:
        # Each batch asked for its own size: growing batches are written in place too.
        stats = pin.stats()
        assert stats["zero_copy_batches"] + stats["zero_copy_fallbacks"] == len(sizes)
        assert stats["zero_copy_batches"] >= 0.75 * len(sizes), stats


@MODES
def test_lists_of_images_of_varying_size(zero_copy: bool) -> None:
    sizes = [(32 + (i * 37) % 480, 48 + (i * 53) % 640) for i in range(48)]
    pin, got = run_against_torch(
        Images(sizes),
        batch_size=4,
        num_workers=2,
        collate_fn=list_collate,
        zero_copy=zero_copy,
    )
    assert max(got) > 4 * min(got)
    assert pin.stats()["batches"] == 12


@pytest.mark.parametrize("num_workers", [0, 2])
def test_small_batches_pin_only_the_room_they_use(num_workers: int) -> None:
    # A dataset of 1.2 KiB batches in an arena of the floor's size: in host memory only its
    # first batches' room is made ready (faulted in and locked); batches 1000 and more times
    # larger, later, still land in the arena, their room made ready as they come. A CUDA
    # arena is made ready whole. (An arena of a size no other test uses: a dropped loader's
    # arena is kept for the next of its size, as ready as it was.)
    as_needed = not cuda_available()
    arena = MIN_ARENA + (17 + num_workers) * 4096
    for lengths in ([16] * 64, [16] * 16 + [40_000] * 16):
        pin, sizes = run_against_torch(
            TokenRows(lengths),
            batch_size=8,
            num_workers=num_workers,
            collate_fn=pad_collate,
            arena_bytes=arena,
        )
        stats = pin.stats()
        ready = stats["arena_bytes"] - stats["bytes_preparing"]
        assert stats["oversize_batches"] == 0 and stats["arena_bytes"] == arena, stats
        if not as_needed:
            assert ready == arena, stats
        elif max(sizes) == sizes[0]:
            assert ready <= arena // 8, f"{ready} bytes made ready for batches of {sizes[0]}"
        else:
            assert max(sizes) >= 1000 * sizes[0] and max(sizes) > READY_AT_LEAST
            assert max(sizes) < ready < arena, stats


def test_main_process_batches_of_any_size() -> None:
    lengths = [4] * 4 + [50_000] * 4 + [4] * 4 + [120_000] * 4
    run_against_torch(TokenRows(lengths), batch_size=4, collate_fn=pad_collate)


def test_a_batch_past_the_largest_is_one_clear_error_at_that_batch() -> None:
    # max_batch_bytes= names the largest batch; a larger one raises, naming it, and the
    # batches before it were delivered.
    lengths = [16] * 8 + [300_000] * 4
    pin = pinpool.DataLoader(
        TokenRows(lengths),
        batch_size=4,
        collate_fn=pad_collate,
        max_batch_bytes=1 << 20,
        oversize="error",
    )
    it = iter(pin)
    assert next(it)["input_ids"].shape == (4, 16)
    assert next(it)["input_ids"].shape == (4, 16)
    with pytest.raises(BatchTooLarge, match="max_batch_bytes=") as info:
        next(it)
    assert info.value.needed == 4 * 300_000 * 9
    assert info.value.slot_bytes == 1 << 20
    del it, info
    gc.collect()


def test_explicit_arena_and_largest_batch() -> None:
    pin = pinpool.DataLoader(
        TokenRows([16] * 8), batch_size=4, arena_bytes=12 << 20, max_batch_bytes=3 << 20
    )
    assert pin.pool is not None, "sizes given: the pool is made at once"
    assert pin.pool.largest_slot >= 3 << 20
    assert pin.pool.arena_bytes == 12 << 20
    with pytest.raises(pinpool.InvalidArgument, match="max_batch_bytes"):
        pinpool.DataLoader(TokenRows([1]), arena_bytes=1 << 20, max_batch_bytes=2 << 20)
    with pytest.raises(pinpool.InvalidArgument, match="not both"):
        pinpool.DataLoader(TokenRows([1]), slot_bytes=1 << 20, arena_bytes=2 << 20)
    with pytest.raises(pinpool.InvalidArgument, match="arena_bytes"):
        pinpool.DataLoader(TokenRows([1]), arena_bytes=-1)


class NoArrays(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"text": f"item {i}", "n": i}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_without_arrays_make_no_pool(num_workers: int) -> None:
    pin = pinpool.DataLoader(
        NoArrays(), batch_size=4, num_workers=num_workers, collate_fn=lambda items: items
    )
    assert [b[0]["n"] for b in pin] == [0, 4]
    assert pin.pool is None


# ---------------------------------------------------------------------------- generated


@st.composite
def varying_batches(draw: Any) -> tuple[list[int], int]:
    """Row lengths (int64 tokens) and a batch size: a batch can be 1 row of 1 token or many
    rows of up to 100,000, in any order."""
    batch = draw(st.integers(1, 4))
    n = draw(st.integers(1, 6)) * batch
    lengths = draw(
        st.lists(st.one_of(st.integers(1, 64), st.integers(1, 100_000)), min_size=n, max_size=n)
    )
    return lengths, batch


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(varying_batches(), st.booleans(), st.sampled_from([0, 2]))
def test_random_batch_sizes_are_bit_exact_in_both_modes(
    case: tuple[list[int], int], zero_copy: bool, num_workers: int
) -> None:
    lengths, batch = case
    run_against_torch(
        TokenRows(lengths),
        batch_size=batch,
        num_workers=num_workers,
        collate_fn=pad_collate,
        zero_copy=zero_copy,
    )


def _holes_after_kept_batches(
    lengths: list[int], collate_fn: Any = None
) -> tuple[Any, Any, list[Any], list[Any]]:
    """A loader (1 worker, an 8 MiB arena) over batches of 4 rows of ``lengths``: its first
    eight batches taken, checked against torch's and in the arena, then every other one
    dropped. Returns the loader, its iterator, the batches kept and torch's batches to come."""
    from soak_cases import BatchRows

    rows = 4
    dataset = BatchRows(lengths, rows, ragged=False)
    torch_loader = torch.utils.data.DataLoader(dataset, batch_size=rows, collate_fn=collate_fn)
    reference = list(torch_loader)
    loader = pinpool.DataLoader(
        dataset,
        batch_size=rows,
        num_workers=1,
        collate_fn=collate_fn,
        arena_bytes=8 << 20,
        max_batch_bytes=2 << 20,
        slot_timeout=60,
    )
    it = iter(loader)
    held = [next(it) for _ in range(8)]
    for got, ref in zip(held, reference, strict=False):
        assert_same(ref, got)
    assert all(in_pool(loader.pool, x) for b in held for x in array_leaves(b))
    del held[::2]
    gc.collect()
    return loader, it, held, reference[8:]


def _take_timed(it: Any, rest: list[Any], check: Any) -> list[float]:
    """Takes torch's batches ``rest`` from ``it``, each checked against torch's and by
    ``check`` (then dropped); how long each ``next()`` took, in seconds."""
    import time

    took = []
    for ref in rest:
        t0 = time.perf_counter()
        got = next(it)
        took.append(time.perf_counter() - t0)
        assert_same(ref, got)
        check(got)
        del got
    return took


@pytest.mark.every_mode
def test_larger_batches_after_kept_ones_with_holes_never_wait_for_the_consumer(
    loader_mode: Any,
) -> None:
    """An 8 MiB arena full of eight 1 MiB batches the consumer keeps, every other one then
    dropped: four free MiB in four holes, none of which holds the 1.5 MiB batches that follow.
    Nothing but the consumer can make room (no fence, no batch ahead of it), so no claim waits:
    each batch goes to ordinary memory at once (counted), where a claim counting free bytes
    waited ``slot_timeout`` for every other batch."""
    rows = 4
    lengths = [(1 << 20) // (rows * 8)] * 8 + [(3 << 19) // (rows * 8)] * 6
    loader, it, held, rest = _holes_after_kept_batches(lengths)
    assert loader.stats()["largest_free"] == 1 << 20

    def outside(got: Any) -> None:
        assert not in_pool(loader.pool, got)

    took = _take_timed(it, rest, outside)
    assert max(took) < 2.0, took
    assert loader.stats()["overflow_batches"] == 6
    del it, held


@pytest.mark.every_mode
def test_a_batch_no_hole_holds_goes_into_the_holes_between_its_arrays(loader_mode: Any) -> None:
    """As above, with two arrays a batch (ids and mask, padded): eight batches of 1,024,000
    bytes kept, every other one dropped, leave four holes of that size; each batch of 1.5 times
    that which follows goes into two holes, an array in each (``split_batches``), in the arena
    rather than ordinary memory, bit-exact, at once; its pieces come back as it dies."""
    from soak_cases import pad_collate

    loader, it, held, rest = _holes_after_kept_batches([16000] * 8 + [24000] * 6, pad_collate)
    assert loader.stats()["largest_free"] < 1_536_000

    def inside(got: Any) -> None:
        leaves = array_leaves(got)
        assert all(in_pool(loader.pool, x) for x in leaves if x.device.type == "cpu")

    took = _take_timed(it, rest, inside)
    assert max(took) < 2.0, took
    stats = loader.stats()
    assert stats["overflow_batches"] == 0 and stats["split_batches"] == 6, stats
    del it, held
    gc.collect()
    assert loader.stats()["slots_checked_out"] == 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_consumer_that_keeps_many_small_batches_keeps_them_all_in_the_arena(
    num_workers: int,
) -> None:
    # 300 batches of 4 KiB kept at once: far more than the batches in flight, far less than
    # the arena's bytes; each one stays in the arena (the arena's bytes bound a consumer that
    # keeps batches, not a count of slots).
    dataset = TokenRows([512] * 600)
    pin = pinpool.DataLoader(dataset, batch_size=2, num_workers=num_workers, collate_fn=pad_collate)
    kept = list(pin)
    assert len(kept) == 300
    assert all(in_pool(pin.pool, x) for b in kept for x in array_leaves(b) if x.nbytes)
    stats = pin.stats()
    assert stats["overflow_batches"] == 0, stats
    assert stats["slots_checked_out"] == 300, stats
    del kept
    gc.collect()
