"""``pinpool.pinned``: another loader's batches, equal to its own, copied into pool slots.

Every comparison runs the wrapped loader and a second, plain one over the same dataset in
lockstep. Without CUDA the pool is host memory (not pinned); the batches are still views into
its slots.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data
from loader_datasets import (
    Indexed,
    NumpyMix,
    Sized,
    array_leaves,
    assert_same,
    in_pool,
    keep_samples,
)

import pinpool
from pinpool import BatchTooLarge, InvalidArgument

MiB = 1 << 20


def in_one_slot(pool: pinpool.PinPool | None, batch: Any) -> bool:
    """Whether every non-empty array of the batch lies in the pool, all in one slot."""
    leaves = [x for x in array_leaves(batch) if x.nbytes]
    if pool is None or not leaves or not all(in_pool(pool, x) for x in leaves):
        return False
    slots = {(_start(x) - pool.address) // pool.slot_bytes for x in leaves}
    return len(slots) == 1


def _start(leaf: Any) -> int:
    if isinstance(leaf, torch.Tensor):
        return int(leaf.data_ptr())
    return int(leaf.__array_interface__["data"][0])


def compare(ref_loader: Any, wrapped: pinpool.Pinned[Any]) -> int:
    """Runs both in lockstep: every batch the same, in one slot of the pool, a slot checked
    out while it lives; returns the batch count (every batch dropped by then)."""
    n = 0
    r = p = None
    for r, p in zip(ref_loader, wrapped, strict=True):
        assert_same(r, p)
        assert wrapped.pool is not None
        assert in_one_slot(wrapped.pool, p), "a batch is not in one slot of the pool"
        assert wrapped.stats()["slots_checked_out"] >= 1
        n += 1
    del r, p
    gc.collect()
    assert wrapped.stats()["slots_checked_out"] == 0, "slots still out after every batch died"
    return n


# --------------------------------------------------------------------------- batches


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_equal_torchs_and_lie_in_slots(num_workers: int) -> None:
    ds = Indexed(10, shape=(16, 8))
    kw: dict[str, Any] = {"batch_size": 3, "num_workers": num_workers}
    wrapped = pinpool.pinned(torch.utils.data.DataLoader(ds, **kw))
    assert wrapped.pool is None, "without sizes, the pool is made at the first batch"
    before = wrapped.stats()
    assert before["batches"] == 0 and before["bytes"] == 0 and "slots_free" not in before
    n = compare(torch.utils.data.DataLoader(ds, **kw), wrapped)
    assert n == 4
    stats = wrapped.stats()
    assert stats["batches"] == 4
    # Each batch: idx (int64 per sample) and x (float32 16x8 per sample), aligned to 64.
    per_sample = 8 + 16 * 8 * 4
    assert stats["bytes"] >= 10 * per_sample
    assert stats["bytes"] < 10 * per_sample + 4 * 2 * 64
    assert stats["overflow_batches"] == 0
    assert stats["checkouts"] == 4
    # The same counters as a DataLoader's (a LoaderStats): no worker wrote or sent anything.
    assert stats["zero_copy_batches"] == 0 and stats["segments_cached"] == 0


def test_numpy_leaves_and_custom_collate() -> None:
    ds = NumpyMix(6)
    kw: dict[str, Any] = {"batch_size": 2, "collate_fn": keep_samples}
    compare(
        torch.utils.data.DataLoader(ds, **kw), pinpool.pinned(torch.utils.data.DataLoader(ds, **kw))
    )


def test_big_batches_go_through_the_copy_threads() -> None:
    """Arrays of 1 MiB and more are copied by the pool's threads: still the same bytes."""
    ds = Sized([2 * MiB + 5, MiB + 3, 2 * MiB, 7, MiB + 3, MiB])
    ref = torch.utils.data.DataLoader(ds, batch_size=None)
    wrapped = pinpool.pinned(torch.utils.data.DataLoader(ds, batch_size=None), copy_threads=4)
    assert compare(ref, wrapped) == 6
    assert wrapped.pool is not None and wrapped.pool.copy_threads == 4
    assert wrapped.stats()["bytes"] == sum(ds.sizes)


def test_an_iterable_of_dicts() -> None:
    def make(i: int) -> dict[str, Any]:
        return {
            "x": torch.arange(12, dtype=torch.float32).reshape(3, 4).T * i,  # not contiguous
            "y": np.full((5,), i, dtype=np.int16),
            "name": f"b{i}",
            "nested": {"z": torch.tensor([i, -i]), "n": i},
        }

    batches = [make(i) for i in range(5)]
    wrapped = pinpool.pinned(batches)
    assert len(wrapped) == 5
    for epoch in range(2):
        assert compare(batches, wrapped) == 5, epoch
    # The inputs are left alone: the pinned batches are copies.
    assert batches[3]["x"].data_ptr() != 0 and not in_pool(wrapped.pool, batches[3]["x"])


def test_a_batch_without_arrays_passes_through_unchanged() -> None:
    class Tags:  # an object the walk cannot look into: it must come out itself
        def __init__(self, names: list[str]) -> None:
            self.names = names

    tags = Tags(["t"])
    batches: list[Any] = [["a", "b"], {"k": 1, "s": ("x", None)}, tags, [tags, 2.5], 7, "s"]
    wrapped = pinpool.pinned(batches)
    got = list(wrapped)
    assert got == batches
    assert [type(g) for g in got] == [type(b) for b in batches]
    assert type(got[1]["s"]) is tuple
    assert got[2] is tags and got[3][0] is tags
    assert wrapped.pool is None, "no pool is made for batches without arrays"
    assert wrapped.stats()["batches"] == 6 and wrapped.stats()["bytes"] == 0


def test_leaves_pinpool_cannot_carry_are_kept() -> None:
    grad = torch.ones(3, requires_grad=True)
    batch = {"grad": grad, "x": torch.ones(4)}
    (got,) = list(pinpool.pinned([batch]))
    assert got["grad"] is grad
    assert torch.equal(got["x"], batch["x"]) and got["x"].data_ptr() != batch["x"].data_ptr()


def test_several_epochs_and_len() -> None:
    ds = Indexed(7)
    inner = torch.utils.data.DataLoader(ds, batch_size=2, shuffle=True)
    wrapped = pinpool.pinned(inner)
    assert len(wrapped) == len(inner) == 4
    seen = []
    for _ in range(3):
        idx = sorted(i for b in wrapped for i in b["idx"].tolist())
        seen.append(idx)
    assert seen == [list(range(7))] * 3
    stats = wrapped.stats()
    assert stats["batches"] == 12
    assert stats["checkouts"] == 12 and stats["slots_checked_out"] == 0
    # An iterable without a length: len() fails as it would on the loader itself.
    with pytest.raises(TypeError):
        len(pinpool.pinned(iter([torch.ones(2)])))


def test_the_iterator_keeps_no_batch_alive() -> None:
    wrapped = pinpool.pinned(torch.utils.data.DataLoader(Indexed(6), batch_size=2))
    it = iter(wrapped)
    batch = next(it)
    assert wrapped.stats()["slots_checked_out"] == 1
    del batch
    gc.collect()
    assert wrapped.stats()["slots_checked_out"] == 0, "the iterator holds the last batch"
    assert next(it)["idx"].tolist() == [2, 3]


# --------------------------------------------------------------------------- the wrapper


class Counting(torch.utils.data.DataLoader):
    """A user's subclass with a state: how many batches its iterator has yielded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.yielded = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        for batch in super().__iter__():
            self.yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.yielded = state["yielded"]


def test_attributes_are_read_from_the_wrapped_loader() -> None:
    ds = Indexed(8)
    inner = Counting(ds, batch_size=2)
    wrapped = pinpool.pinned(inner)
    assert wrapped.dataset is ds
    assert wrapped.batch_size == 2
    assert wrapped.sampler is inner.sampler
    with pytest.raises(AttributeError):
        _ = wrapped.no_such_attribute
    # Nothing is taken ahead: the state is what the consumer has been given.
    it = iter(wrapped)
    next(it)
    next(it)
    assert wrapped.state_dict() == {"yielded": 2}
    wrapped.load_state_dict({"yielded": 5})
    assert inner.yielded == 5
    del it
    # The wrapper's own names are its own.
    assert isinstance(wrapped.stats(), dict)
    assert "pinpool.pinned(" in repr(wrapped)
    # Dunders are not passed through: copy and pickle must not find the wrapped loader's.

    class Copyable(list):
        def __deepcopy__(self, memo: Any) -> Any:
            return "the wrapped loader's copy"

    assert not hasattr(pinpool.pinned(Copyable()), "__deepcopy__")


def test_accelerate_data_loader_shard() -> None:
    data_loader = pytest.importorskip("accelerate.data_loader")
    ds = Indexed(6)
    shard = data_loader.DataLoaderShard(ds, batch_size=2)
    wrapped = pinpool.pinned(shard)
    assert compare(torch.utils.data.DataLoader(ds, batch_size=2), wrapped) == 3
    wrapped.set_epoch(3)  # accelerate's own method, through the wrapper
    assert shard.iteration == 3


def test_pin_memory_true_warns() -> None:
    inner = torch.utils.data.DataLoader(Indexed(2), pin_memory=True)
    with pytest.warns(UserWarning, match="pin_memory=True"):
        pinpool.pinned(inner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pinpool.pinned(torch.utils.data.DataLoader(Indexed(2)))


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgument, match="iterable"):
        pinpool.pinned(42)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="overflow"):
        pinpool.pinned([], overflow="drop")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="oversize"):
        pinpool.pinned([], oversize="truncate")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="num_slots"):
        pinpool.pinned([], num_slots=0)
    with pytest.raises(InvalidArgument, match="slots already"):
        pinpool.pinned(pinpool.DataLoader(Indexed(2)))
    with pytest.raises(InvalidArgument, match="slots already"):
        pinpool.pinned(pinpool.pinned([]))
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgument, match="CUDA"):
            pinpool.pinned([], device="cuda")


# --------------------------------------------------------------------------- slots


def test_a_batch_kept_alive_does_not_starve_the_pool() -> None:
    ds = Indexed(40, shape=(32, 32))
    wrapped = pinpool.pinned(torch.utils.data.DataLoader(ds, batch_size=2), num_slots=3)
    it = iter(wrapped)
    kept = next(it)
    # The loop holds one batch as the next is copied in: with the kept one, three slots in
    # use, the other two reused again and again.
    for batch in it:
        assert in_one_slot(wrapped.pool, batch)
    del batch
    gc.collect()
    stats = wrapped.stats()
    assert stats["batches"] == 20 and stats["overflow_batches"] == 0
    assert stats["checkouts"] == 20 and stats["slots_checked_out"] == 1
    assert kept["idx"].tolist() == [0, 1] and in_one_slot(wrapped.pool, kept)
    # Every batch kept alive (list()): the ones with no slot left go to ordinary memory.
    ref = list(torch.utils.data.DataLoader(ds, batch_size=2))
    got = list(wrapped)
    for r, g in zip(ref, got, strict=True):
        assert_same(r, g)
    stats = wrapped.stats()
    assert stats["overflow_batches"] == 20 - 2  # two slots were free, the kept batch has one
    assert sum(in_one_slot(wrapped.pool, g) for g in got) == 2


def test_overflow_wait_and_oversize() -> None:
    batches = [torch.ones(1000), torch.ones(1000), torch.ones(1000)]
    wrapped = pinpool.pinned(batches, num_slots=1, overflow="wait", slot_timeout=0.2)
    it = iter(wrapped)
    first = next(it)
    with pytest.raises(pinpool.PoolExhausted):
        next(it)
    del first, it
    big = [torch.ones(MiB, dtype=torch.uint8), torch.ones(4 * MiB, dtype=torch.uint8)]
    with pytest.raises(BatchTooLarge):
        list(pinpool.pinned(big, slot_bytes=2 * MiB, oversize="error"))
    for oversize in ("pin", "copy"):
        outside = pinpool.pinned(big, slot_bytes=2 * MiB, oversize=oversize)
        assert outside.pool is not None, "with slot_bytes=, the pool is made at once"
        got = list(outside)
        assert [g.nbytes for g in got] == [b.nbytes for b in big]
        assert outside.stats()["oversize_batches"] == 1
        assert outside.stats()["overflow_batches"] == 0


# --------------------------------------------------------------------------- the end


def test_closing_or_dropping_the_wrapper_frees_its_pool() -> None:
    wrapped = pinpool.pinned([torch.ones(8), torch.full((8,), 2.0)])
    kept = next(iter(wrapped))
    pool = wrapped.pool
    assert pool is not None and not pool.closed
    wrapped.close()
    assert pool.closed
    assert pinpool.wait_for_freed_pools(timeout=60)
    assert kept.tolist() == [1.0] * 8, "a batch outlives the pool's closing"
    wrapped.close()  # twice is fine
    with pytest.raises(pinpool.PoolClosed):
        next(iter(wrapped))
    del kept

    dropped = pinpool.pinned([torch.ones(8)])
    list(dropped)
    pool = dropped.pool
    assert pool is not None and not pool.closed
    del dropped
    gc.collect()
    assert pool.closed, "the wrapper's pool outlived it"
    assert pinpool.wait_for_freed_pools(timeout=60)


def test_a_pool_passed_in_stays_the_callers() -> None:
    with pinpool.PinPool(MiB, 3, device="cpu") as pool:
        wrapped = pinpool.pinned(
            torch.utils.data.DataLoader(Indexed(6), batch_size=2, num_workers=2), pool=pool
        )
        assert wrapped.pool is pool
        compare(torch.utils.data.DataLoader(Indexed(6), batch_size=2), wrapped)
        wrapped.close()
        del wrapped
        gc.collect()
        assert not pool.closed
        assert pool.stats()["slots_free"] == 3


def test_importing_pinpool_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import pinpool\n"
        "assert 'torch' not in sys.modules, 'import pinpool imported torch'\n"
        "pinned = pinpool.pinned\n"
        "assert 'torch' in sys.modules and pinned.__module__ == 'pinpool.adapter'\n"
        "print(pinpool.Pinned.__name__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["Pinned"]
    assert "pinned" in pinpool.__all__ and "Pinned" in pinpool.__all__


# --------------------------------------------------------------------------- layouts


def _layouts() -> dict[str, torch.Tensor]:
    """Leaves that are not contiguous, each in its own way."""
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "transposed": x.t(),
        "expanded": torch.arange(4.0).reshape(4, 1).expand(4, 5),
        "negative_bit": torch._neg_view(x.t()),
        "sliced": x[:, ::2],
        "channels_last": torch.arange(120.0)
        .reshape(1, 2, 3, 20)
        .to(memory_format=torch.channels_last),
        "int_permuted": torch.arange(60, dtype=torch.int16).reshape(3, 4, 5).permute(2, 0, 1),
        "contiguous": x.clone(),
    }


def _torchs_pinned_layout(t: torch.Tensor) -> tuple[Any, ...]:
    """What torch's ``Tensor.pin_memory()`` gives (``at::_pin_memory``): the same sizes and
    strides, at storage offset 0 of a storage exactly as long as the layout reaches, with
    no lazy negation (it copies into that layout)."""
    pairs = zip(t.shape, t.stride(), strict=True)
    reach = 0 if t.numel() == 0 else 1 + sum((d - 1) * s for d, s in pairs)
    return tuple(t.shape), t.stride(), 0, reach * t.element_size(), False


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return (
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        t.untyped_storage().nbytes(),
        t.is_neg(),
    )


def test_non_contiguous_leaves_keep_torchs_pinned_layout() -> None:
    batch = _layouts()
    loader = pinpool.pinned([batch, batch])
    for got in loader:
        for name, t in batch.items():
            assert _layout(got[name]) == _torchs_pinned_layout(t), name
            assert torch.equal(got[name], t.resolve_neg()), name
            assert in_pool(loader.pool, got[name]), name
        del got
    # The slot is written in the leaf's layout: writing a pinned leaf changes only its element.
    got = next(iter(loader))
    got["transposed"][0, 1] = -1.0
    assert got["transposed"][0, 1] == -1.0 and got["transposed"][1, 0] == 1.0


def _collate_layouts(samples: list[Any]) -> dict[str, torch.Tensor]:
    return _layouts()


@pytest.mark.every_mode
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_keeps_the_layouts_torch_gives(loader_mode: Any, num_workers: int) -> None:
    # torch's loader (here, without an accelerator, it pins nothing) yields each leaf as the
    # collate function made it, from workers too; pinned, it would keep the layout as well
    # (see above). torch's workers drop a lazy negation (they share the storage and the
    # strides, not the bit): pinpool's values are the negated ones, with no bit left.
    dataset = Indexed(4)
    kw: dict[str, Any] = dict(batch_size=2, collate_fn=_collate_layouts, num_workers=num_workers)
    ref = torch.utils.data.DataLoader(dataset, **kw)
    pin = pinpool.DataLoader(dataset, **kw)
    want = _layouts()
    for r, p in zip(ref, pin, strict=True):
        for name in r:
            assert p[name].stride() == r[name].stride(), name
            assert torch.equal(p[name], want[name].resolve_neg()), name
            assert not p[name].is_neg(), name
    del r, p


def test_a_strided_marker_cannot_view_outside_its_leaf() -> None:
    from pinpool import OutOfBounds
    from pinpool._wire import codec, leaves

    flat = torch.zeros(10)
    bad = [
        codec.Strided(codec.Leaf(0), (11,), (1,)),
        codec.Strided(codec.Leaf(0), (2, 5), (5, 2)),
        codec.Strided(codec.Leaf(0), (2,), (-1,)),
        codec.Strided(codec.Leaf(0), (2,), (1, 1)),
        codec.Strided(codec.Leaf(0), [2], [1]),  # type: ignore[arg-type]
        codec.Strided(codec.Leaf(0), (2**40, 2**40), (0, 0)),
        codec.Strided(codec.Leaf(1), (2,), (1,)),
    ]
    for marker in bad:
        with pytest.raises(OutOfBounds):
            leaves.rebuild({"x": marker}, [flat])
    with pytest.raises(OutOfBounds):
        leaves.rebuild(codec.Strided(codec.Leaf(0), (1,), (1,)), [np.zeros(4)])
    ok = leaves.rebuild(codec.Strided(codec.Leaf(0), (2, 5), (1, 2)), [flat])
    assert ok.shape == (2, 5) and ok.stride() == (1, 2)
