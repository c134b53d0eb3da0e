"""The codec under the DataLoader: ``plan`` / ``write`` in the worker, ``checked_specs`` /
``host_leaves`` (``device_leaf``) / ``rebuild`` in the main process, and what happens to
corrupt descriptions (leaf specs, marked trees, whole ``BatchHandle`` objects):
``PinPoolError``, never a read outside the buffer, no slot or fd left behind."""

from __future__ import annotations

import collections
import gc
import math
import os
import pickle
import time
from typing import Any

import numpy as np
import pytest
import torch
from conftest import open_fds
from handles import HandleFactory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_datasets import (
    NUMPY_DTYPES,
    TORCH_DTYPES,
    Indexed,
    Pair,
    Record,
    assert_same,
    make_array,
)
from torch.utils.data import default_collate

import pinpool
from pinpool import OutOfBounds, PinPoolError
from pinpool._main.route.delivery import hand_to_consumer
from pinpool._wire import codec as _codec
from pinpool._wire import leaves as _leaves
from pinpool._wire.codec import ALIGN, Leaf, LeafSpec
from pinpool._wire.tree import Node

# --------------------------------------------------------------------------- generated batches


class Feature(torch.Tensor):
    """A tensor subclass: the codec restores it."""


@st.composite
def leaves(draw: Any) -> Any:
    kind = draw(st.sampled_from(["torch", "numpy", "torch", "numpy", "py"]))
    if kind == "py":
        return draw(
            st.one_of(
                st.integers(-(2**70), 2**70),
                st.floats(allow_nan=True),
                st.text(max_size=4),
                st.binary(max_size=4),
                st.none(),
            )
        )
    dtype = draw(st.sampled_from(TORCH_DTYPES if kind == "torch" else NUMPY_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    layout = draw(st.sampled_from(["contig", "transposed", "strided", "reversed"]))
    if kind == "torch" and layout == "reversed":
        layout = "contig"
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = make_array(kind, dtype, shape, layout, rng)
    if kind == "torch" and draw(st.booleans()) and draw(st.booleans()):
        x = x.as_subclass(Feature)
    return x


def batches() -> st.SearchStrategy[Any]:
    keys = st.text(alphabet="abc", min_size=1, max_size=2)
    return st.recursive(
        leaves(),
        lambda ch: st.one_of(
            st.dictionaries(keys, ch, max_size=3),
            st.lists(ch, max_size=3),
            st.lists(ch, max_size=3).map(tuple),
            st.tuples(ch, ch).map(lambda v: Pair(*v)),
            st.tuples(ch, ch, ch).map(lambda v: Record(*v)),
        ),
        max_leaves=8,
    )


def encode(batch: Any) -> tuple[Any, list[tuple], bytearray]:
    """What a worker sends: the marked tree and plain spec tuples; and the bytes."""
    p = _codec.plan(batch)
    buf = bytearray(p.nbytes)
    _codec.write(p, buf)
    return p.tree, [tuple(s) for s in p.specs], buf


def decode(tree: Any, specs: Any, buf: bytearray, limit: int | None = None) -> Any:
    checked = _leaves.checked_specs(specs, len(buf) if limit is None else limit)
    return _leaves.rebuild(tree, _leaves.host_leaves(checked, buf, len(buf)))


def check_layout(specs: list[LeafSpec], nbytes: int) -> None:
    end = 0
    for s in specs:
        assert s.offset % ALIGN == 0
        assert s.offset >= end, "leaves overlap"
        end = s.offset + s.nbytes
    assert nbytes == _codec.extent(specs) == end


SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------------- round trips


@SETTINGS
@given(batches())
def test_plan_write_rebuild_round_trip(batch: Any) -> None:
    p = _codec.plan(batch)
    check_layout(p.specs, p.nbytes)
    tree, specs, buf = encode(batch)
    # The tree and specs cross a process boundary by pickle.
    tree, specs = pickle.loads(pickle.dumps((tree, specs)))
    got = decode(tree, specs, buf)
    assert_same(batch, got)


@SETTINGS
@given(batches())
def test_device_leaves_match_host_leaves(batch: Any) -> None:
    """``device_leaf`` (slices and views of one flat copy, as on a GPU) and ``host_leaf``
    (numpy and ``from_numpy``) give the same torch leaves, checked on a CPU copy."""
    p = _codec.plan(batch)
    buf = bytearray(p.nbytes)
    _codec.write(p, buf)
    checked = _leaves.checked_specs(p.specs, len(buf))
    storage = torch.tensor(list(buf), dtype=torch.uint8)  # a copy, as .to(device) makes
    for spec, host in zip(checked, _leaves.host_leaves(checked, buf, len(buf)), strict=True):
        if spec.kind != "torch":
            continue
        copied = _leaves.device_leaf(storage, spec)
        assert type(copied) is type(host) and copied.dtype == host.dtype
        assert copied.shape == host.shape
        flat = [t.reshape(-1).view(torch.uint8) for t in (copied, host)]
        assert torch.equal(*flat)
        if spec.nbytes:
            assert copied.data_ptr() == storage.data_ptr() + spec.offset


def _check_layout(batch: Any) -> _leaves.DeviceLayout | None:
    """A batch's device layout, if any, checked against one view per leaf (``device_leaf``):
    the same leaves (type, dtype, shape, bytes), each where its spec puts it in the one
    allocation."""
    p = _codec.plan(batch)
    buf = bytearray(p.nbytes)
    _codec.write(p, buf)
    checked = _leaves.checked_specs(p.specs, len(buf))
    layout = _leaves.device_layout(checked, len(buf))
    if layout is None:
        return None
    storage = layout.allocate(torch.device("cpu"))
    assert storage.is_contiguous() and storage.nbytes >= len(buf)
    bytes_ = torch.tensor(list(buf), dtype=torch.uint8)
    storage.reshape(-1).view(torch.uint8)[: len(buf)] = bytes_
    views = layout.views(storage)
    assert len(views) == len(checked)
    for spec, view in zip(checked, views, strict=True):
        one = _leaves.device_leaf(bytes_, spec)
        assert type(view) is type(one) and view.dtype == one.dtype and view.shape == one.shape
        assert torch.equal(view.reshape(-1).view(torch.uint8), one.reshape(-1).view(torch.uint8))
        assert view.data_ptr() == storage.data_ptr() + spec.offset
    assert_same(batch, _leaves.rebuild(p.tree, views))
    return layout


@SETTINGS
@given(batches())
def test_a_device_layout_gives_the_leaves_one_view_each_would(batch: Any) -> None:
    """Where a batch has a device layout (one dtype, no numpy, empty or subclassed leaf), its
    leaves from one native call are those of one view per leaf; where it has none, a leaf
    needs a view of its own."""
    p = _codec.plan(batch)
    checked = _leaves.checked_specs(p.specs, p.nbytes)
    if _check_layout(batch) is None:
        assert (
            not checked
            or len({s.dtype for s in checked}) > 1
            or any(s.kind != "torch" or s.nbytes == 0 or s.subclass is not None for s in checked)
        )


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(["int64", "float32", "uint8", "bfloat16", "bool"]),
    st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=3), min_size=1, max_size=5),
)
def test_leaves_of_one_dtype_are_viewed_in_one_call(dtype: str, shapes: list[list[int]]) -> None:
    """A batch of tensors of one dtype (a dict of token ids, mask and labels): one allocation of
    that dtype, its leaves (gaps between them skipped) in one call; one leaf: the allocation."""
    rng = np.random.default_rng(len(shapes))
    batch = {
        f"k{i}": make_array("torch", dtype, tuple(shape), "contiguous", rng)
        for i, shape in enumerate(shapes)
    }
    layout = _check_layout(batch)
    assert layout is not None and layout.dtype == getattr(torch, dtype)
    if len(shapes) == 1:
        assert layout.like is None and layout.shape == tuple(shapes[0]), "the leaf itself"


def test_leaves_of_two_dtypes_are_viewed_one_by_one() -> None:
    assert _check_layout({"x": torch.zeros(3), "y": torch.zeros(2, dtype=torch.int64)}) is None
    assert _check_layout([torch.zeros(3), torch.zeros(0)]) is None, "an empty leaf"


@SETTINGS
@given(batches())
def test_write_into_a_tensor_buffer_with_slack(batch: Any) -> None:
    p = _codec.plan(batch)
    buf = torch.full((p.nbytes + 3 * ALIGN,), 0xAB, dtype=torch.uint8)
    _codec.write(p, buf)
    assert bool((buf[p.nbytes :] == 0xAB).all()), "write went past the plan's end"
    views = _leaves.host_leaves(_leaves.checked_specs(p.specs, len(buf)), buf.numpy(), len(buf))
    assert_same(batch, _leaves.rebuild(p.tree, views))


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(TORCH_DTYPES),
    st.lists(st.integers(0, 4), max_size=3),
    st.integers(1, 4),
    st.integers(0, 2**32 - 1),
)
def test_deferred_stack_equals_default_collate(
    dtype: str, shape: list[int], n: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    samples = [
        {"x": make_array("torch", dtype, tuple(shape), "strided", rng), "i": i, "s": str(i)}
        for i in range(n)
    ]
    deferred = _codec.default_collate_deferred(samples)
    assert isinstance(deferred["x"], _codec.Stack)
    tree, specs, buf = encode(deferred)
    assert_same(default_collate(samples), decode(tree, specs, buf))


def written(p: _codec.LayoutPlan, threads: int) -> bytes:
    buf = bytearray(b"\xab" * (p.nbytes + ALIGN))
    _codec.write(p, buf, threads)
    return bytes(buf)


@SETTINGS
@given(
    batches(),
    st.sampled_from(TORCH_DTYPES),
    st.lists(st.integers(0, 4), max_size=3),
    st.integers(1, 5),
    st.sampled_from(["contig", "transposed", "strided"]),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_threaded_write_matches_the_plain_one(
    batch: Any, dtype: str, shape: list[int], n: int, layout: str, conj: bool, seed: int
) -> None:
    """Copy threads (``_native._gather``, here for arrays of any size) write the same bytes
    as torch and numpy do, for plain arrays and deferred stacks, falling back where a stack
    is not contiguous or a complex tensor is lazily conjugated."""
    rng = np.random.default_rng(seed)
    items = [make_array("torch", dtype, tuple(shape), layout, rng) for _ in range(n)]
    if conj and items[0].is_complex():
        items = [t.conj() for t in items]
    stacked = _codec.default_collate_deferred([{"x": t, "i": i} for i, t in enumerate(items)])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_codec, "GATHER_MIN", 0)
        for b in (batch, stacked):
            p = _codec.plan(b)
            assert written(p, 3) == written(p, 1)


def test_contiguous_stacks_and_arrays_are_gathered() -> None:
    items = [torch.full((3, 5), i, dtype=torch.int16) for i in range(4)]
    stack = _codec.default_collate_deferred(items)
    p = _codec.plan({"s": stack, "n": np.arange(6.0), "t": items[0].T})
    pieces = [_codec._gather_items(src, spec) for spec, src in zip(p.specs, p.sources, strict=True)]
    assert pieces[0] == [(t.data_ptr(), 30, 30 * i) for i, t in enumerate(items)]
    assert pieces[1] is not None and pieces[1][0][1:] == (48, 0)
    assert pieces[2] is None  # a transposed view goes through torch


def test_gather_refuses_bad_destinations() -> None:
    src = np.arange(64, dtype=np.uint8)
    addr = src.ctypes.data
    target = bytearray(100)
    assert pinpool._native._gather(target, [(addr, 64, 36)], 2) == 64
    assert bytes(target[36:]) == src.tobytes()
    for items in (
        [(addr, 64, 37)],  # one byte past the end
        [(addr, 8, 1 << 63), (addr, 8, 0)],  # far out, and wraps
        [(addr, 32, 0), (addr, 32, 16)],  # overlapping destinations
        [(0, 8, 0)],  # a null source
    ):
        with pytest.raises(PinPoolError):
            pinpool._native._gather(target, items, 2)
    with pytest.raises(PinPoolError):
        pinpool._native._gather(bytes(100), [(addr, 8, 0)], 2)  # read-only target


def test_containers_are_rebuilt_with_their_types() -> None:
    t = torch.arange(6).reshape(2, 3)
    dd: collections.defaultdict[str, Any] = collections.defaultdict(list, a=t)
    batch = {
        "ordered": collections.OrderedDict(b=t, a=t.T),
        "default": dd,
        "size": torch.Size([2, 3]),
        "pair": Pair(t, [t, "s"]),
        "nested": [(t, None), {"k": (b"x", 1.5)}],
        "np": np.arange(4, dtype=np.int32)[::-1],
        "sub": t.as_subclass(Feature),
    }
    tree, specs, buf = encode(batch)
    got = decode(tree, specs, buf)
    assert_same(batch, got)
    assert got["default"].default_factory is list
    assert type(got["sub"]) is Feature
    # The batch's own containers were not touched.
    assert batch["nested"][0][0] is t


def test_non_array_leaves_are_kept_in_the_tree() -> None:
    t = torch.ones(2, requires_grad=True)  # not plain: travels in the tree
    sparse = torch.eye(2).to_sparse()
    batch = {"grad": t, "sparse": sparse, "obj": np.array(["a", "b"]), "x": torch.zeros(3)}
    p = _codec.plan(batch)
    assert len(p.specs) == 1
    assert p.tree["grad"] is t and p.tree["sparse"] is sparse and p.tree["obj"] is batch["obj"]


def test_empty_and_scalar_batches() -> None:
    for batch in ({}, [], (), None, 3, "s", torch.tensor(2.5), np.float32(1), torch.empty(0, 3)):
        tree, specs, buf = encode(batch)
        got = decode(tree, specs, buf)
        if isinstance(batch, np.generic):  # a numpy scalar is not an array leaf
            assert got == batch
        else:
            assert_same(batch, got)


# --------------------------------------------------------------------------- corrupt specs

GOOD = (64, 40, "torch", "float32", (10,), None)


def replace(**kw: Any) -> tuple:
    fields = dict(zip(LeafSpec._fields, GOOD, strict=True))
    fields.update(kw)
    return tuple(fields.values())


@pytest.mark.parametrize(
    "specs",
    [
        pytest.param("not a list", id="specs-not-a-list"),
        pytest.param([replace(offset=-64)], id="negative-offset"),
        pytest.param([replace(offset=72)], id="misaligned-offset"),
        pytest.param([replace(offset=1)], id="odd-offset"),
        pytest.param([replace(nbytes=44)], id="nbytes-too-big-for-shape"),
        pytest.param([replace(nbytes=36)], id="nbytes-too-small-for-shape"),
        pytest.param([replace(nbytes=0, shape=(0,), offset=256)], id="empty-leaf-past-limit"),
        pytest.param([replace(offset=192)], id="leaf-past-limit"),
        pytest.param([replace(shape=(2**40, 2**40), nbytes=2**82)], id="huge-shape"),
        pytest.param([replace(shape=(-2, -5), nbytes=40)], id="negative-dims"),
        pytest.param([replace(shape=5)], id="shape-not-a-sequence"),
        pytest.param([replace(shape=("a",))], id="shape-not-ints"),
        pytest.param([replace(dtype="float128")], id="unknown-torch-dtype"),
        pytest.param([replace(kind="numpy", dtype="not a dtype")], id="unknown-numpy-dtype"),
        pytest.param([replace(kind="numpy", dtype="O")], id="numpy-object-dtype"),
        pytest.param([replace(kind="numpy", dtype="i4,i4")], id="numpy-structured-dtype"),
        pytest.param([replace(kind="numpy", dtype="U10")], id="numpy-unicode-dtype"),
        pytest.param([replace(kind="cuda")], id="unknown-kind"),
        pytest.param([replace(subclass=int)], id="subclass-not-a-tensor-type"),
        pytest.param([replace(subclass=np.ndarray)], id="subclass-ndarray"),
        pytest.param([replace(subclass="torch.Tensor")], id="subclass-a-string"),
        pytest.param([(64, 40, "torch", "float32", (10,))], id="too-few-fields"),
        pytest.param([(*GOOD, 0)], id="too-many-fields"),
        pytest.param([None], id="leaf-is-none"),
        pytest.param([GOOD, replace(offset=128, nbytes=80, shape=(20,))], id="second-leaf-past"),
    ],
)
def test_corrupt_specs_raise_out_of_bounds(specs: Any) -> None:
    with pytest.raises(OutOfBounds, match="corrupt batch description"):
        _leaves.checked_specs(specs, 160)
    assert issubclass(OutOfBounds, PinPoolError)


def test_good_specs_pass_and_convert() -> None:
    raw = [GOOD, ("128", 8.0, "numpy", "<i4", [2], None), (0, 0, "torch", "bool", (0, 7), None)]
    out = _leaves.checked_specs(raw, 136)
    assert out[1] == LeafSpec(128, 8, "numpy", "<i4", (2,), None)
    assert all(isinstance(s, LeafSpec) for s in out)
    assert _leaves.checked_specs([replace(subclass=Feature)], 104)[0].subclass is Feature


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(replace(dtype=["float32"]), id="unhashable-dtype"),
        pytest.param(replace(shape=(math.inf,)), id="infinite-dim"),
        pytest.param(replace(offset=math.inf), id="infinite-offset"),
        pytest.param(replace(nbytes=math.inf), id="infinite-nbytes"),
    ],
)
def test_corrupt_field_types_raise_out_of_bounds(spec: tuple) -> None:
    with pytest.raises(OutOfBounds):
        _leaves.checked_specs([spec], 160)


raw_specs = st.tuples(
    st.one_of(st.integers(-256, 1024), st.integers(0, 16).map(lambda k: k * ALIGN)),
    st.integers(-8, 1024),
    st.sampled_from(["torch", "numpy"]),
    st.sampled_from([*TORCH_DTYPES, "<f8", ">i2", "?", "<c8", "u1", "float128"]),
    st.lists(st.integers(-1, 40), max_size=3).map(tuple),
    st.sampled_from([None, Feature, int]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(raw_specs, max_size=4), st.integers(0, 600))
def test_specs_that_pass_never_reach_past_the_limit(specs: list[tuple], limit: int) -> None:
    """Any spec list either raises OutOfBounds or gives views inside the first ``limit``
    bytes of the buffer (which is longer, to catch a view that strays past the limit)."""
    try:
        checked = _leaves.checked_specs(specs, limit)
    except OutOfBounds:
        return
    buf = torch.zeros(limit + 4096, dtype=torch.uint8)
    lo, hi = buf.data_ptr(), buf.data_ptr() + limit
    views = _leaves.host_leaves(checked, buf.numpy(), limit)
    for spec, view in zip(checked, views, strict=True):
        assert spec.offset + spec.nbytes <= limit
        if spec.nbytes == 0:
            continue
        if isinstance(view, np.ndarray):
            start = view.__array_interface__["data"][0]
        else:
            start = view.data_ptr()
        assert lo <= start and start + view.nbytes <= hi, spec


@pytest.mark.parametrize("stacked", [False, True])
def test_write_zero_dim_uint8_tensor(stacked: bool) -> None:
    """Regression (fa3b6f9's gather path raised BufferError('shape is null'))."""
    label = torch.tensor(7, dtype=torch.uint8)
    batch = _codec.default_collate_deferred([label, label]) if stacked else label
    tree, specs, buf = encode(batch)
    assert_same(default_collate([label, label]) if stacked else label, decode(tree, specs, buf))


@pytest.mark.parametrize("stacked", [False, True])
def test_write_one_element_strided_tensor(stacked: bool) -> None:
    """Regression: a one-element tensor whose stride is not 1 is contiguous for torch, but
    cannot be viewed as bytes (fa3b6f9's gather path raised RuntimeError)."""
    x = torch.tensor([1.5, 2.5])[::2]
    assert x.is_contiguous() and x.stride() == (2,)
    batch = _codec.default_collate_deferred([x, x]) if stacked else x
    tree, specs, buf = encode(batch)
    assert_same(default_collate([x, x]) if stacked else x, decode(tree, specs, buf))


def test_rebuild_with_a_missing_leaf() -> None:
    views = [torch.zeros(1), torch.ones(1)]
    pair = Node("namedtuple", Pair, [Leaf(5), None])
    for tree in ({"a": Leaf(2)}, [Leaf(0), Leaf(-1)], (Leaf(10**9),), pair):
        with pytest.raises(OutOfBounds, match="does not exist"):
            _leaves.rebuild(tree, views)
    assert _leaves.rebuild([Leaf(1), Leaf(0)], views)[0] is views[1]
    # The main process walks into exact builtins and Node records only: a namedtuple in the
    # received skeleton is an object kept whole, never made again with markers.
    kept = Pair(Leaf(5), None)
    assert _leaves.rebuild([kept], views, lambda o: ("kept", o))[0] == ("kept", kept)


# --------------------------------------------------------------------------- corrupt handles


@pytest.fixture
def live_loader() -> Any:
    # slot_bytes makes the pool at once: no batch needs to run first.
    loader = pinpool.DataLoader(Indexed(4), batch_size=2, slot_bytes=1 << 20, num_slots=2)
    yield loader
    del loader
    gc.collect()


def assert_all_free(loader: pinpool.DataLoader) -> None:
    # (A batch dropped while a copy thread still fills its slot frees it once the copy ends.)
    deadline = time.monotonic() + 10
    while True:
        gc.collect()
        s = loader.stats()
        free = s["slots_checked_out"] == 0 and s["slots_free"] == loader.pool.num_slots
        if free or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert free, s


def test_a_good_hand_made_handle_decodes(live_loader: Any) -> None:
    make = HandleFactory(live_loader)
    h = make.make(worker=7)
    # (hand_to_consumer: what the consumer's thread does with what the pin thread made.)
    assert_same(make.batch, hand_to_consumer(h.pin_memory()))
    assert_all_free(live_loader)
    # The segment was handed back: the same key can carry the next batch.
    make.write()
    assert_same(make.batch, hand_to_consumer(make.make(worker=7, announce=False).pin_memory()))
    assert_all_free(live_loader)


def corrupt_handles(make: HandleFactory) -> dict[str, Any]:
    seg = make.segment
    bad_spec = [(-64, 40, "torch", "float32", (10,), None)]
    far = [(1 << 17, 40, "torch", "float32", (10,), None)]
    return {
        "unknown-segment": lambda: make.make(announce=False),
        "bad-nonce": lambda: make.make(nonce=seg.nonce ^ 1),
        "longer-than-the-file": lambda: make.make(total_len=seg.total_len + 4096),
        "no-data-area": lambda: make.make(total_len=4096),
        "not-a-segment-fd": lambda: make.make(origin=(os.getpid(), 0)),
        "negative-offset": lambda: make.make(specs=bad_spec),
        "specs-not-a-list": lambda: make.make(specs="abc"),
        "unknown-dtype": lambda: make.make(specs=[(0, 40, "torch", "float128", (10,), None)]),
        "not-a-tensor-type": lambda: make.make(specs=[(0, 40, "torch", "float32", (10,), int)]),
        "leaf-index-out-of-range": lambda: make.make(tree={"a": Leaf(7)}),
        # Claims a longer segment than the one mapped: the leaf passes checked_specs but the
        # copy is checked against the real mapping.
        "lies-about-its-length": lambda: make.make(
            worker=7, announce=False, total_len=1 << 30, specs=far
        ),
        "bigger-than-a-slot": lambda: make.make(
            worker=7,
            announce=False,
            total_len=1 << 30,
            specs=[(0, 4 << 20, "torch", "uint8", (4 << 20,), None)],
        ),
        "dead-loader": lambda: make.make(token="0" * 32),
    }


def test_corrupt_handles_raise_pinpool_errors(live_loader: Any) -> None:
    make = HandleFactory(live_loader)
    hand_to_consumer(make.make(worker=7).pin_memory())  # segment key 7 known, for the cases below
    for name, build in corrupt_handles(make).items():
        fds = open_fds()
        make.segment.abandon()
        make.write()
        with pytest.raises(PinPoolError) as info:
            build().take()  # on the consumer's thread: every rule applies
        del info
        gc.collect()
        # (New descriptors only: background threads may close earlier tests' meanwhile.)
        assert not open_fds() - fds, f"{name}: fd leaked"
        assert_all_free(live_loader)
    # The loader still works after all that.
    assert [b["idx"].tolist() for b in live_loader] == [[0, 1], [2, 3]]
    assert_all_free(live_loader)
    live_loader.pool.flush()
    s = live_loader.stats()
    assert s["pending_unmaps"] == 0


@pytest.mark.parametrize("ahead", [True, False], ids=["pin-thread", "consumer"])
def test_a_handle_claiming_more_than_its_segment_is_refused_before_memory_is_taken(
    live_loader: Any, ahead: bool
) -> None:
    """A handle naming a segment mapped before, with a length it does not have, is refused
    (on torch's pin thread, ``pin_memory()``, as on the consumer's): no memory is taken for
    what it claims, and nothing is held."""
    make = HandleFactory(live_loader)
    make.make(worker=7).pin_memory()
    make.segment.abandon()
    make.write()
    handle = corrupt_handles(make)["bigger-than-a-slot"]()
    arena = live_loader.pool.arena_bytes
    with pytest.raises(pinpool.OutOfBounds, match="is not 1073741824 bytes long"):
        handle.pin_memory() if ahead else handle.take()
    assert live_loader.stats()["oversize_batches"] == 0
    assert live_loader.pool.arena_bytes == arena
    del handle
    gc.collect()
    assert_all_free(live_loader)


ODD_TYPES = {
    "negative-worker": {"worker": -1},
    "worker-not-an-int": {"worker": "w"},
    "total-len-not-a-number": {"total_len": "abc"},
    "negative-nonce": {"nonce": -5},
}


@pytest.mark.parametrize("override", ODD_TYPES.values(), ids=ODD_TYPES.keys())
def test_malformed_handle_fields_leak_no_fd(live_loader: Any, override: dict) -> None:
    make = HandleFactory(live_loader)
    fds = open_fds()
    with pytest.raises(Exception):  # noqa: B017 - any error; the fd count is the point
        make.make(**override).pin_memory()
    gc.collect()
    assert not open_fds() - fds
    assert_all_free(live_loader)


@pytest.mark.parametrize("override", ODD_TYPES.values(), ids=ODD_TYPES.keys())
def test_malformed_handle_fields_raise_pinpool_error(live_loader: Any, override: dict) -> None:
    make = HandleFactory(live_loader)
    with pytest.raises(PinPoolError):
        make.make(**override).pin_memory()


def test_a_corrupt_leaf_is_named_without_contradicting_itself() -> None:
    with pytest.raises(OutOfBounds, match="holds 16 bytes, not the 20 it says"):
        _leaves.checked_specs([(0, 20, "torch", "float32", (4,), None)], 1024)
    with pytest.raises(OutOfBounds, match="ends at byte 1040, past the 1024 bytes"):
        _leaves.checked_specs([(1024, 16, "torch", "float32", (4,), None)], 1024)


def test_a_corrupt_node_is_refused() -> None:
    for node in (
        Node("bogus", list, []),
        Node("namedtuple", Pair, [1, 2, 3]),
        Node("namedtuple", "not a type", [1, 2]),
        Node("mapping", dict, [1]),
        Node("mutable_mapping", object(), {"a": 1}),
        Node("mutable_sequence", 7, [1]),
    ):
        with pytest.raises(OutOfBounds, match="corrupt batch description"):
            _leaves.rebuild([node], [])
    assert _leaves.rebuild([Node("namedtuple", Pair, [1, 2])], []) == [Pair(1, 2)]
