"""Batches of types torch's pinning protocol knows: dataclasses and namedtuples of tensors go
through the pool like dicts and lists do; an object pinpool cannot look into that defines
``pin_memory()`` (torch's hook for custom batch types, as in torch's "Memory Pinning" docs)
gets that method called where torch would call it, and one warning per type says its tensors
did not go through the pool.

Every loader test runs torch's DataLoader over the same dataset and collate function and
compares the batches. Without an accelerator torch pins nothing; the tests that need a
``pin_memory()`` call make pinpool believe torch would pin (``opaque.torch_would_pin``).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data
from loader_datasets import Indexed, ListDataset, assert_same, in_pool

import pinpool
from pinpool._main.route import opaque
from pinpool._wire import codec, leaves
from pinpool._wire.tree import KEEP, Node, map_leaves

# --------------------------------------------------------------------------- batch types


@dataclasses.dataclass
class DataBatch:
    """A plain dataclass batch, with a field set after ``__init__``."""

    x: torch.Tensor
    idx: torch.Tensor
    names: list[str]
    total: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.total = self.x.sum(0)


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenBatch:
    """A frozen dataclass with slots, holding a nested dict and a numpy array."""

    x: torch.Tensor
    extra: dict[str, Any]


TensorPair = collections.namedtuple("TensorPair", ["x", "idx"])


class SimpleCustomBatch:
    """torch's documented custom batch type: its ``pin_memory()`` pins its tensors (only where
    an accelerator is: these tests run without one) and counts its calls."""

    def __init__(self, samples: list[dict[str, Any]]) -> None:
        self.inp = torch.stack([s["x"] for s in samples])
        self.tgt = torch.tensor([s["idx"] for s in samples])
        self.pins = 0

    def pin_memory(self) -> SimpleCustomBatch:
        if torch.accelerator.is_available():
            self.inp = self.inp.pin_memory()
            self.tgt = self.tgt.pin_memory()
        self.pins += 1
        return self


def to_dataclass(samples: list[dict[str, Any]]) -> DataBatch:
    return DataBatch(
        torch.stack([s["x"] for s in samples]),
        torch.tensor([s["idx"] for s in samples]),
        [s["name"] for s in samples],
    )


def to_frozen(samples: list[dict[str, Any]]) -> FrozenBatch:
    idx = np.array([s["idx"] for s in samples], dtype=np.int32)
    return FrozenBatch(torch.stack([s["x"] for s in samples]), {"idx": idx, "n": len(samples)})


def to_custom(samples: list[dict[str, Any]]) -> SimpleCustomBatch:
    return SimpleCustomBatch(samples)


def to_mixed(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A custom object next to ordinary tensors."""
    return {"x": torch.stack([s["x"] for s in samples]), "custom": SimpleCustomBatch(samples)}


def pairs(n: int) -> ListDataset:
    """Samples that are namedtuples of tensors (default_collate keeps the type)."""
    return ListDataset(
        [TensorPair(torch.full((4, 4), float(i)), torch.tensor(i)) for i in range(n)]
    )


# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts with no type warned about yet in this process."""
    monkeypatch.setattr(opaque, "_warned", set())


def same(ref: Any, got: Any, path: str = "batch") -> None:
    """``assert_same``, looking into dataclasses and custom batch objects (field by field)."""
    assert type(got) is type(ref), f"{path}: {type(got).__name__} != {type(ref).__name__}"
    if dataclasses.is_dataclass(ref):
        for f in dataclasses.fields(ref):
            same(getattr(ref, f.name), getattr(got, f.name), f"{path}.{f.name}")
    elif isinstance(ref, SimpleCustomBatch):
        same(ref.inp, got.inp, f"{path}.inp")
        same(ref.tgt, got.tgt, f"{path}.tgt")
    elif isinstance(ref, dict):
        assert list(got) == list(ref), f"{path}: keys differ"
        for k in ref:
            same(ref[k], got[k], f"{path}[{k!r}]")
    elif isinstance(ref, (list, tuple)) and not isinstance(ref, (torch.Tensor, np.ndarray)):
        assert len(got) == len(ref), f"{path}: length differs"
        for i, (r, g) in enumerate(zip(ref, got, strict=True)):
            same(r, g, f"{path}[{i}]")
    else:
        assert_same(ref, got, path)


def arrays(x: Any) -> list[Any]:
    """Every tensor and numpy array of a batch, dataclass fields and custom objects too."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return [x]
    if dataclasses.is_dataclass(x):
        return [a for f in dataclasses.fields(x) for a in arrays(getattr(x, f.name))]
    if isinstance(x, SimpleCustomBatch):
        return [x.inp, x.tgt]
    if isinstance(x, dict):
        return [a for v in x.values() for a in arrays(v)]
    if isinstance(x, (list, tuple)):
        return [a for v in x for a in arrays(v)]
    return []


def ours(caught: list[warnings.WarningMessage]) -> list[str]:
    """The messages of pinpool's warnings among ``caught``."""
    return [str(w.message) for w in caught if str(w.message).startswith("pinpool:")]


def run_both(dataset: Any, collate_fn: Any, num_workers: int) -> tuple[Any, list[Any], list[str]]:
    """torch's and pinpool's loaders over ``dataset`` (batches of 2) in lockstep: every batch
    the same. Returns the pinpool loader, what each pinpool batch had in the pool (a list per
    batch: one bool per array) and pinpool's warnings over the whole epoch."""
    kw: dict[str, Any] = {"batch_size": 2, "num_workers": num_workers, "collate_fn": collate_fn}
    ref = torch.utils.data.DataLoader(dataset, **kw)
    pin: pinpool.DataLoader[Any] = pinpool.DataLoader(dataset, **kw)
    placed = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for r, p in zip(ref, pin, strict=True):
            same(r, p)
            placed.append([in_pool(pin.pool, a) for a in arrays(p) if a.nbytes])
        del r, p
    gc.collect()
    return pin, placed, ours(caught)


# --------------------------------------------------------------------------- through the pool


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("collate_fn", [to_dataclass, to_frozen], ids=["dataclass", "frozen"])
def test_dataclass_batches_go_through_the_pool(collate_fn: Any, num_workers: int) -> None:
    pin, placed, warned = run_both(Indexed(6), collate_fn, num_workers)
    assert placed and all(p and all(p) for p in placed), f"arrays outside the pool: {placed}"
    stats = pin.stats()
    assert stats["batches"] == 3
    # 3 batches of 2 samples of 3x4 float32: at least that many bytes went through the pool.
    assert stats["bytes"] >= 3 * 2 * 3 * 4 * 4
    assert stats["overflow_batches"] == 0
    assert warned == []


@pytest.mark.parametrize("num_workers", [0, 2])
def test_namedtuple_batches_go_through_the_pool(num_workers: int) -> None:
    pin, placed, warned = run_both(pairs(6), None, num_workers)
    assert placed and all(p and all(p) for p in placed), f"arrays outside the pool: {placed}"
    assert pin.stats()["bytes"] >= 3 * 2 * 4 * 4 * 4
    assert warned == []


def test_ordinary_batches_do_not_warn() -> None:
    _, placed, warned = run_both(Indexed(6), None, 2)
    assert all(p and all(p) for p in placed)
    assert warned == []


# --------------------------------------------------------------------------- pin_memory()


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("collate_fn", [to_custom, to_mixed], ids=["custom", "mixed"])
def test_custom_batch_is_pinned_by_itself_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, collate_fn: Any, num_workers: int
) -> None:
    monkeypatch.setattr(opaque, "torch_would_pin", lambda: True)
    dataset = Indexed(8)
    kw: dict[str, Any] = {"batch_size": 2, "num_workers": num_workers, "collate_fn": collate_fn}
    ref = torch.utils.data.DataLoader(dataset, **kw)
    pin: pinpool.DataLoader[Any] = pinpool.DataLoader(dataset, **kw)
    n = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for r, p in zip(ref, pin, strict=True):
            same(r, p)
            custom = p if collate_fn is to_custom else p["custom"]
            assert custom.pins == 1, "its pin_memory() was not called exactly once"
            assert not any(in_pool(pin.pool, a) for a in arrays(custom))
            if collate_fn is to_mixed:
                assert in_pool(pin.pool, p["x"]), "the ordinary tensor is not in the pool"
            n += 1
    assert n == 4
    warned = ours(caught)
    assert len(warned) == 1, warned
    assert "test_custom_batches.SimpleCustomBatch" in warned[0]
    assert "pinned by its own pin_memory()" in warned[0]
    # The warning points at the loop that takes the batches, not at pinpool or torch.
    (where,) = [w for w in caught if str(w.message) == warned[0]]
    assert where.filename == __file__
    assert where.category is UserWarning
    del r, p, custom


def test_custom_batch_without_accelerator_is_left_alone_with_a_warning() -> None:
    """Where torch would not pin (no accelerator here), neither is pin_memory() called."""
    if opaque.torch_would_pin():
        pytest.skip("an accelerator is present: torch would pin")
    pin, _, warned = run_both(Indexed(6), to_custom, 2)
    assert pin.stats()["batches"] == 3
    assert len(warned) == 1, warned
    assert "SimpleCustomBatch" in warned[0] and "not called" in warned[0]


def test_warned_once_per_type_across_loaders(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(opaque, "torch_would_pin", lambda: True)
    _, _, first = run_both(Indexed(4), to_custom, 0)
    _, _, second = run_both(Indexed(4), to_custom, 0)
    assert len(first) == 1 and second == []


# --------------------------------------------------------------------------- the tree walk


@dataclasses.dataclass(frozen=True, slots=True)
class Frozen:
    x: Any
    extra: Any


@dataclasses.dataclass
class Unset:
    a: Any
    b: Any = dataclasses.field(init=False)
    c: Any = 3


class Uncopyable:
    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("cannot copy")


@dataclasses.dataclass
class Guarded(Uncopyable):
    a: Any


def test_tree_walks_dataclasses_in_field_order() -> None:
    seen: list[Any] = []

    def leaf(obj: Any) -> Any:
        if isinstance(obj, str):
            seen.append(obj)
            return obj.upper()
        return KEEP

    original = Frozen("x", {"idx": "i", "n": Unset("a", c=("c",))})
    out = map_leaves(original, leaf)
    assert seen == ["x", "i", "a", "c"]
    assert type(out) is Frozen and out.x == "X" and out.extra["idx"] == "I"
    inner = out.extra["n"]
    assert (inner.a, inner.c) == ("A", ("C",)) and not hasattr(inner, "b")
    assert original.x == "x" and original.extra["n"].a == "a", "the input was changed"
    # A dataclass type is not an instance; exact mode (streaming) leaves dataclasses whole.
    assert map_leaves(Frozen, leaf) is Frozen
    assert map_leaves([original], leaf, exact=True)[0] is original
    # One that cannot be copied is kept whole (and handed to ``kept``).
    guarded = Guarded("g")
    assert map_leaves(guarded, leaf) is guarded
    assert map_leaves(guarded, leaf, kept=lambda o: "kept") == "kept"


def test_codec_round_trip_of_a_dataclass() -> None:
    batch = to_dataclass([Indexed(3)[i] for i in range(3)])
    p = codec.plan(batch)
    assert len(p.specs) == 3, "x, idx and total are leaves"
    assert type(p.tree) is Node and type(p.tree.how) is DataBatch
    assert isinstance(p.tree.children["x"], codec.Leaf) and p.tree.how.x is None
    base = torch.zeros(p.nbytes, dtype=torch.uint8)
    codec.write(p, base)
    same(batch, leaves.rebuild(p.tree, leaves.host_leaves(p.specs, base.numpy(), p.nbytes)))


# --------------------------------------------------------------------------- torch's hook wins


@dataclasses.dataclass
class PinningBatch:
    """A dataclass that pins itself: torch's loader calls its ``pin_memory()`` (it does not
    walk dataclasses), so pinpool must call it rather than walk its fields."""

    x: torch.Tensor
    idx: torch.Tensor
    pins: int = 0

    def pin_memory(self) -> PinningBatch:
        if torch.accelerator.is_available():
            self.x = self.x.pin_memory()
        self.pins += 1
        return self


@dataclasses.dataclass
class BrokenHook:
    """A dataclass whose ``pin_memory`` is data, not a method: torch's call raises
    ``TypeError``."""

    x: torch.Tensor
    pin_memory: bool = True


def to_pinning(samples: list[dict[str, Any]]) -> PinningBatch:
    return PinningBatch(
        torch.stack([s["x"] for s in samples]), torch.tensor([s["idx"] for s in samples])
    )


def to_broken(samples: list[dict[str, Any]]) -> BrokenHook:
    return BrokenHook(torch.stack([s["x"] for s in samples]))


class NotCallableHook:
    """Not a dataclass: an object whose ``pin_memory`` attribute is None."""

    def __init__(self, samples: list[dict[str, Any]]) -> None:
        self.x = torch.stack([s["x"] for s in samples])
        self.pin_memory = None


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataclass_with_pin_memory_has_it_called(
    monkeypatch: pytest.MonkeyPatch, num_workers: int
) -> None:
    monkeypatch.setattr(opaque, "torch_would_pin", lambda: True)
    dataset = Indexed(6)
    kw: dict[str, Any] = {"batch_size": 2, "num_workers": num_workers, "collate_fn": to_pinning}
    ref = torch.utils.data.DataLoader(dataset, **kw)
    pin: pinpool.DataLoader[Any] = pinpool.DataLoader(dataset, **kw)
    n = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for r, p in zip(ref, pin, strict=True):
            assert type(p) is PinningBatch
            assert p.pins == 1, "its pin_memory() was not called exactly once"
            same(r.x, p.x)
            same(r.idx, p.idx)
            assert not in_pool(pin.pool, p.x), "its fields were walked into the pool"
            n += 1
    assert n == 3
    warned = ours(caught)
    assert len(warned) == 1 and "PinningBatch" in warned[0], warned
    # Where torch would not pin, the method is not called and the dataclass is not walked.
    monkeypatch.setattr(opaque, "_warned", set())
    monkeypatch.setattr(opaque, "torch_would_pin", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for p in pinpool.DataLoader(dataset, **kw):
            assert p.pins == 0
    del r, p


def test_the_tree_walk_keeps_a_dataclass_with_pin_memory_whole() -> None:
    batch = to_pinning([Indexed(3)[i] for i in range(2)])
    p = codec.plan(batch)
    assert p.specs == [] and p.tree is batch
    assert map_leaves(batch, lambda o: KEEP, kept=lambda o: "kept") == "kept"
    # Without the hook a dataclass is still walked.
    assert len(codec.plan(to_dataclass([Indexed(3)[i] for i in range(2)])).specs) == 3


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("collate_fn", [to_broken, NotCallableHook], ids=["dataclass", "object"])
def test_a_pin_memory_that_is_not_callable_raises_type_error(
    monkeypatch: pytest.MonkeyPatch, collate_fn: Any, num_workers: int
) -> None:
    # torch's pin_memory calls it: 'bool' object is not callable.
    monkeypatch.setattr(opaque, "torch_would_pin", lambda: True)
    loader = pinpool.DataLoader(
        Indexed(4), batch_size=2, num_workers=num_workers, collate_fn=collate_fn
    )
    with pytest.raises(TypeError, match="pin_memory"):
        next(iter(loader))
    # Where torch would not pin, it does not call it: the batch comes through as it is.
    monkeypatch.setattr(opaque, "torch_would_pin", lambda: False)
    monkeypatch.setattr(opaque, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = next(iter(pinpool.DataLoader(Indexed(4), batch_size=2, collate_fn=collate_fn)))
    assert type(got) is collate_fn if isinstance(collate_fn, type) else type(got) is BrokenHook
