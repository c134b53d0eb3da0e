"""Every batch type torch's DataLoader carries comes back from pinpool's as torch's gives it, in
every mode: ``PackedSequence``; namedtuples whose constructor checks its fields; dataclasses
with ``__post_init__`` checks; torch's structseq results (``torch.sort``); dict subclasses (one
with attribute access), ``OrderedDict`` key order, ``defaultdict``; objects with their own
``pin_memory()``, which torch calls where it pins. A hypothesis property test nests them at
random and compares pinpool's batches with torch's loader's, type for type and value for value;
arrays in the containers pinpool takes apart are in its arena, and wherever torch's batch holds
a pinned tensor, pinpool's does too (on a GPU machine)."""

from __future__ import annotations

import collections
import copy
import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.utils.data
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from loader_datasets import in_pool
from torch.nn.utils.rnn import PackedSequence, pack_sequence

import pinpool
from pinpool._main.route import opaque

#: torch's own answer, whatever a test's mode makes pinpool believe (``fake_pin_thread``).
_ACCELERATOR = torch.accelerator.is_available

# --------------------------------------------------------------------------- the types


class CheckedPair(collections.namedtuple("CheckedPairBase", ["x", "y"])):
    """A namedtuple whose constructor refuses anything but a tensor for ``x``."""

    __slots__ = ()

    def __new__(cls, x: Any, y: Any) -> CheckedPair:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"CheckedPair.x must be a tensor, not {type(x).__name__}")
        return super().__new__(cls, x, y)


@dataclasses.dataclass
class Checked:
    """A dataclass whose ``__post_init__`` refuses anything but a tensor for ``x``."""

    x: torch.Tensor
    tag: Any

    def __post_init__(self) -> None:
        if not isinstance(self.x, torch.Tensor):
            raise TypeError(f"Checked.x must be a tensor, not {type(self.x).__name__}")


class AttrDict(dict):  # type: ignore[type-arg]
    """A dict whose keys are attributes too."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class SelfPinning:
    """An object torch cannot look into, with its own ``pin_memory()`` (torch's hook)."""

    def __init__(self, x: torch.Tensor, calls: int = 0) -> None:
        self.x = x
        self.calls = calls

    def pin_memory(self) -> SelfPinning:
        x = self.x.pin_memory() if _ACCELERATOR() else self.x
        return SelfPinning(x, self.calls + 1)


# --------------------------------------------------------------------------- making batches


def _tensor(seed: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 0.5 + seed


def build(spec: Any, seed: int) -> Any:
    """The batch ``spec`` describes, its tensors made from ``seed`` (a batch's index)."""
    kind, children = spec
    if kind == "tensor":
        return _tensor(seed, children)
    if kind == "int":
        return seed * 7 + children
    made = [build(child, seed + i + 1) for i, child in enumerate(children)]
    keys = [f"k{(i * 5) % 11}" for i in range(len(made))]  # (not in sorted order)
    if kind == "list":
        return made
    if kind == "tuple":
        return tuple(made)
    if kind == "dict":
        return dict(zip(keys, made, strict=False))
    if kind == "ordered":
        return collections.OrderedDict(reversed(list(zip(keys, made, strict=False))))
    if kind == "defaultdict":
        out: collections.defaultdict[str, Any] = collections.defaultdict(list)
        out.update(zip(keys, made, strict=False))
        return out
    if kind == "attrdict":
        return AttrDict(zip(keys, made, strict=False))
    if kind == "checked_pair":
        return CheckedPair(_tensor(seed, 3), made)
    if kind == "checked":
        return Checked(_tensor(seed, 2), made)
    if kind == "sort":
        return torch.sort(_tensor(seed, 5).flip(0))
    if kind == "packed":
        return pack_sequence([_tensor(seed, n) for n in (4, 2, 1)])
    if kind == "self_pinning":
        return SelfPinning(_tensor(seed, 4))
    raise AssertionError(kind)


_LEAVES = st.one_of(
    st.tuples(st.just("tensor"), st.integers(0, 64)),
    st.tuples(st.just("int"), st.integers(0, 9)),
    st.tuples(st.sampled_from(["sort", "packed", "self_pinning"]), st.just(())),
)
_CONTAINERS = ["list", "tuple", "dict", "ordered", "defaultdict", "attrdict", "checked_pair"]
SPECS = st.recursive(
    _LEAVES,
    lambda inner: st.tuples(
        st.sampled_from([*_CONTAINERS, "checked"]), st.lists(inner, min_size=1, max_size=3)
    ),
    max_leaves=8,
)


class Specs(torch.utils.data.Dataset[Any]):
    """Item ``i``: the spec of batch ``i`` and ``i`` (its seed)."""

    def __init__(self, specs: list[Any]) -> None:
        self.specs = specs

    def __len__(self) -> int:
        return len(self.specs)

    def __getitem__(self, i: int) -> Any:
        return self.specs[i], i


def build_one(samples: list[Any]) -> Any:
    """collate_fn: the batch of the one sample's spec."""
    ((spec, seed),) = samples
    return build(spec, seed)


# --------------------------------------------------------------------------- comparing


def assert_as_torch(ref: Any, got: Any, pool: Any, taken_apart: bool, path: str = "b") -> None:
    """``got`` (pinpool's) is ``ref`` (torch's): the same types, values, key order and
    defaultdict factory; each tensor pinned where torch's is; each tensor of a container
    pinpool takes apart (``taken_apart``) in its arena."""
    assert type(got) is type(ref), f"{path}: {type(got)} where torch gives {type(ref)}"
    if isinstance(ref, torch.Tensor):
        assert got.dtype == ref.dtype and torch.equal(got, ref), path
        if ref.is_pinned():
            assert got.is_pinned(), f"{path}: not pinned where torch's is"
        if taken_apart and pool is not None and ref.numel():
            assert in_pool(pool, got), f"{path}: not in the arena"
        return
    if isinstance(ref, SelfPinning):
        assert got.calls == ref.calls, f"{path}: pin_memory() called {got.calls} times"
        assert_as_torch(ref.x, got.x, pool, False, f"{path}.x")
        return
    if isinstance(ref, dict):
        assert list(got) == list(ref), f"{path}: keys {list(got)} where torch gives {list(ref)}"
        if isinstance(ref, collections.defaultdict):
            assert got.default_factory is ref.default_factory, path
        for key in ref:
            assert_as_torch(ref[key], got[key], pool, taken_apart, f"{path}[{key!r}]")
        return
    if dataclasses.is_dataclass(ref):
        for field in dataclasses.fields(ref):
            name = field.name
            assert_as_torch(getattr(ref, name), getattr(got, name), pool, taken_apart, name)
        return
    if isinstance(ref, (list, tuple)):
        assert len(got) == len(ref), path
        inside = taken_apart and not isinstance(ref, PackedSequence)  # (it pins itself)
        for i, (r, g) in enumerate(zip(ref, got, strict=False)):
            assert_as_torch(r, g, pool, inside, f"{path}[{i}]")
        return
    assert got == ref, path


def torch_batches(dataset: Any, **kwargs: Any) -> list[Any]:
    """torch's DataLoader's batches, with torch's own view of the machine (as a user has it)."""
    real = torch.accelerator.is_available
    torch.accelerator.is_available = _ACCELERATOR  # type: ignore[method-assign]
    try:
        loader = torch.utils.data.DataLoader(dataset, pin_memory=_ACCELERATOR(), **kwargs)
        return list(loader)
    finally:
        torch.accelerator.is_available = real  # type: ignore[method-assign]


def _faked() -> bool:
    """Whether pinpool believes torch pins where torch does not (``fake_pin_thread``)."""
    return opaque.torch_would_pin() and not _ACCELERATOR()


def _unpacked(spec: Any) -> Any:
    """``spec`` with a tensor for each PackedSequence, whose ``pin_memory()`` pins for real
    (no accelerator here when ``_faked``)."""
    kind, children = spec
    if kind == "packed":
        return ("tensor", 4)
    if isinstance(children, list):
        return (kind, [_unpacked(c) for c in children])
    return spec


def compare(specs: list[Any], num_workers: int) -> None:
    if _faked():
        specs = [_unpacked(spec) for spec in specs]
    dataset = Specs(specs)
    kwargs: dict[str, Any] = {"batch_size": 1, "collate_fn": build_one, "num_workers": num_workers}
    ref = torch_batches(dataset, **kwargs)
    loader = pinpool.DataLoader(dataset, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (PackedSequence and SelfPinning pin themselves)
        got = list(loader)
    assert len(got) == len(ref)
    for i, (r, g) in enumerate(zip(ref, got, strict=False)):
        if _faked():
            r = _called(r)
        assert_as_torch(r, g, loader.pool, loader.stats()["overflow_batches"] == 0, f"batch{i}")


def _called(batch: Any) -> Any:
    """torch's batch, made without pinning, as torch makes it where it pins: each
    ``SelfPinning`` after its ``pin_memory()``."""
    if isinstance(batch, SelfPinning):
        return SelfPinning(batch.x, batch.calls + 1)
    if type(batch) in (list, tuple):
        return type(batch)(_called(v) for v in batch)
    if type(batch) is CheckedPair:
        return CheckedPair(*(_called(v) for v in batch))
    if isinstance(batch, dict):
        clone = copy.copy(batch)
        clone.update((k, _called(v)) for k, v in batch.items())
        return clone
    return batch  # (a dataclass too: torch's pin_memory leaves it whole, calling nothing in it)


# --------------------------------------------------------------------------- the tests

_SETTINGS = settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


#: An object that pins itself inside a dataclass: torch's pin_memory leaves the dataclass
#: whole and calls nothing in it (the case the GPU machine found).
_IN_A_DATACLASS = [("checked", [("self_pinning", ())])]


@pytest.mark.every_mode
@_SETTINGS
@given(specs=st.lists(SPECS, min_size=1, max_size=8))
@example(specs=_IN_A_DATACLASS)
def test_nested_batch_types_come_back_as_torchs_with_workers(loader_mode: Any, specs: Any) -> None:
    compare(specs, num_workers=2)


@pytest.mark.every_mode
@settings(max_examples=25, deadline=None, suppress_health_check=_SETTINGS.suppress_health_check)
@given(specs=st.lists(SPECS, min_size=1, max_size=4))
@example(specs=_IN_A_DATACLASS)
def test_nested_batch_types_come_back_as_torchs_in_process(loader_mode: Any, specs: Any) -> None:
    compare(specs, num_workers=0)


class Samples(torch.utils.data.Dataset[Any]):
    """Samples of the types torch's ``default_collate`` walks into."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        big = torch.full((4096,), float(i))  # (big enough to be streamed)
        return {
            "pair": CheckedPair(big, torch.tensor(i)),
            "attr": AttrDict(a=big + 1, b=i),
            "ordered": collections.OrderedDict([("z", big), ("a", torch.tensor([i]))]),
        }


@pytest.mark.every_mode
@pytest.mark.parametrize("num_workers", [0, 2])
def test_samples_of_checked_types_collate_as_torchs(loader_mode: Any, num_workers: int) -> None:
    ref = torch_batches(Samples(), batch_size=3, num_workers=num_workers)
    loader = pinpool.DataLoader(Samples(), batch_size=3, num_workers=num_workers)
    got = list(loader)
    assert len(got) == len(ref) == 2
    for r, g in zip(ref, got, strict=False):
        assert_as_torch(r, g, loader.pool, True)


def test_a_packed_sequence_batch_is_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch an RNN user's first step takes: a ``PackedSequence``, as torch gives it."""
    monkeypatch.setattr(opaque, "_warned", set())  # (warned once per type and process)
    specs = [(("packed", ()), 0)] * 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = list(pinpool.DataLoader(specs, batch_size=1, collate_fn=build_one, num_workers=2))
    ref = torch_batches(specs, batch_size=1, collate_fn=build_one, num_workers=2)
    for r, g in zip(ref, got, strict=False):
        assert_as_torch(r, g, None, False)
    assert any("PackedSequence" in str(w.message) for w in caught), "no warning said why"
