"""Leaves from bytes: leaf specs received from another process, checked, and viewed again as
arrays in the memory the batch landed in; the batch's tree rebuilt around them (the main
process's side of ``codec``, which plans and writes them).

Invariants: every spec is checked (:func:`checked_specs`: a known dtype and kind, an aligned
offset, a shape whose bytes are the spec's and lie within the limit) before any view is made
of it, so a corrupt description raises :class:`~pinpool.PinPoolError` (``OutOfBounds``)
instead of reading outside the slot; a view never reaches past ``limit`` bytes. A batch on the
device whose leaves share one dtype is viewed through its :class:`DeviceLayout` (kept per
description), whose pieces lie end to end within the batch's bytes, each leaf where its spec
puts it: the same views :func:`device_leaf` makes one by one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from .._errors import OutOfBounds
from .._torch_contract import unflatten_dense_tensors
from .codec import (
    ALIGN,
    NUMPY_KINDS,
    NUMPY_TO_TORCH,
    TORCH_DTYPES,
    Leaf,
    LeafSpec,
    Strided,
    span,
)
from .tree import KEEP, put_together


def checked_specs(specs: Any, limit: int) -> list[LeafSpec]:
    """Validates leaf specs received from another process against ``limit`` bytes."""
    if not isinstance(specs, (list, tuple)):
        raise OutOfBounds("corrupt batch description: leaf list is not a list")
    out: list[LeafSpec] = []
    for raw in specs:
        try:
            out.append(_checked_spec(raw, limit))
        except (TypeError, ValueError, OverflowError) as exc:
            if isinstance(exc, OutOfBounds):
                raise
            raise OutOfBounds(f"corrupt batch description: bad leaf {raw!r}") from None
    return out


def _checked_spec(raw: Any, limit: int) -> LeafSpec:
    """One leaf spec, checked; raises OutOfBounds (or TypeError, ValueError, OverflowError)."""
    offset, nbytes, kind, dtype, shape, sub = raw
    offset, nbytes = int(offset), int(nbytes)
    shape = tuple(int(d) for d in shape)
    if kind == "torch":
        if dtype not in TORCH_DTYPES:
            raise OutOfBounds(f"corrupt batch description: unknown dtype {dtype!r}")
        itemsize = TORCH_DTYPES[dtype].itemsize
        if sub is not None and not (isinstance(sub, type) and issubclass(sub, torch.Tensor)):
            raise OutOfBounds(f"corrupt batch description: {sub!r} is not a tensor type")
    elif kind == "numpy":
        try:
            ndt = np.dtype(dtype)
        except TypeError as exc:
            raise OutOfBounds(f"corrupt batch description: dtype {dtype!r}") from exc
        if ndt.kind not in NUMPY_KINDS or ndt.hasobject or ndt.fields is not None:
            raise OutOfBounds(f"corrupt batch description: dtype {dtype!r}")
        itemsize = ndt.itemsize
    else:
        raise OutOfBounds(f"corrupt batch description: leaf kind {kind!r}")
    if any(d < 0 for d in shape) or offset < 0 or offset % ALIGN:
        raise OutOfBounds(f"corrupt batch description: leaf {raw!r}")
    # An empty array still gets its shape (and strides) made: every extent must be one torch
    # and numpy can hold, even where another dimension is 0.
    if len(shape) > _MAX_DIMS or math.prod(max(d, 1) for d in shape) * itemsize >= _MAX_EXTENT:
        raise OutOfBounds(f"corrupt batch description: shape {shape} is too large")
    if nbytes != math.prod(shape) * itemsize:
        raise OutOfBounds(
            f"corrupt batch description: a leaf of shape {shape} and {itemsize}-byte items "
            f"holds {math.prod(shape) * itemsize} bytes, not the {nbytes} it says"
        )
    if offset + nbytes > limit:
        raise OutOfBounds(
            f"corrupt batch description: a leaf of {nbytes} bytes at offset {offset} ends at "
            f"byte {offset + nbytes}, past the {limit} bytes of the batch"
        )
    return LeafSpec(offset, nbytes, kind, dtype, shape, sub)


#: The most dimensions a leaf may have (numpy's own limit is 64).
_MAX_DIMS = 32
#: No leaf's extent (its shape with empty dimensions counted as 1, in bytes) reaches this.
_MAX_EXTENT = 1 << 62


#: numpy's dtype for each torch dtype numpy has (not bfloat16, complex32 or the float8s).
NUMPY_OF_TORCH: dict[str, np.dtype[Any]] = {name: dt for dt, name in NUMPY_TO_TORCH.items()}


def host_leaf(memory: Any, spec: LeafSpec, limit: int) -> Any:
    """The array of ``spec`` over the first ``limit`` bytes of ``memory`` (a slot, or a numpy
    array of ordinary memory), on the CPU.

    Made with numpy and ``torch.from_numpy``, which keep the GIL throughout. torch's generated
    ops (``view``, ``as_strided``, ``empty``...) each give it up and take it back, once or
    twice a call; on torch's pin thread, taking it back means waiting for the consumer's
    thread to let go of it (``benchmarks/gil_probe.py`` shows which calls do). Only a dtype
    numpy lacks (bfloat16, complex32, float8) with more than one dimension costs one such op.
    Each array holds its own buffer export of ``memory``: a slot returns to its pool when the
    last of them dies."""
    if spec.nbytes and (spec.offset < 0 or spec.offset + spec.nbytes > limit):
        raise OutOfBounds(f"leaf bytes {spec.offset}+{spec.nbytes} outside {limit}")
    if spec.kind == "numpy":
        ndt = np.dtype(spec.dtype)
        if spec.nbytes == 0:
            return np.empty(spec.shape, dtype=ndt)
        count = spec.nbytes // ndt.itemsize
        return np.frombuffer(memory, ndt, count, spec.offset).reshape(spec.shape)
    dtype = TORCH_DTYPES[spec.dtype]
    if spec.nbytes == 0:
        out = torch.empty(spec.shape, dtype=dtype)
    else:
        count = spec.nbytes // dtype.itemsize
        ndt = NUMPY_OF_TORCH.get(spec.dtype)
        if ndt is not None:
            flat = np.frombuffer(memory, ndt, count, spec.offset)
            out = torch.from_numpy(flat.reshape(spec.shape))
        else:
            out = torch.frombuffer(memory, dtype=dtype, count=count, offset=spec.offset)
            if out.shape != spec.shape:
                out = out.view(spec.shape)
    return out if spec.subclass is None else out.as_subclass(spec.subclass)


def host_leaves(specs: list[LeafSpec], memory: Any, limit: int) -> list[Any]:
    """One host array per spec, over ``memory`` (see :func:`host_leaf`)."""
    return [host_leaf(memory, s, limit) for s in specs]


def device_leaf(storage: torch.Tensor, spec: LeafSpec) -> torch.Tensor:
    """The tensor of torch leaf ``spec`` viewing ``storage``, a flat uint8 tensor on a device
    (numpy has no device arrays: these are torch's own views, ``as_strided`` then ``view``
    where the dtype and shape differ)."""
    if spec.nbytes and (spec.offset < 0 or spec.offset + spec.nbytes > storage.numel()):
        raise OutOfBounds(f"leaf bytes {spec.offset}+{spec.nbytes} outside {storage.numel()}")
    dtype = TORCH_DTYPES[spec.dtype]
    if spec.nbytes == 0:
        out = torch.empty(spec.shape, dtype=dtype, device=storage.device)
    else:
        start = storage.storage_offset() + spec.offset
        out = storage.as_strided((spec.nbytes,), (1,), start)
        if dtype is not torch.uint8:
            out = out.view(dtype)
        if out.shape != spec.shape:
            out = out.view(spec.shape)
    return out if spec.subclass is None else out.as_subclass(spec.subclass)


class DeviceLayout(NamedTuple):
    """How the torch leaves of a batch on the device come out of the one allocation it is
    copied into, with no torch call per leaf (:func:`device_layout`): the allocation is
    ``torch.empty(shape, dtype=dtype)``; with ``like`` None it is the batch's only leaf
    itself, else ``unflatten_dense_tensors(allocation, like)`` views it in consecutive pieces
    (the leaves and the gaps between them, meta tensors of their numel) in one native call,
    and ``leaves`` are the positions of the leaves among them, in spec order."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    like: list[torch.Tensor] | None
    leaves: tuple[int, ...]

    def allocate(self, device: torch.device) -> torch.Tensor:
        """The memory the batch is copied into, on ``device`` (torch's current stream's)."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def views(self, storage: torch.Tensor) -> list[torch.Tensor]:
        """The leaves over ``storage``, an allocation of :meth:`allocate`."""
        if self.like is None:
            return [storage]
        assert unflatten_dense_tensors is not None
        pieces = unflatten_dense_tensors(storage, self.like)
        return [pieces[i] for i in self.leaves]


#: How many batch descriptions' layouts are kept (a workload has a few: its batch shapes).
LAYOUTS_KEPT = 64


def device_layout(specs: list[LeafSpec], need: int) -> DeviceLayout | None:
    """The :class:`DeviceLayout` of a batch of checked ``specs`` and ``need`` bytes; None
    where its leaves need one view each (:func:`device_leaf`): a numpy leaf (a host copy),
    an empty one, a tensor subclass, or leaves of more than one dtype."""
    try:
        return _layout(tuple(specs), need)
    except TypeError:  # (an unhashable spec: a subclass type that is not)
        return None


@functools.lru_cache(maxsize=LAYOUTS_KEPT)
def _layout(specs: tuple[LeafSpec, ...], need: int) -> DeviceLayout | None:
    """:func:`device_layout`, worked out once per description (specs and size)."""
    if not specs or need <= 0:
        return None
    if any(s.kind != "torch" or s.nbytes == 0 or s.subclass is not None for s in specs):
        return None
    dtypes = {s.dtype for s in specs}
    if len(dtypes) != 1:
        return None
    dtype = TORCH_DTYPES[dtypes.pop()]
    size = dtype.itemsize
    first = specs[0]
    if len(specs) == 1 and first.offset == 0 and first.nbytes == need:
        return DeviceLayout(first.shape, dtype, None, (0,))
    if unflatten_dense_tensors is None:
        return None
    order = sorted(range(len(specs)), key=lambda i: specs[i].offset)
    like: list[torch.Tensor] = []
    at: dict[int, int] = {}
    end = 0
    for i in order:
        s = specs[i]
        if s.offset < end or s.offset % size:
            return None  # (overlapping or unaligned: not consecutive pieces)
        if s.offset > end:
            like.append(torch.empty((s.offset - end) // size, device="meta"))
        at[i] = len(like)
        like.append(torch.empty(s.shape, device="meta"))
        end = s.offset + s.nbytes
    whole = -(-need // size)  # (elements: at least need bytes)
    return DeviceLayout((whole,), dtype, like, tuple(at[i] for i in range(len(specs))))


def _restrided(flat: Any, marker: Strided) -> torch.Tensor:
    """``flat`` (a flat tensor leaf) viewed in ``marker``'s layout, checked to lie inside it."""
    shape, strides = getattr(marker, "shape", None), getattr(marker, "strides", None)
    if not (
        isinstance(flat, torch.Tensor)
        and flat.dim() == 1
        and type(shape) is tuple
        and type(strides) is tuple
        and len(shape) == len(strides) <= _MAX_DIMS
        and all(type(x) is int and x >= 0 for x in (*shape, *strides))
        and math.prod(max(d, 1) for d in shape) < _MAX_EXTENT
        and span(shape, strides) <= flat.numel()
    ):
        raise OutOfBounds(f"corrupt batch description: strided leaf {shape!r} {strides!r}")
    return flat.as_strided(shape, strides, flat.storage_offset())


def rebuild(tree: Any, views: list[Any], kept: Callable[[Any], Any] | None = None) -> Any:
    """The batch of ``tree`` with marker ``i`` replaced by ``views[i]``, and each object the
    walk does not look into (see ``tree.put_together``) by ``kept(obj)`` if given."""

    def view(obj: Any) -> Any:
        index = getattr(obj, "index", None)  # unpickled: anything may be missing
        if not isinstance(obj, Leaf) or type(index) is not int or not 0 <= index < len(views):
            raise OutOfBounds(f"corrupt batch description: leaf {index!r} does not exist")
        return views[index]

    def leaf(obj: Any) -> Any:
        if isinstance(obj, Leaf):
            return view(obj)
        if isinstance(obj, Strided):
            return _restrided(view(getattr(obj, "leaf", None)), obj)
        return KEEP

    try:
        return put_together(tree, leaf, kept)
    except RecursionError:
        raise OutOfBounds("corrupt batch description: the batch is nested too deeply") from None
