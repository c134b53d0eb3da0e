"""Streaming collation (``pinpool._worker.streaming``): samples' big arrays are written into
the batch's buffer as each sample is made, and the batch that comes out is
``default_collate``'s, bit for bit; samples that do not follow the first one's layout fall
back to ordinary collation, with torch's own results and errors."""

from __future__ import annotations

import gc
import math
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_datasets import NUMPY_DTYPES, TORCH_DTYPES, Pair, Record, Tracked, assert_same
from loader_datasets import make_array as make_leaf
from torch.utils.data import default_collate

from pinpool._wire import codec as _codec
from pinpool._wire import handle
from pinpool._wire import leaves as _leaves
from pinpool._worker import fetcher
from pinpool._worker import streaming as _stream

KiB = 1 << 10


def collate_via_stream(samples: list[Any], threads: int = 1) -> tuple[Any, bool]:
    """What a worker's streaming collate makes of ``samples``, decoded again; and whether it
    streamed (False: the layout did not apply and the batch was made the ordinary way)."""
    rest = iter(samples)
    first = next(rest)
    layout = _stream.plan_layout(first, len(samples))
    if layout is None:
        made: list[Any] | None = samples
        batch = None
    else:
        region = bytearray(layout.nbytes)
        mem = memoryview(region)
        batch, made = _stream.collate_streaming(_stream.owned([first], rest), layout, mem, threads)
        mem.release()
    if batch is None:
        assert made is not None
        batch = _codec.default_collate_deferred(made)
        p = _codec.plan(batch)
        buf = bytearray(p.nbytes)
    else:
        p = _codec.plan(batch, start=layout.nbytes)
        buf = bytearray(p.nbytes)
        buf[: len(region)] = region
    _codec.write(p, buf)
    views = _leaves.host_leaves(_leaves.checked_specs(p.specs, len(buf)), buf, len(buf))
    return _leaves.rebuild(p.tree, views), made is None


def outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as exc:
        return "raised", type(exc)


def assert_same_outcome(samples: list[Any], threads: int = 1) -> bool:
    """Streaming gives what ``default_collate`` gives (or raises the same type); returns
    whether it streamed."""
    ref_kind, ref = outcome(default_collate, samples)
    got_kind, got = outcome(collate_via_stream, samples, threads)
    assert got_kind == ref_kind, (ref, got)
    if ref_kind == "raised":
        assert got is ref
        return False
    assert_same(ref, got[0])
    return bool(got[1])


# --------------------------------------------------------------------------- generated samples

BIG_SHAPES = [(4096,), (64, 96), (3, 40, 48), (130, 130)]


@st.composite
def leaf_makers(draw: Any) -> Any:
    """A function ``(rng) -> leaf`` that each sample calls: a big or small array (torch or
    numpy, any layout) or a Python value."""
    kind = draw(st.sampled_from(["big", "big", "small", "py"]))
    if kind == "py":
        value = draw(st.one_of(st.integers(-(2**40), 2**40), st.floats(), st.text(max_size=3)))
        return lambda rng: value
    lib = draw(st.sampled_from(["torch", "numpy"]))
    dtype = draw(st.sampled_from(TORCH_DTYPES if lib == "torch" else NUMPY_DTYPES))
    if kind == "big":
        base = draw(st.sampled_from(BIG_SHAPES))
        itemsize = (
            1 if dtype == "bool" else np.dtype("uint16" if dtype == "bfloat16" else dtype).itemsize
        )
        scale = max(1, -(-_stream.STREAM_MIN // (math.prod(base) * itemsize)))
        shape: tuple[int, ...] = (*base[:-1], base[-1] * scale)
    else:
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=2)))
    layouts = ["contig", "transposed", "strided"] + (["reversed"] if lib == "numpy" else [])
    layout = draw(st.sampled_from(layouts))
    return lambda rng: make_leaf(lib, dtype, shape, layout, rng)


def sample_makers() -> st.SearchStrategy[Any]:
    """A tree of leaf makers: every sample of a batch gets this structure."""
    keys = st.text(alphabet="abc", min_size=1, max_size=2)
    return st.recursive(
        leaf_makers(),
        lambda ch: st.one_of(
            st.dictionaries(keys, ch, min_size=1, max_size=3),
            st.lists(ch, min_size=1, max_size=3),
            st.lists(ch, min_size=1, max_size=3).map(tuple),
            st.tuples(ch, ch).map(lambda v: Pair(*v)),
            st.tuples(ch, ch, ch).map(lambda v: Record(*v)),
        ),
        max_leaves=6,
    )


def instantiate(maker: Any, rng: Any) -> Any:
    if callable(maker):
        return maker(rng)
    if isinstance(maker, dict):
        return {k: instantiate(v, rng) for k, v in maker.items()}
    if isinstance(maker, tuple) and hasattr(maker, "_fields"):
        return type(maker)(*(instantiate(v, rng) for v in maker))
    if isinstance(maker, tuple):
        return tuple(instantiate(v, rng) for v in maker)
    return [instantiate(v, rng) for v in maker]


SETTINGS = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(
    sample_makers(),
    st.integers(1, 5),
    st.integers(0, 2**32 - 1),
    st.sampled_from([1, 3]),
    st.sampled_from([16 * KiB, 100 * KiB, 1 << 20]),
)
def test_streamed_batches_equal_default_collate(
    maker: Any, count: int, seed: int, threads: int, group: int
) -> None:
    # threads=3: arrays are held and copied in groups of about `group` bytes by copy threads.
    rng = np.random.default_rng(seed)
    samples = [instantiate(maker, rng) for _ in range(count)]
    saved = _stream.GROUP_BYTES
    _stream.GROUP_BYTES = group
    try:
        streamed = assert_same_outcome(samples, threads)
    finally:
        _stream.GROUP_BYTES = saved
    # Every sample has the first one's layout: if it has big arrays that torch collates,
    # the batch must have streamed, not fallen back.
    layout = _stream.plan_layout(samples[0], count)
    if layout is not None and outcome(default_collate, samples)[0] == "ok":
        assert streamed


# --------------------------------------------------------------------------- chosen cases


def image(i: int, shape: tuple[int, ...] = (3, 64, 96), dtype: torch.dtype = torch.uint8) -> Any:
    return torch.full(shape, i % 251, dtype=dtype)


def test_a_typical_batch_streams() -> None:
    samples = [(image(i), i) for i in range(6)]
    assert assert_same_outcome(samples)


def test_bare_tensors_and_numpy_arrays_stream() -> None:
    assert assert_same_outcome([image(i) for i in range(4)])
    assert assert_same_outcome([np.full((64, 64), i, dtype=np.float32) for i in range(4)])


def test_samples_without_big_arrays_are_not_streamed() -> None:
    assert _stream.plan_layout({"x": torch.zeros(4), "y": 1}, 8) is None
    assert _stream.plan_layout(3, 8) is None
    assert not assert_same_outcome([{"x": torch.zeros(4) + i, "y": i} for i in range(3)])


@pytest.mark.parametrize("threads", [1, 2])
def test_a_later_sample_with_another_shape_raises_torchs_error(threads: int) -> None:
    samples = [image(i) for i in range(3)] + [image(3, (3, 64, 90))]
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        default_collate(samples)
    assert assert_same_outcome(samples, threads) is False


def test_a_later_sample_with_another_dtype_is_promoted_as_torch_does() -> None:
    samples = [image(0), image(1), image(2, dtype=torch.float32)]
    assert_same_outcome(samples)
    assert default_collate(samples).dtype == torch.float32


@pytest.mark.parametrize("threads", [1, 2])
def test_dict_keys_in_another_order_pair_by_key(threads: int) -> None:
    a, b = image(1), image(2)
    samples = [{"a": a, "b": b}, {"b": image(3), "a": image(4)}, {"a": image(5), "b": image(6)}]
    # The regions would be crossed: fall back (rows held for a group copy are copied first).
    assert assert_same_outcome(samples, threads) is False


def test_a_later_sample_missing_an_array_falls_back() -> None:
    samples = [{"a": image(1), "b": image(2)}, {"a": image(3), "b": None}]
    assert_same_outcome(samples)
    samples = [{"a": image(1)}, {"a": image(3), "b": image(4)}]
    assert_same_outcome(samples)


def test_other_containers_are_left_to_torch() -> None:
    samples = [OrderedDict(x=image(i), y=i) for i in range(3)]
    assert _stream.plan_layout(samples[0], 3) is None
    assert_same_outcome(samples)
    nested = [{"d": OrderedDict(x=image(i)), "y": image(i + 1)} for i in range(3)]
    assert assert_same_outcome(nested)


def test_numpy_memmaps_and_foreign_byte_order(tmp_path: Any) -> None:
    mm = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(4, 64, 64))
    mm[:] = np.arange(4, dtype=np.float32)[:, None, None]
    assert assert_same_outcome([mm[i] for i in range(4)])
    swapped = [np.full((64, 64), i, dtype=">f4") for i in range(3)]
    assert _stream.plan_layout(swapped[0], 3) is None
    assert_same_outcome(swapped)


def test_subclasses_and_grad_tensors_are_not_streamed() -> None:
    class Feature(torch.Tensor):
        pass

    samples = [image(i).as_subclass(Feature) for i in range(3)]
    assert _stream.plan_layout(samples[0], 3) is None
    grads = [torch.zeros(64, 64, requires_grad=True) for _ in range(2)]
    assert _stream.plan_layout(grads[0], 2) is None


def test_a_dataset_error_mid_batch_propagates() -> None:
    def samples() -> Any:
        yield image(0)
        yield image(1)
        raise KeyError("sample 2")

    layout = _stream.plan_layout(image(0), 4)
    assert layout is not None
    region = bytearray(layout.nbytes)
    mem = memoryview(region)
    with pytest.raises(KeyError, match="sample 2"):
        _stream.collate_streaming(samples(), layout, mem)
    gc.collect()
    mem.release()  # no view of the buffer is left behind


def test_each_sample_is_freed_before_the_next_is_made() -> None:
    ds = Tracked(6)
    samples = _stream.LazySamples(ds, list(range(6)), None)
    rest = iter(samples)
    first = next(rest)
    layout = _stream.plan_layout(first, len(samples))
    assert layout is not None
    region = bytearray(layout.nbytes + 4 * KiB)
    mem = memoryview(region)
    box = [first]
    del first
    batch, made = _stream.collate_streaming(_stream.owned(box, rest), layout, mem)
    assert made is None
    assert batch["alive"] == [0] * 6 or batch["alive"].tolist() == [0] * 6
    mem.release()
    # Made the ordinary way, every earlier sample is still alive.
    plain = list(_stream.LazySamples(Tracked(6), list(range(6)), None))
    assert [s["alive"] for s in plain] == [0, 1, 2, 3, 4, 5]


def test_the_streaming_fetcher_hands_collate_the_indices_of_the_callers_dataset() -> None:
    ds = Tracked(3)
    seen: list[Any] = []
    streaming_fetcher = fetcher.StreamingFetcher(ds, True, seen.append, False)
    task = handle.ZeroCopyTask(7, 1)
    streaming_fetcher.fetch(handle.TaggedIndices([2, 0], task))
    (lazy,) = seen
    assert isinstance(lazy, _stream.LazySamples) and lazy.dataset is ds and lazy.task == task
    assert [s["x"][0, 0].item() for s in lazy] == [2.0, 0.0]


def test_a_worker_streams_only_with_pinpools_collate() -> None:
    """Installed in a worker, torch's fetcher for a map-style dataset with batching and
    pinpool's collate streams; for anything else it is torch's own."""
    from pinpool._torch_contract import dataset_kind
    from pinpool._worker.collate import PinCollate

    kind = dataset_kind()
    original = kind.create_fetcher
    try:
        fetcher.stream_in_this_worker()
        fetcher.stream_in_this_worker()  # (once)
        collate = PinCollate("token", None, auto_collation=True, ring_size=4)
        made = kind.create_fetcher(kind.Map, Tracked(2), True, collate, False)
        assert isinstance(made, fetcher.StreamingFetcher)
        plain = kind.create_fetcher(kind.Map, Tracked(2), True, list, False)
        assert not isinstance(plain, fetcher.StreamingFetcher)
    finally:
        kind.create_fetcher = original


def test_a_dataset_with_its_own_getitems_makes_its_samples() -> None:
    class Batched(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __getitems__(self, indices: list[int]) -> list[Any]:
            return [image(i) for i in indices]

        def __len__(self) -> int:
            return 4

    seen: list[Any] = []
    fetcher.StreamingFetcher(Batched(), True, seen.append, False).fetch([1, 3])
    got = seen[0].items
    assert isinstance(got, list) and len(got) == 2
