"""Batches as flat bytes: where each array goes, how to write it, how to view it again.

Both sides use this module: workers plan and write batches; the main process checks the leaf
specs it receives and views them with ``leaves``.

A *plan* replaces every array leaf of a batch (torch tensor, numpy array, or a stack that
collation has not run yet) with a :class:`Leaf` marker and gives it an aligned place in one
flat buffer. The marked tree and the leaf specs are all that travel between processes; the
arrays travel as bytes in shared memory. Decoding checks every spec before it makes a view,
so a corrupt description raises :class:`~pinpool.PinPoolError` instead of reading outside
the slot.
"""

from __future__ import annotations

import collections
import collections.abc
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import _native
from .._torch_contract import torch_collate
from .._views import PLAIN_TORCH_DTYPE_NAMES
from .tree import KEEP, plain_namedtuple, take_apart

#: Every leaf starts on a multiple of this (a cache line; more than any element size).
ALIGN = 64

TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in PLAIN_TORCH_DTYPE_NAMES if hasattr(torch, name)
}
NUMPY_KINDS = frozenset("biufcmM")


def _numpy_to_torch() -> dict[np.dtype[Any], str]:
    out = {}
    for name in TORCH_DTYPES:
        try:
            dt = np.dtype(name)
        except TypeError:  # bfloat16, complex32, float8: numpy has no such dtype
            continue
        if dt.kind in "biufc" and dt.name == name:  # (not one an extension registered)
            out[dt] = name
    return out


#: numpy dtypes (native byte order) whose arrays ``default_collate`` turns into these torch
#: dtypes.
NUMPY_TO_TORCH = _numpy_to_torch()

#: A batch's room: buffers made for a batch (a worker's segment, an automatically sized
#: arena's slots: ``_main.settings.sizing``) are its size times this, so that the next batches, a
#: little larger, still fit.
HEADROOM = 1.25
#: A worker's segment is a whole number of these.
GRANULE = 2 << 20


def room_for(nbytes: int) -> int:
    """The size of a buffer made for a batch of ``nbytes``: headroom, rounded up."""
    return max(GRANULE, -(-int(nbytes * HEADROOM) // GRANULE) * GRANULE)


@dataclass(frozen=True, slots=True)
class Leaf:
    """Marks where array number ``index`` sits in a batch tree."""

    index: int


class LeafSpec(NamedTuple):
    """Where one array lives in the flat buffer, and what it is."""

    offset: int
    nbytes: int
    kind: str  # "torch" or "numpy"
    dtype: str  # a key of TORCH_DTYPES, or a numpy dtype string such as "<f4"
    shape: tuple[int, ...]
    subclass: type | None  # a torch.Tensor subclass to restore, if any


@dataclass(frozen=True, slots=True)
class Strided:
    """Marks a torch leaf that keeps a layout of its own, as torch's ``pin_memory`` keeps a
    tensor's sizes and strides (``pinpool.pinned`` and batches collated in the main process):
    ``leaf`` holds the layout's whole storage span, flat, viewed as ``shape`` and
    ``strides`` (in elements). Checked before it is viewed, wherever the tree came from."""

    leaf: Leaf
    shape: tuple[int, ...]
    strides: tuple[int, ...]


class Restrided:
    """The source of a :class:`Strided` leaf: ``tensor``, written in its own layout."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def span(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Elements of storage a layout reaches (torch's ``computeStorageNbytes``, in elements):
    0 when it holds no element."""
    if any(d == 0 for d in shape):
        return 0
    return 1 + sum((d - 1) * st for d, st in zip(shape, strides, strict=True))


@dataclass(frozen=True, slots=True)
class Placed:
    """An array already written at ``spec``'s place (by streaming collation)."""

    spec: LeafSpec


class Stack:
    """A ``torch.stack`` that collation asked for but that has not run yet."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors


def plain_torch(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dense CPU tensor of a plain dtype, without autograd history."""
    return (
        t.layout == torch.strided
        and not t.is_nested
        and t.device.type == "cpu"
        and not t.requires_grad
        and str(t.dtype).removeprefix("torch.") in TORCH_DTYPES
    )


def _defer_stack(batch: list[Any], *, collate_fn_map: Any = None) -> Any:
    # Only a list or tuple of samples is stacked (torch's stack refuses anything else, a whole
    # tensor returned by a dataset's __getitems__ say: so does its collate, here too).
    elem = batch[0] if isinstance(batch, (list, tuple)) else None
    if type(elem) is torch.Tensor and plain_torch(elem):
        dtype, shape = elem.dtype, elem.shape
        # Mixed dtypes (torch promotes them) or shapes (torch raises): torch's own stack.
        if all(
            type(t) is torch.Tensor and t.dtype == dtype and t.shape == shape and plain_torch(t)
            for t in batch
        ):
            return Stack(list(batch))
    return torch_collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


def _deferring_map() -> dict[Any, Any]:
    table = dict(torch_collate.default_collate_fn_map)
    table[torch.Tensor] = _defer_stack
    return table


DEFERRING_MAP = _deferring_map()


def default_collate_deferred(samples: Any) -> Any:
    """``torch.utils.data.default_collate``, except that tensor stacks are left as
    :class:`Stack` so they can be written straight into shared memory; torch's own where a
    sample holds a container whose making could look at a :class:`Stack` (see
    :func:`deferrable`)."""
    if isinstance(samples, (list, tuple)) and samples and not deferrable(samples[0]):
        return torch.utils.data.default_collate(samples)
    return torch_collate.collate(samples, collate_fn_map=DEFERRING_MAP)


def deferrable(sample: Any) -> bool:
    """Whether torch's collation of samples like ``sample`` makes no container of a user's
    type from collated values (a namedtuple whose constructor checks them, a dict subclass
    whose ``update`` does): exact dicts (and the standard library's ``OrderedDict`` and
    ``defaultdict``), lists and tuples, and plain namedtuples (``tree.plain_namedtuple``), of
    anything else. Where it does, those values must be real
    tensors, not stacks deferred, nor markers."""
    kind = type(sample)
    if kind in (dict, collections.OrderedDict, collections.defaultdict):  # (update looks at none)
        return all(deferrable(v) for v in sample.values())
    if kind in (list, tuple) or (isinstance(sample, tuple) and plain_namedtuple(kind)):
        return all(deferrable(v) for v in sample)
    if isinstance(sample, (str, bytes, torch.Tensor, np.ndarray)):
        return True
    return not isinstance(sample, (collections.abc.Mapping, collections.abc.Sequence))


class Described(NamedTuple):
    """What an array leaf is: enough to give it a place and view it again."""

    kind: str  # "torch" or "numpy"
    dtype: str  # a key of TORCH_DTYPES, or a numpy dtype string such as "<f4"
    shape: tuple[int, ...]
    itemsize: int
    subclass: type | None  # a torch.Tensor subclass, if any


def describe(obj: Any) -> Described | None:
    """The array leaf ``obj`` described, or None if it is not one pinpool can carry as bytes
    (the one classifier of arrays: streaming collation uses it too)."""
    if isinstance(obj, Stack):
        first = obj.tensors[0]
        name = str(first.dtype).removeprefix("torch.")
        shape = (len(obj.tensors), *first.shape)
        return Described("torch", name, shape, first.dtype.itemsize, None)
    if isinstance(obj, torch.Tensor):
        if not plain_torch(obj):
            return None
        name = str(obj.dtype).removeprefix("torch.")
        sub = None if type(obj) is torch.Tensor else type(obj)
        return Described("torch", name, tuple(obj.shape), obj.dtype.itemsize, sub)
    if isinstance(obj, np.ndarray):
        dt = obj.dtype
        if dt.kind not in NUMPY_KINDS or dt.hasobject or dt.fields is not None:
            return None
        return Described("numpy", dt.str, tuple(obj.shape), dt.itemsize, None)
    return None


def address(array: Any) -> int | None:
    """Where a contiguous CPU array's bytes start, or None (strided, lazily conjugated or
    negated, not on the CPU: such arrays are copied by torch or numpy instead)."""
    if isinstance(array, np.ndarray):
        return int(array.ctypes.data) if array.flags.c_contiguous else None
    if (
        array.device.type == "cpu"
        and array.is_contiguous()
        and not array.is_conj()
        and not array.is_neg()
    ):
        return int(array.data_ptr())
    return None


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class LayoutPlan:
    """Where a batch's arrays go in one flat buffer: a tree of markers, and the arrays with
    their places."""

    tree: Any
    sources: list[Any]  # None for a leaf already in place
    specs: list[LeafSpec]
    nbytes: int  # bytes from 0 to the end of the last leaf


def plan(batch: Any, start: int = 0, keep_strides: bool = False) -> LayoutPlan:
    """Finds the array leaves of ``batch`` and lays them out one after another from
    ``start``; :class:`Placed` leaves keep the place they were written at (below ``start``).
    With ``keep_strides``, a tensor that is not contiguous keeps its sizes and strides, as
    torch's ``pin_memory`` keeps them (a :class:`Strided` leaf over its storage span);
    otherwise every leaf is laid out contiguous."""
    sources: list[Any] = []
    specs: list[LeafSpec] = []
    end = start

    def leaf(obj: Any) -> Any:
        nonlocal end
        if isinstance(obj, Placed):
            specs.append(obj.spec)
            sources.append(None)
            return Leaf(len(specs) - 1)
        described = describe(obj)
        if described is None:
            return KEEP
        kind, dtype, shape, itemsize, sub = described
        strides = None
        if keep_strides and isinstance(obj, torch.Tensor) and not obj.is_contiguous():
            strides = tuple(obj.stride())
            shape, obj = (span(shape, strides),), Restrided(obj)
        nbytes = math.prod(shape) * itemsize
        offset = align(end)
        end = offset + nbytes
        specs.append(LeafSpec(offset, nbytes, kind, dtype, shape, sub))
        sources.append(obj)
        if strides is not None:
            return Strided(Leaf(len(specs) - 1), described.shape, strides)
        return Leaf(len(specs) - 1)

    tree = take_apart(batch, leaf)
    return LayoutPlan(tree, sources, specs, max(end, extent(specs)))


#: Below this many bytes an array is copied by torch or numpy on the calling thread.
GATHER_MIN = 1 << 20


def _gather_items(src: Any, spec: LeafSpec) -> list[tuple[int, int, int]] | None:
    """``(address, nbytes, offset)`` of each contiguous piece of ``src`` for
    ``_native._gather``, or None when it must go through torch or numpy (not contiguous,
    lazily conjugated or negated, mixed shapes or dtypes, not on the CPU)."""
    if isinstance(src, Stack):
        first = src.tensors[0]
        each = first.nbytes
        if each * len(src.tensors) != spec.nbytes:
            return None
        items = []
        for i, t in enumerate(src.tensors):
            start = address(t)
            if start is None or t.dtype != first.dtype or t.shape != first.shape:
                return None
            items.append((start, each, i * each))
        return items
    if isinstance(src, (torch.Tensor, np.ndarray)) and src.nbytes == spec.nbytes:
        start = address(src)
        return None if start is None else [(start, spec.nbytes, 0)]
    return None


def write(p: LayoutPlan, buffer: Any, threads: int = 1) -> None:
    """Writes every array of plan ``p`` into ``buffer`` (a writable buffer object, or a flat
    CPU uint8 tensor). With ``threads > 1``, contiguous arrays and stacks of at least
    :data:`GATHER_MIN` bytes are copied by that many of this process's copy threads, without
    the GIL."""
    if isinstance(buffer, torch.Tensor):
        buffer = buffer.numpy()
    mem = memoryview(buffer).cast("B")
    try:
        for spec, src in zip(p.specs, p.sources, strict=True):
            if spec.nbytes == 0 or src is None:
                continue
            chunk = mem[spec.offset : spec.offset + spec.nbytes]
            if threads > 1 and spec.nbytes >= GATHER_MIN:
                items = _gather_items(src, spec)
                if items is not None:
                    # The sources are arrays this plan holds: alive for the whole call.
                    _native._gather(chunk, items, threads)
                    del chunk
                    continue
            if spec.kind == "numpy":
                dst_np = np.frombuffer(chunk, dtype=np.dtype(spec.dtype)).reshape(spec.shape)
                np.copyto(dst_np, src, casting="no")
                continue
            dtype = TORCH_DTYPES[spec.dtype]
            dst = torch.frombuffer(chunk, dtype=dtype).view(spec.shape)
            if isinstance(src, Restrided):
                _write_strided(dst, src.tensor)
            elif isinstance(src, Stack):
                torch.stack(src.tensors, 0, out=dst)
            else:
                dst.copy_(src)
            del dst, chunk
    finally:
        mem.release()


def _write_strided(flat: torch.Tensor, src: torch.Tensor) -> None:
    """Writes ``src`` into ``flat`` (its storage span) in ``src``'s own layout. Where that
    layout repeats elements (a stride of 0: ``expand``), each is written once: torch refuses
    to write a tensor whose elements overlap."""
    dst = flat.as_strided(src.shape, src.stride())
    for dim, (size, stride) in enumerate(zip(src.shape, src.stride(), strict=True)):
        if stride == 0 and size > 1:
            dst, src = dst.narrow(dim, 0, 1), src.narrow(dim, 0, 1)
    dst.copy_(src)  # (a lazily negated or conjugated source is resolved, as torch's pin does)


def extent(specs: list[LeafSpec]) -> int:
    """Bytes from 0 to the end of the last leaf."""
    return max((s.offset + s.nbytes for s in specs), default=0)
