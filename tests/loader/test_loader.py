"""``pinpool.DataLoader``: batches equal torch's, bit for bit and type for type, and slots come
and go with the batches that view them.

Every comparison runs ``torch.utils.data.DataLoader`` and ``pinpool.DataLoader`` over the same
dataset with the same arguments, in lockstep, so that only a couple of batches are alive at
any time. Without CUDA the pool is host memory (not pinned); the batches are still views into
its slots.
"""

from __future__ import annotations

import gc
import math
import mmap
import time
import traceback
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data
from conftest import LoaderMode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_datasets import (
    NUMPY_DTYPES,
    TORCH_DTYPES,
    Indexed,
    ListDataset,
    NumpyMix,
    Pair,
    Record,
    ShardedRange,
    Sized,
    Tracked,
    array_leaves,
    assert_same,
    in_pool,
    keep_samples,
    make_array,
    sum_collate,
    tag_worker,
)

import pinpool
from pinpool import BatchTooLarge, InvalidArgument, PoolExhausted
from pinpool._main.settings.sizing import MIN_ARENA

#: Every test here runs in copy mode; those marked ``every_mode`` in all four loader modes
#: (``tests/conftest.py``: ``loader_mode``).
pytestmark = pytest.mark.usefixtures("loader_mode")

MiB = 1 << 20

# --------------------------------------------------------------------------- comparing


def forget(info: pytest.ExceptionInfo[Any]) -> BaseException:
    """The caught exception, with the frames of its traceback cleared.

    A frame of the iterator's ``__next__`` would otherwise keep the iterator alive in a
    reference cycle; when the garbage collector finally takes it, the multiprocessing queues'
    finalizers have already run and torch's worker shutdown waits 5 s per worker (plain torch
    does the same)."""
    err = info.value
    traceback.clear_frames(info.tb)
    err.__traceback__ = None
    return err


def drain(batches: Any, key: Any) -> list[Any] | str:
    """``[key(b) for b in batches]``, or the error that stopped it, as text (so that no
    traceback keeps the iterator alive after a known-bug test fails)."""
    out = []
    try:
        for b in batches:
            out.append(key(b))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return out


def in_slot_bytes(batch: Any) -> int:
    """Bytes of the batch's arrays (those a slot must hold): a tensor that keeps a strided
    layout takes its storage as far as its strides reach, and so does a strided NumPy array
    (converted to a tensor that keeps its strides where no collate packs it)."""

    def size(leaf: Any) -> int:
        if isinstance(leaf, np.ndarray) and leaf.size:
            reach = sum((n - 1) * abs(s) for n, s in zip(leaf.shape, leaf.strides, strict=True))
            return max(leaf.nbytes, reach + leaf.itemsize)
        if not isinstance(leaf, torch.Tensor) or leaf.numel() == 0:
            return leaf.nbytes
        reach = sum((n - 1) * abs(s) for n, s in zip(leaf.shape, leaf.stride(), strict=True))
        return max(leaf.nbytes, (reach + 1) * leaf.element_size())

    return sum(size(leaf) for leaf in array_leaves(batch))


def check_live_batch(pin: Any, batch: Any) -> None:
    """A live batch's arrays are all in the pool, which then has a slot checked out, unless
    the batch overflowed into ordinary memory (then none is); on a host pool (no CUDA) its
    tensors are not pinned."""
    stats = pin.stats()
    leaves = [x for x in array_leaves(batch) if x.nbytes]
    if leaves:
        placed = {in_pool(pin.pool, x) for x in leaves}
        assert len(placed) == 1, "a batch is partly in the pool"
        if placed == {True}:
            assert stats["slots_checked_out"] >= 1, "a live batch holds no slot"
        else:
            outside = stats["overflow_batches"] + stats["oversize_batches"]
            assert outside >= 1, "a batch outside the pool was not counted"
    if pin.pool is not None and pin.pool.memory != "pinned":
        for leaf in array_leaves(batch):
            if isinstance(leaf, torch.Tensor):
                assert not leaf.is_pinned(), "a host pool is not pinned"


def compare_loaders(
    dataset: Any, pin_kw: dict[str, Any] | None = None, overflow: int = 0, **kw: Any
) -> Any:
    """Runs torch's and pinpool's loaders over ``dataset`` in lockstep; every batch must be
    the same, and while a pinpool batch with array bytes is alive (and not one of the
    ``overflow`` batches in ordinary memory), a slot is checked out.

    Returns the pinpool loader (after one epoch, every batch dropped)."""
    ref = torch.utils.data.DataLoader(dataset, **kw)
    pin = pinpool.DataLoader(dataset, **kw, **(pin_kw or {}))
    if not {"pool", "slot_bytes"} & set(pin_kw or ()):
        assert pin.pool is None, "without sizes, the pool is made at the first batch"
    n = 0
    r = p = None
    for r, p in zip(ref, pin, strict=True):
        assert_same(r, p)
        check_live_batch(pin, p)
        n += 1
    del r, p
    gc.collect()
    stats = pin.stats()
    assert stats["batches"] == n
    assert stats["overflow_batches"] == overflow
    assert stats.get("slots_checked_out", 0) == 0, "slots still out after every batch died"
    return pin


# --------------------------------------------------------------------------- generated data


@st.composite
def leaf_schema(draw: Any, *, none: bool, reversed_: bool, odd_numpy: bool) -> tuple:
    """One leaf: an array (library, dtype, shape, layout) or a Python value."""
    kind = draw(st.sampled_from(["array"] * 6 + ["scalar"] * 3 + ["big"]))
    if kind == "scalar":
        names = ["int", "float", "str", "bytes"] + (["none"] if none else [])
        return (draw(st.sampled_from(names)),)
    lib = draw(st.sampled_from(["torch", "numpy"]))
    if kind == "big":  # about a MiB per sample: a few MiB per batch
        dtype = draw(st.sampled_from(["float32", "uint8", "float64"]))
        shape = {"float32": (512, 512), "uint8": (1024, 1024), "float64": (256, 512)}[dtype]
        layout = draw(st.sampled_from(["contig", "transposed", "strided"]))
        return ("array", lib, dtype, shape, layout)
    dtypes = TORCH_DTYPES if lib == "torch" else NUMPY_DTYPES
    if lib == "numpy" and odd_numpy:
        dtypes = [*dtypes, ">i4", "<M8[s]"]
    dtype = draw(st.sampled_from(dtypes))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    layouts = ["contig", "transposed", "strided"]
    if lib == "numpy" and reversed_:
        layouts.append("reversed")
    return ("array", lib, dtype, shape, draw(st.sampled_from(layouts)))


def tree_schema(**leaf_kw: bool) -> st.SearchStrategy[tuple]:
    keys = st.text(alphabet="abxyz_", min_size=1, max_size=3)
    return st.recursive(
        leaf_schema(**leaf_kw),
        lambda ch: st.one_of(
            st.dictionaries(keys, ch, max_size=3).map(lambda d: ("dict", tuple(d.items()))),
            st.lists(ch, max_size=3).map(lambda v: ("list", tuple(v))),
            st.lists(ch, max_size=3).map(lambda v: ("tuple", tuple(v))),
            st.tuples(ch, ch).map(lambda v: ("pair", v)),
            st.tuples(ch, ch, ch).map(lambda v: ("record", v)),
        ),
        max_leaves=6,
    )


def make_value(schema: tuple, rng: Any) -> Any:
    kind = schema[0]
    if kind == "array":
        return make_array(*schema[1:], rng)
    if kind == "int":
        return int(rng.integers(-(2**62), 2**62))
    if kind == "float":
        pick = int(rng.integers(0, 6))
        return [float(rng.normal()), math.nan, math.inf, -math.inf, -0.0, 1e-310][pick]
    if kind == "str":
        return "".join(rng.choice(list("aZ é中\x00-"), size=int(rng.integers(0, 6))))
    if kind == "bytes":
        return rng.bytes(int(rng.integers(0, 6)))
    if kind == "none":
        return None
    children = schema[1]
    if kind == "dict":
        return {k: make_value(v, rng) for k, v in children}
    values = [make_value(c, rng) for c in children]
    if kind == "list":
        return values
    if kind == "tuple":
        return tuple(values)
    if kind == "pair":
        return Pair(*values)
    return Record(*values)


def make_samples(schema: tuple, n: int, seed: int) -> list[Any]:
    rng = np.random.default_rng(seed)
    return [make_value(schema, rng) for _ in range(n)]


def slot_bytes_for(samples: list[Any], batch_size: int | None) -> int:
    """A slot size that surely holds any batch of these samples (collated or not)."""
    per = max((in_slot_bytes(s) + 64 * (len(array_leaves(s)) + 1) for s in samples), default=0)
    scalars = 4096  # Python numbers become 8-byte tensors; generous
    need = (batch_size or 1) * (per + scalars)
    return max(2 * MiB, -(-need // MiB) * MiB)


def run_round_trip(
    schema: tuple,
    n: int,
    seed: int,
    batch_size: int | None,
    num_workers: int,
    collate_fn: Any = None,
    drop_last: bool = False,
) -> None:
    samples = make_samples(schema, n, seed)
    ds = ListDataset(samples)
    kw: dict[str, Any] = {"batch_size": batch_size, "num_workers": num_workers}
    if batch_size is not None:
        kw["drop_last"] = drop_last
    if collate_fn is not None:
        kw["collate_fn"] = collate_fn
    pin_kw: dict[str, Any] = {"slot_bytes": slot_bytes_for(samples, batch_size), "num_slots": 4}
    if num_workers:
        pin_kw["worker_copy_threads"] = 3  # big arrays through the workers' copy threads
    compare_loaders(ds, pin_kw=pin_kw, **kw)


def examples(n: int) -> settings:
    """Hypothesis settings for ``n`` examples of a loader round trip."""
    return settings(
        max_examples=n,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,  # (loader_mode: the same for every example)
        ],
    )


FAST = examples(12)  # in this process
WORKERS = examples(5)  # each example starts workers

default_collate_schema = tree_schema(none=False, reversed_=False, odd_numpy=False)
kept_schema = tree_schema(none=True, reversed_=True, odd_numpy=True)
# Through pickling (torch with workers) numpy drops a non-native byte order: not for workers.
kept_schema_workers = tree_schema(none=True, reversed_=True, odd_numpy=False)
converted_schema = tree_schema(none=True, reversed_=False, odd_numpy=False)
sizes = st.integers(0, 7)
seeds = st.integers(0, 2**32 - 1)
batch_sizes = st.integers(1, 3)


# --------------------------------------------------------------------------- round trips


@FAST
@given(default_collate_schema, sizes, seeds, batch_sizes, st.booleans())
def test_round_trip_default_collate_main_process(schema, n, seed, batch_size, drop_last) -> None:
    run_round_trip(schema, n, seed, batch_size, 0, drop_last=drop_last)


@pytest.mark.every_mode
@WORKERS
@given(default_collate_schema, sizes, seeds, batch_sizes, st.booleans())
def test_round_trip_default_collate_workers(schema, n, seed, batch_size, drop_last) -> None:
    run_round_trip(schema, n, seed, batch_size, 2, drop_last=drop_last)


@FAST
@given(kept_schema, sizes, seeds, batch_sizes)
def test_round_trip_custom_collate_main_process(schema, n, seed, batch_size) -> None:
    run_round_trip(schema, n, seed, batch_size, 0, collate_fn=keep_samples)


@WORKERS
@given(kept_schema_workers, sizes, seeds, batch_sizes)
def test_round_trip_custom_collate_workers(schema, n, seed, batch_size) -> None:
    run_round_trip(schema, n, seed, batch_size, 2, collate_fn=keep_samples)


@FAST
@given(converted_schema, sizes, seeds)
def test_round_trip_batch_size_none_main_process(schema, n, seed) -> None:
    run_round_trip(schema, n, seed, None, 0)


@WORKERS
@given(converted_schema, sizes, seeds)
def test_round_trip_batch_size_none_workers(schema, n, seed) -> None:
    run_round_trip(schema, n, seed, None, 2)


@WORKERS
@given(kept_schema_workers, sizes, seeds)
def test_round_trip_batch_size_none_custom_collate_workers(schema, n, seed) -> None:
    run_round_trip(schema, n, seed, None, 2, collate_fn=keep_samples)


@pytest.mark.every_mode
@pytest.mark.parametrize("num_workers", [0, 2])
def test_round_trip_every_dtype_and_layout(num_workers: int) -> None:
    """Deterministic companion of the generated tests: every dtype in every layout, 0-d and
    zero-size arrays, a large strided tensor, and Python leaves, through both collates."""
    rng = np.random.default_rng(1)
    leaves: dict[str, Any] = {}
    for lib, dtypes in (("torch", TORCH_DTYPES), ("numpy", NUMPY_DTYPES)):
        for dtype in dtypes:
            for layout, shape in (
                ("contig", ()),
                ("contig", (0, 3)),
                ("contig", (2, 3)),
                ("transposed", (3, 4, 2)),
                ("strided", (5, 3)),
            ):
                leaves[f"{lib}-{dtype}-{layout}-{len(shape)}d"] = (lib, dtype, shape, layout)
    leaves["big"] = ("torch", "float32", (1024, 700), "strided")  # ~2.7 MiB per sample
    leaves["big-contig"] = ("torch", "int16", (1024, 700), "contig")  # gathered by threads

    def sample() -> dict[str, Any]:
        out: dict[str, Any] = {k: make_array(*v, rng) for k, v in leaves.items()}
        out["py"] = Record(int(rng.integers(-(2**40), 2**40)), math.nan, "naïve")
        out["blob"] = rng.bytes(5)
        return out

    ds = ListDataset([sample() for _ in range(5)])
    kw = {"slot_bytes": 16 * MiB, "num_slots": 3, "worker_copy_threads": 3}
    compare_loaders(ds, pin_kw=kw, batch_size=2, num_workers=num_workers)
    compare_loaders(ds, pin_kw=kw, batch_size=2, num_workers=num_workers, collate_fn=keep_samples)
    compare_loaders(ds, pin_kw=kw, batch_size=None, num_workers=num_workers)


# --------------------------------------------------------------------------- torch's features


@pytest.mark.parametrize("num_workers", [0, 2])
def test_map_style_with_custom_collate(num_workers: int) -> None:
    compare_loaders(Indexed(11), batch_size=3, num_workers=num_workers, collate_fn=sum_collate)


@pytest.mark.every_mode
@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_dataset_sharded_per_worker(num_workers: int) -> None:
    pin = compare_loaders(ShardedRange(13), batch_size=2, num_workers=num_workers)
    seen = []
    for batch in pin:
        seen.extend(batch["idx"].tolist())
    del batch
    # Every index exactly once: the sharding worked in every worker.
    assert sorted(seen) == list(range(13))


class _FirstWorkerEndsEarly(torch.utils.data.IterableDataset[Any]):
    """Worker 0 makes 2 samples at once; the others 3 each, slowly: worker 0's second
    batch arrives before its turn, and its end right after (torch then tells it to exit)."""

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        for i in range(2 if info.id == 0 else 3):
            if info.id:
                time.sleep(0.2)
            yield {"x": torch.full((1000,), float(10 * info.id + i))}


def test_iterable_dataset_whose_workers_end_at_different_times() -> None:
    # The batches a worker sent ahead are received before torch lets it exit (their segments
    # are opened through the worker's /proc entry).
    got = [b["x"][0, 0].item() for b in pinpool.DataLoader(_FirstWorkerEndsEarly(), num_workers=3)]
    assert sorted(got) == [0, 1, 10, 11, 12, 20, 21, 22]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_with_a_seeded_generator(num_workers: int) -> None:
    ds = Indexed(17)
    ref = torch.utils.data.DataLoader(
        ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)
    )
    pin = pinpool.DataLoader(
        ds,
        batch_size=4,
        shuffle=True,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(7),
    )
    for r, p in zip(ref, pin, strict=True):
        assert_same(r, p)
    order = [i for b in pin for i in b["idx"].tolist()]
    assert sorted(order) == list(range(17)) and order != list(range(17))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_distributed_sampler(num_workers: int) -> None:
    from torch.utils.data.distributed import DistributedSampler

    ds = Indexed(15)

    def sampler() -> DistributedSampler:
        s = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)
        s.set_epoch(2)
        return s

    ref = torch.utils.data.DataLoader(ds, batch_size=3, sampler=sampler())
    pin = pinpool.DataLoader(ds, batch_size=3, sampler=sampler(), num_workers=num_workers)
    got = []
    for r, p in zip(ref, pin, strict=True):
        assert_same(r, p)
        got.extend(p["idx"].tolist())
    assert len(got) == 8  # rank 1 of 2 over 15 samples (padded to 16)
    assert got == list(sampler())


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_drop_last(num_workers: int, drop_last: bool) -> None:
    pin = compare_loaders(
        Sized([100 + i for i in range(10)]),
        batch_size=4,
        drop_last=drop_last,
        num_workers=num_workers,
        collate_fn=list,
    )
    assert pin.stats()["batches"] == (2 if drop_last else 3)
    assert len(pin) == (2 if drop_last else 3)


def test_prefetch_factor() -> None:
    compare_loaders(Indexed(23), batch_size=2, num_workers=2, prefetch_factor=4)


@pytest.mark.every_mode
def test_in_order_false_gives_the_same_batches() -> None:
    ds = Sized([1000] * 12, sleep={0: 0.2, 1: 0.2})  # worker 0's first batch comes late
    ref = [b.clone() for b in torch.utils.data.DataLoader(ds, batch_size=2)]
    pin = pinpool.DataLoader(ds, batch_size=2, num_workers=2, in_order=False)
    got = [b.clone() for b in pin]
    key = lambda b: int(b[0, 0])  # noqa: E731
    assert [key(b) for b in got] != [key(b) for b in ref], "expected an out-of-order epoch"
    assert len(got) == len(ref)
    for r, p in zip(sorted(ref, key=key), sorted(got, key=key), strict=True):
        assert_same(r, p)
    gc.collect()
    assert pin.stats()["slots_checked_out"] == 0


@pytest.mark.every_mode
def test_persistent_workers_three_epochs(loader_mode: LoaderMode) -> None:
    ds = Indexed(40, pid=True)
    ref = torch.utils.data.DataLoader(ds, batch_size=2)
    pin = pinpool.DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=True)
    pids = []
    mapped = []
    for _ in range(3):
        epoch_pids = set()
        for r, p in zip(ref, pin, strict=True):
            epoch_pids.update(p.pop("pid").tolist())
            r.pop("pid")
            assert_same(r, p)
        del p
        pids.append(epoch_pids)
        mapped.append(pin.stats()["segments_mapped"])
        assert pin.stats()["slots_checked_out"] == 0
    assert pids[0] == pids[1] == pids[2] and len(pids[0]) == 2, "workers were restarted"
    # Segments are reused across batches and epochs: each worker maps at most its ring
    # (prefetch_factor + 2 segments), not one per batch; they stay mapped between epochs.
    assert mapped[0] <= mapped[1] <= mapped[2] <= 2 * (2 + 2) < 3 * len(pin)
    assert pin.stats()["segments_cached"] <= 2 * (2 + 2)
    if loader_mode.zero_copy:  # (every batch written in place: no segment needed)
        assert pin.stats()["zero_copy_batches"] == 3 * len(pin)
    else:
        assert pin.stats()["segments_cached"] >= 2


@pytest.mark.parametrize(
    "context",
    [
        "fork",
        pytest.param("spawn", marks=pytest.mark.slow),
        pytest.param("forkserver", marks=pytest.mark.slow),
    ],
)
def test_multiprocessing_contexts(context: str) -> None:
    ds = NumpyMix(6)
    ref = torch.utils.data.DataLoader(ds, batch_size=4)
    pin = pinpool.DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context=context)
    for r, p in zip(ref, pin, strict=True):
        assert_same(r, p)


# --------------------------------------------------------------------------- zero-copy mode


@WORKERS
@given(default_collate_schema, sizes, seeds, batch_sizes)
def test_zero_copy_round_trip(schema, n, seed, batch_size) -> None:
    samples = make_samples(schema, n, seed)
    pin_kw = {"slot_bytes": slot_bytes_for(samples, batch_size), "num_slots": 6, "zero_copy": True}
    compare_loaders(ListDataset(samples), pin_kw=pin_kw, batch_size=batch_size, num_workers=2)


@pytest.mark.parametrize("slot_bytes", [None, 1 << 20])
def test_zero_copy_batches_are_written_into_slots(slot_bytes: int | None) -> None:
    pin_kw = {"zero_copy": True, "slot_bytes": slot_bytes}
    pin = compare_loaders(Indexed(40), pin_kw=pin_kw, batch_size=2, num_workers=2)
    stats = pin.stats()
    assert stats["zero_copy_batches"] + stats["zero_copy_fallbacks"] >= 20
    assert stats["zero_copy_batches"] >= 10, stats
    assert isinstance(pin.dataset, Indexed)  # the workers' wrapper stays out of sight


def test_zero_copy_custom_collate_gets_a_plain_list() -> None:
    compare_loaders(
        Indexed(8),
        pin_kw={"zero_copy": True, "slot_bytes": 1 << 20},
        batch_size=2,
        num_workers=2,
        collate_fn=keep_samples,
    )


# --------------------------------------------------------------------------- slots


def test_batches_are_views_into_the_pools_arena() -> None:
    pin = pinpool.DataLoader(Indexed(8, shape=(64, 64)), batch_size=4, num_slots=3)
    assert pin.pool is None, "the pool is made at the first batch"
    it = iter(pin)
    batch = next(it)
    pool = pin.pool
    assert pool is not None and pool.num_slots == 3
    assert pin.stats()["slots_checked_out"] == 1
    # Every array of the batch lies in one slot, the first where the slot starts; each views
    # only its own bytes (its storage is no larger than the array).
    start = min(t.data_ptr() for t in array_leaves(batch))
    size = sum(t.nbytes for t in array_leaves(batch))
    for t in array_leaves(batch):
        assert t.untyped_storage().nbytes() == t.nbytes
        assert start <= t.data_ptr() and t.data_ptr() + t.nbytes <= start + pool.slot_bytes
        assert t.is_pinned() == (pool.memory == "pinned")
    del t
    second = next(it)
    assert pin.stats()["slots_checked_out"] == 2
    del batch
    gc.collect()
    assert pin.stats()["slots_checked_out"] == 1
    del second, it
    gc.collect()
    assert pin.stats()["slots_checked_out"] == 0
    # The batch's buffer was one of the pool's slots, of the batch's own size: check as many
    # out and look.
    slots = [pool.checkout(timeout=5, nbytes=size) for _ in range(pool.num_slots)]
    assert start in {s.address for s in slots}
    assert {s.nbytes for s in slots} == {-(-size // mmap.PAGESIZE) * mmap.PAGESIZE}
    for s in slots:
        s.release()


@pytest.mark.every_mode
@pytest.mark.parametrize("num_workers", [0, 1])
def test_one_leaf_keeps_the_slot(num_workers: int) -> None:
    pin = pinpool.DataLoader(Indexed(4), batch_size=2, num_workers=num_workers)
    batch = next(iter(pin))
    gc.collect()
    assert pin.stats()["slots_checked_out"] == 1
    x = batch["x"]
    idx = batch["idx"]
    del batch
    gc.collect()
    assert pin.stats()["slots_checked_out"] == 1, "a leaf is alive: the slot must stay out"
    del x
    gc.collect()
    assert pin.stats()["slots_checked_out"] == 1, "the last leaf is alive"
    assert idx.tolist() == [0, 1]
    del idx
    gc.collect()
    stats = pin.stats()
    assert stats["slots_checked_out"] == 0
    # Every byte free, or not made ready yet (the prepare thread runs at idle priority: on a
    # busy machine it may not have come to the rest of the arena).
    assert stats["bytes_free"] + stats["bytes_preparing"] == stats["arena_bytes"]
    assert stats["arena_bytes"] == pin.pool.arena_bytes


def test_numpy_leaf_keeps_the_slot() -> None:
    pin = pinpool.DataLoader(NumpyMix(4), batch_size=2, collate_fn=keep_samples)
    batch = next(iter(pin))
    arr = batch["samples"][1].x
    assert isinstance(arr, np.ndarray)
    del batch
    gc.collect()
    assert pin.stats()["slots_checked_out"] == 1
    assert arr.tobytes() == (np.arange(12, dtype=np.int16).reshape(3, 4).T * 1).tobytes()
    del arr
    gc.collect()
    assert pin.stats()["slots_checked_out"] == 0


# With fewer slots than batches in flight, zero-copy grants hold slots for batches not yet
# back: exhaustion comes one batch sooner than this test counts.
@pytest.mark.copy_mode_only
@pytest.mark.parametrize("num_workers", [0, 2])
def test_overflow_wait_raises_pool_exhausted(num_workers: int) -> None:
    pin = pinpool.DataLoader(
        Indexed(12),
        batch_size=2,
        num_workers=num_workers,
        num_slots=2,
        overflow="wait",
        slot_timeout=0.5,
    )
    kept = []
    it = iter(pin)
    kept.append(next(it))
    kept.append(next(it))
    t0 = time.monotonic()
    with pytest.raises(PoolExhausted, match="no room for a batch") as info:
        kept.append(next(it))
    waited = time.monotonic() - t0
    forget(info)
    # The wait is the consumer's own (torch's pin thread never waits for a slot it holds).
    assert 0.4 <= waited < 10, waited
    assert len(kept) == 2
    assert [b["idx"].tolist() for b in kept] == [[0, 1], [2, 3]]
    del kept, it
    gc.collect()
    assert pin.stats()["slots_checked_out"] == 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_overflow_wait_gets_a_slot_back_in_time(num_workers: int) -> None:
    """With ``overflow="wait"``, a consumer that drops each batch before asking for the next
    never waits, even with a single slot."""
    ds = Indexed(9)
    ref = iter(torch.utils.data.DataLoader(ds, batch_size=2))
    pin = pinpool.DataLoader(
        ds, batch_size=2, num_workers=num_workers, num_slots=1, overflow="wait", slot_timeout=5
    )
    for batch in pin:
        assert_same(next(ref), batch)
        assert pin.stats()["slots_checked_out"] == 1
        del batch
    stats = pin.stats()
    assert stats["batches"] == 5 and stats["overflow_batches"] == 0
    # On a CUDA pool the last release may still wait on its fence for a moment.
    assert stats["slots_free"] + stats["slots_fenced"] == 1


@pytest.mark.every_mode
@pytest.mark.parametrize("num_workers", [0, 2])
def test_overflow_copy_keeps_going(num_workers: int) -> None:
    ds = Indexed(12, shape=(16, 16))
    pin = pinpool.DataLoader(ds, batch_size=2, num_workers=num_workers, num_slots=2)
    kept = list(pin)  # every batch alive at once
    stats = pin.stats()
    assert stats["batches"] == 6
    assert stats["overflow_batches"] == 4
    assert stats["slots_checked_out"] == 2
    ref = list(torch.utils.data.DataLoader(ds, batch_size=2))
    for r, p in zip(ref, kept, strict=True):
        assert_same(r, p)
    del kept
    gc.collect()
    assert pin.stats()["slots_checked_out"] == 0


@pytest.mark.parametrize("num_workers", [0, 1])
def test_oversize_error_names_both_sizes_and_the_setting(num_workers: int) -> None:
    ds = Sized([1000] * 4 + [9 * MiB] * 4)
    pin = pinpool.DataLoader(ds, batch_size=4, num_workers=num_workers, oversize="error")
    it = iter(pin)
    first = next(it)
    assert first.shape == (4, 1000)
    # Sized for a small first batch: the smallest arena, batches of up to half of it.
    largest = pin.pool.largest_slot
    assert largest == MIN_ARENA // 2 < 36 * MiB
    with pytest.raises(BatchTooLarge) as info:
        next(it)
    err = forget(info)
    assert err.needed == 36 * MiB
    assert err.slot_bytes == largest
    assert str(36 * MiB) in str(err) and str(largest) in str(err)
    assert "max_batch_bytes=" in str(err)
    assert isinstance(err, ValueError)
    del first, it
    gc.collect()
    assert pin.stats()["slots_checked_out"] == 0


@pytest.mark.every_mode
@pytest.mark.parametrize("num_workers", [0, 1])
def test_oversize_copy_yields_the_big_batch(num_workers: int) -> None:
    ds = Sized([1000] * 4 + [9 * MiB] * 4)
    pin = compare_loaders(
        ds, pin_kw={"oversize": "copy"}, overflow=0, batch_size=4, num_workers=num_workers
    )
    assert pin.stats()["oversize_batches"] == 1
    # The big batch (past the largest the arena takes) went into ordinary memory; the arena
    # kept its size.
    assert pin.pool.largest_slot == MIN_ARENA // 2 < 36 * MiB
    assert pin.pool.arena_bytes == MIN_ARENA
    assert pin.stats()["bytes"] == 4 * 1000 + 4 * 9 * MiB


def test_explicit_pool_slot_bytes_and_num_slots() -> None:
    with pinpool.PinPool(4 * MiB, 3, device="cpu") as pool:
        pin = compare_loaders(Indexed(10), pin_kw={"pool": pool}, batch_size=3, num_workers=2)
        assert pin.pool is pool
        assert pool.stats()["checkouts"] == 4
        del pin
        gc.collect()
        assert not pool.closed, "a pool passed in belongs to the caller"
        assert pool.stats()["slots_free"] == 3
    pin = pinpool.DataLoader(Indexed(4), batch_size=2, slot_bytes=3 * MiB, num_slots=5)
    for _ in pin:
        pass
    assert pin.pool.slot_bytes == 3 * MiB
    assert pin.pool.num_slots == 5
    # The loader's own pool lives on the current CUDA device, if there is one.
    assert pin.pool.device == (torch.cuda.current_device() if torch.cuda.is_available() else None)


def test_default_arena_follows_prefetch() -> None:
    """The default arena holds the batches in flight (prefetch x workers) plus 4, each 1.25
    times the first batch, at least the smallest arena; as many batches can be out."""
    row = 4 * MiB
    pin = pinpool.DataLoader(Sized([row] * 8), batch_size=2, num_workers=2, prefetch_factor=3)
    for _ in pin:
        pass
    batches = 3 * 2 + 4
    assert pin.pool.num_slots >= batches
    room = -(-int(2 * row * 1.25) // mmap.PAGESIZE) * mmap.PAGESIZE
    assert batches * room > MIN_ARENA
    assert pin.pool.arena_bytes >= batches * room


def test_stats_keys() -> None:
    pin = pinpool.DataLoader(Indexed(6), batch_size=2)
    before = pin.stats()
    assert "slots_free" not in before, "no pool yet"
    for key in ("batches", "bytes", "overflow_batches", "segments_cached"):
        assert before[key] == 0
    total = 0
    for b in pin:
        total += in_slot_bytes(b)
    stats = pin.stats()
    for key in ("slots_free", "slots_checked_out", "checkouts", "releases", "segments_mapped"):
        assert key in stats
    assert stats["batches"] == 3
    assert stats["bytes"] >= total


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgument, match="overflow"):
        pinpool.DataLoader(Indexed(2), overflow="drop")
    with pytest.raises(InvalidArgument, match="oversize"):
        pinpool.DataLoader(Indexed(2), oversize="truncate")
    with pytest.raises(InvalidArgument):
        if not torch.cuda.is_available():
            pinpool.DataLoader(Indexed(2), device="cuda")  # no CUDA here
        else:
            pinpool.DataLoader(Indexed(2), device="meta")  # not a CUDA device
    pinpool.DataLoader(Indexed(2), device="cpu")  # same as None
    for threads in (0, 65, 1.5):
        with pytest.raises(InvalidArgument, match="worker_copy_threads"):
            pinpool.DataLoader(Indexed(2), num_workers=2, worker_copy_threads=threads)


# --------------------------------------------------------------------------- known bugs


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("leaf", ["uint8-label", "one-element-slice"])
def test_awkward_but_legal_leaves(num_workers: int, leaf: str) -> None:
    """Regression: 0-d uint8 labels and one-element strided slices (see test_codec.py)."""

    def sample(i: int) -> torch.Tensor:
        if leaf == "uint8-label":
            return torch.tensor(i, dtype=torch.uint8)
        return torch.tensor([float(i), -1.0])[::2]

    compare_loaders(
        ListDataset([sample(i) for i in range(4)]), batch_size=2, num_workers=num_workers
    )


def test_default_slot_size_does_not_depend_on_arrival_order() -> None:
    # 9 samples of 1 MiB, batch_size 8: batch 0 is 8 MiB, batch 1 (worker 1) 1 MiB and
    # ready first because worker 0 sleeps.
    ds = Sized([1 * MiB] * 9, sleep={0: 0.5})
    pin = pinpool.DataLoader(ds, batch_size=8, num_workers=2)
    got = drain(pin, lambda b: b.shape[0])
    del pin
    assert got == [8, 1]


@pytest.mark.every_mode
def test_two_live_iterators_of_one_loader() -> None:
    pin = pinpool.DataLoader(Indexed(8), batch_size=2, num_workers=1)
    first = iter(pin)
    second = iter(pin)
    head = next(second)["idx"].tolist()
    got_first = drain(first, lambda b: b["idx"].tolist())
    got_second = drain(second, lambda b: b["idx"].tolist())
    del first, second, pin
    assert head == [0, 1]
    assert got_first == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert got_second == [[2, 3], [4, 5], [6, 7]]


# --------------------------------------------------------------------------- streaming collation


def big_mixed_samples(n: int) -> list[Any]:
    rng = np.random.default_rng(7)
    return [
        {
            "image": torch.from_numpy(rng.integers(0, 255, (3, 64, 96), dtype=np.uint8)),
            "depth": rng.standard_normal((64, 64)).astype(np.float32),
            "pair": Pair(torch.full((128, 40), float(i), dtype=torch.float64), i),
            "label": i,
            "name": f"s{i}",
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("stream_samples", [True, False])
def test_big_samples_match_torch_with_and_without_streaming(stream_samples: bool) -> None:
    kw = {"stream_samples": stream_samples}
    compare_loaders(ListDataset(big_mixed_samples(22)), pin_kw=kw, batch_size=4, num_workers=2)
    compare_loaders(Indexed(20, shape=(64, 64)), pin_kw=kw, batch_size=3, num_workers=2)


@pytest.mark.parametrize("stream_samples", [True, False])
def test_streaming_frees_each_sample_before_the_next_is_made(stream_samples: bool) -> None:
    pin = pinpool.DataLoader(
        Tracked(16),
        batch_size=4,
        num_workers=2,
        stream_samples=stream_samples,
        worker_copy_threads=1,
    )
    alive = [batch["alive"].tolist() for batch in pin]
    assert len(alive) == 4
    if stream_samples:
        assert alive == [[0, 0, 0, 0]] * 4  # each sample's tensor died as it was streamed
    else:
        assert alive == [[0, 1, 2, 3]] * 4  # torch's way: all of a batch's samples at once


def test_streaming_with_copy_threads_holds_a_bounded_group() -> None:
    # 64 KiB samples, 40 to a batch: copied in groups of GROUP_BYTES (16 samples), so no
    # more than 15 earlier samples are ever alive, where torch's way keeps up to 39.
    from pinpool._worker.streaming import GROUP_BYTES

    group = GROUP_BYTES // (64 << 10)
    pin = pinpool.DataLoader(Tracked(80), batch_size=40, num_workers=2, worker_copy_threads=2)
    alive = [batch["alive"].tolist() for batch in pin]
    assert len(alive) == 2
    for counts in alive:
        assert max(counts) == group - 1
        assert counts[:group] == list(range(group))


def test_worker_init_fn_sets_attributes_on_the_callers_dataset() -> None:
    ds = Tracked(8)
    pin = pinpool.DataLoader(ds, batch_size=2, num_workers=2, worker_init_fn=tag_worker)
    assert pin.dataset is ds
    tags = {tag for batch in pin for tag in batch["tag"]}
    assert tags == {"worker 0", "worker 1"}
    assert pin.dataset is ds and ds.tag == "main"


def test_samples_unlike_the_first_fall_back_to_torchs_collation() -> None:
    def raise_alike(samples: list[Any], match: str) -> None:
        """pinpool's loader raises what torch's does (its type varies with torch's version)."""
        pin = pinpool.DataLoader(ListDataset(samples), batch_size=4, num_workers=2)
        ref = torch.utils.data.DataLoader(ListDataset(samples), batch_size=4, num_workers=2)
        with pytest.raises(Exception, match=match) as torchs:
            for batch in ref:
                del batch
        with pytest.raises(torchs.type, match=match):
            for batch in pin:
                del batch

    samples = big_mixed_samples(8)
    samples[6]["depth"] = samples[6]["depth"][:, :60].copy()
    raise_alike(samples, "storage|equal size")
    # Mixed dtypes: torch stacks into shared memory of the first sample's dtype in a worker
    # (and fails), and promotes in the main process.
    samples = big_mixed_samples(8)
    samples[5]["image"] = samples[5]["image"].float()
    raise_alike(samples, "can't be cast")
    compare_loaders(ListDataset(samples), batch_size=4, num_workers=0)
