"""Streaming collation: each sample's big arrays go into the batch's buffer as it is made.

torch's fetcher makes every sample of a batch and only then collates them. With 256 fresh
150 KB images that is 38 MB of item memory written, then read back by the stack, long after
it left the CPU's caches, and often faulted in afresh for every batch. Here the worker's
fetcher (``_worker.fetcher``) hands collate the indices (:class:`LazySamples`) and
:func:`collate_streaming` makes the samples one at a time: a sample's big arrays (plain
tensors and numeric numpy arrays of at least :data:`STREAM_MIN` bytes) are copied into their
row of the batch's buffer while still in cache, and the sample keeps a :class:`_Row` marker
in their place. The next sample's arrays then reuse the memory just freed. (With copy
threads, contiguous arrays are held until about :data:`GROUP_BYTES` of them are pending and
copied together: a bounded number of samples' arrays is alive at once, whatever the batch
size.) torch's own
``default_collate`` runs over the marked samples, so the batch has exactly the structure and
types it would have had.

Invariants:

- the dataset is called with the same indices, in the same order, as torch would call it;
- region ``k`` holds, in row ``i``, array number ``k`` (in walk order) of sample ``i``; every
  sample's big arrays must match the first sample's (kind, dtype, shape, in walk order);
- collation must bring each region's markers together exactly once, all of them, in sample
  order. If anything differs, the rows written so far are copied back out into ordinary
  arrays and the batch is made the ordinary way, so that every result and every error is
  torch's own;
- only exact ``dict``, ``list``, ``tuple`` and namedtuple containers are walked into; other
  containers are kept whole, with their arrays, as torch would see them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
import torch.utils.data

from .. import _native
from .._torch_contract import torch_collate
from .._wire import codec
from .._wire.handle import ZeroCopyTask
from .._wire.tree import KEEP, map_leaves

#: Arrays smaller than this are left to ordinary collation.
STREAM_MIN = 16 << 10
#: With copy threads, contiguous arrays are copied in groups of at least this many bytes.
GROUP_BYTES = 1 << 20


class LazySamples:
    """A batch's indices standing in for its samples: iterating makes them, in order."""

    __slots__ = ("dataset", "indices", "task")

    def __init__(self, dataset: Any, indices: list[Any], task: ZeroCopyTask | None) -> None:
        self.dataset = dataset
        self.indices = indices
        self.task = task

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[Any]:
        dataset = self.dataset
        for index in self.indices:
            try:
                sample = dataset[index]
            except StopIteration as stop:
                # (Not to end this iteration early, nor to become a generator's RuntimeError:
                # torch's fetcher lets it out of fetch(), which ends the epoch.)
                raise DatasetStopped(stop) from None
            yield sample
            del sample  # (freed before the next is made, once its consumer lets it go)


class DatasetStopped(Exception):
    """A ``StopIteration`` the dataset raised while a sample was made, carried out of the
    iterations it passes through (which would take it for their own end) to collate's caller,
    where it is raised as it was (``_worker.collate``)."""

    def __init__(self, stop: StopIteration) -> None:
        super().__init__("the dataset raised StopIteration")
        self.stop = stop


class _Region(NamedTuple):
    """Where array number ``k`` of every sample goes: one row per sample."""

    offset: int
    shape: tuple[int, ...]  # of one sample's array
    row_bytes: int
    torch_dtype: str  # a key of codec.TORCH_DTYPES: the batch's dtype
    numpy_dtype: np.dtype[Any] | None  # the samples' dtype, if they are numpy arrays


@dataclass(frozen=True, slots=True)
class _Row:
    """Stands in a sample for its array number ``region``, copied into row ``sample``."""

    region: int
    sample: int


class _Mismatch(Exception):
    """A sample or the collation did not follow the first sample's layout."""


@dataclass
class Layout:
    """The regions a batch's big arrays stream into, from its first sample."""

    regions: list[_Region]
    count: int  # samples in the batch
    nbytes: int  # bytes the regions take, from 0
    #: The bytes of each of the first sample's leaves that are not streamed and that torch's
    #: collation stacks into an array of ``count`` of them (arrays, numbers): collated after
    #: the regions, each leaf aligned.
    rest: tuple[int, ...] = ()

    def batch_bytes(self) -> int:
        """The whole batch's bytes, if its other samples are like the first: the regions, then
        each of the rest's leaves, stacked and aligned."""
        return self.nbytes + sum(codec.align(self.count * n) for n in self.rest)

    def spec(self, k: int) -> codec.LeafSpec:
        r = self.regions[k]
        shape = (self.count, *r.shape)
        nbytes = r.row_bytes * self.count
        return codec.LeafSpec(r.offset, nbytes, "torch", r.torch_dtype, shape, None)


def _region_of(array: Any) -> tuple[tuple[int, ...], int, str, np.dtype[Any] | None] | None:
    """(shape, bytes, batch dtype, numpy dtype) of a sample's array worth streaming: a plain
    tensor (not a subclass) or numeric numpy array of at least :data:`STREAM_MIN` bytes."""
    kind = type(array)
    if kind is not torch.Tensor and kind not in (np.ndarray, np.memmap):
        return None
    found = codec.describe(array)
    if found is None or array.nbytes < STREAM_MIN:
        return None
    if kind is torch.Tensor:
        return found.shape, array.nbytes, found.dtype, None
    dt = array.dtype
    name = codec.NUMPY_TO_TORCH.get(dt) if dt.isnative else None
    # torch refuses negative strides: such arrays are left to torch, to raise.
    if name is None or min(array.strides, default=0) < 0:
        return None
    return found.shape, array.nbytes, name, dt


def plan_layout(first: Any, count: int) -> Layout | None:
    """The regions for a batch of ``count`` samples like ``first``; None if it has no big
    arrays (outside containers that are not walked), so streaming would gain nothing, or
    holds containers whose making must see real tensors (``codec.deferrable``)."""
    if count < 1 or not codec.deferrable(first):
        return None
    regions: list[_Region] = []
    end = 0
    rest: list[int] = []

    def on_array(array: Any) -> Any:
        nonlocal end
        found = _region_of(array)
        if found is not None:
            shape, row_bytes, name, np_dtype = found
            offset = codec.align(end)
            end = offset + row_bytes * count
            regions.append(_Region(offset, shape, row_bytes, name, np_dtype))
        elif isinstance(array, (torch.Tensor, np.ndarray, np.generic)):
            rest.append(array.nbytes)
        elif isinstance(array, bool):
            rest.append(1)  # (torch.tensor of bools)
        elif isinstance(array, (int, float)):
            rest.append(8)  # (int64, float64)
        return KEEP

    try:
        map_leaves(first, on_array, exact=True)
    except Exception:  # a namedtuple that cannot be rebuilt from its values, say
        return None
    if not regions:
        return None
    return Layout(regions, count, codec.align(end), tuple(rest))


class _Rows:
    """Typed views of each region of the buffer, one row per sample, and the copies into
    them. With ``threads > 1``, contiguous arrays are not copied one by one: they are held
    until :data:`GROUP_BYTES` of them are pending (still in this core's cache), then copied
    together by this process's copy threads (``_native._gather``: non-temporal stores,
    without the GIL)."""

    def __init__(self, layout: Layout, mem: memoryview, threads: int = 1) -> None:
        self.mem = mem
        self.threads = threads
        self.layout = layout
        self.pending: list[tuple[int, int, int]] = []  # (address, nbytes, offset in mem)
        self.held: list[Any] = []  # the arrays those addresses belong to
        self.pending_bytes = 0
        self.views: list[Any] = []
        for r in layout.regions:
            chunk = mem[r.offset : r.offset + r.row_bytes * layout.count]
            if r.numpy_dtype is not None:
                view: Any = np.frombuffer(chunk, dtype=r.numpy_dtype)
            else:
                view = torch.frombuffer(chunk, dtype=codec.TORCH_DTYPES[r.torch_dtype])
            self.views.append(view.reshape((layout.count, *r.shape)))
            del chunk

    def put(self, k: int, i: int, array: Any) -> None:
        if self.threads > 1:
            address = codec.address(array)
            if address is not None:
                r = self.layout.regions[k]
                self.pending.append((address, r.row_bytes, r.offset + i * r.row_bytes))
                self.held.append(array)
                self.pending_bytes += r.row_bytes
                if self.pending_bytes >= GROUP_BYTES:
                    self.flush()
                return
        dst = self.views[k][i]
        if isinstance(dst, np.ndarray):
            np.copyto(dst, array, casting="no")
        else:
            dst.copy_(array)

    def flush(self) -> None:
        """Copies the held arrays into their rows."""
        if self.pending:
            # The addresses are those of the arrays in self.held, alive for the call.
            _native._gather(self.mem, self.pending, self.threads)
        self.pending.clear()
        self.held.clear()
        self.pending_bytes = 0

    def copy_out(self, k: int, i: int) -> Any:
        row = self.views[k][i]
        return row.copy() if isinstance(row, np.ndarray) else row.clone()


def _mark(sample: Any, i: int, layout: Layout, rows: _Rows) -> Any:
    """``sample`` with its big arrays copied into row ``i`` and replaced by markers."""
    k = 0

    def on_array(array: Any) -> Any:
        nonlocal k
        found = _region_of(array)
        if found is None:
            return KEEP
        if k >= len(layout.regions):
            raise _Mismatch
        r = layout.regions[k]
        if found != (r.shape, r.row_bytes, r.torch_dtype, r.numpy_dtype):
            raise _Mismatch
        rows.put(k, i, array)
        k += 1
        return _Row(k - 1, i)

    marked = map_leaves(sample, on_array, exact=True)
    if k != len(layout.regions):
        raise _Mismatch
    return marked


def _unmark(marked: Any, rows: _Rows) -> Any:
    """A marked sample with each marker replaced by a copy of its row."""

    def on_row(obj: Any) -> Any:
        return rows.copy_out(obj.region, obj.sample) if type(obj) is _Row else KEEP

    return map_leaves(marked, on_row, exact=True)


def _collate_marked(marked: list[Any], layout: Layout) -> Any:
    """torch's default collation (stacks deferred) over marked samples; each region's
    markers become one :class:`~pinpool.codec.Placed` leaf."""
    used = [False] * len(layout.regions)

    def rows_to_leaf(batch: list[Any], *, collate_fn_map: Any = None) -> Any:
        k = batch[0].region
        ok = len(batch) == layout.count and not used[k]
        ok = ok and all(
            type(r) is _Row and r.region == k and r.sample == i for i, r in enumerate(batch)
        )
        if not ok:
            raise _Mismatch
        used[k] = True
        return codec.Placed(layout.spec(k))

    table = dict(codec.DEFERRING_MAP)
    table[_Row] = rows_to_leaf
    batch = torch_collate.collate(marked, collate_fn_map=table)
    if not all(used):
        raise _Mismatch
    return batch


def owned(box: list[Any], rest: Iterator[Any]) -> Iterator[Any]:
    """The sample in ``box`` (taken out of it, so only the consumer holds it), then
    ``rest``."""
    yield box.pop()
    yield from rest


class Access(Protocol):
    """The writing thread's switch for its access to the batch's memory
    (``destination.Destination``)."""

    def allow(self) -> None: ...
    def deny(self) -> None: ...


class _Always:
    """Memory any thread may touch (a segment of the worker's own)."""

    def allow(self) -> None:
        pass

    def deny(self) -> None:
        pass


_ALWAYS = _Always()


def collate_streaming(
    samples: Iterator[Any],
    layout: Layout,
    mem: memoryview,
    threads: int = 1,
    access: Access = _ALWAYS,
) -> tuple[Any, None] | tuple[None, list[Any]]:
    """Makes the batch's ``layout.count`` samples from ``samples``, streaming each one's big
    arrays into ``mem`` (at least ``layout.nbytes`` long) before the next is made, and
    collates them.

    Returns ``(batch, None)``, a batch whose streamed arrays are ``Placed`` leaves, or, when a
    sample or the collation does not follow the layout, ``(None, samples)``: every sample,
    made the ordinary way (streamed arrays copied back out), for ordinary collation.
    Exceptions from the dataset propagate; ``mem`` is then simply left unused. With
    ``threads > 1`` the arrays are copied in groups by that many copy threads. ``access`` is
    switched off while the dataset makes each sample (its code must not reach ``mem``), on
    again after, and left off when the samples are handed back."""
    rows = _Rows(layout, mem, threads)
    marked: list[Any] = []
    try:
        for i in range(layout.count):
            access.deny()
            try:
                sample = next(samples)
            finally:
                access.allow()
            try:
                marked.append(_mark(sample, i, layout, rows))
            except _Mismatch:
                rows.flush()
                made = [_unmark(m, rows) for m in marked]
                access.deny()
                return None, [*made, sample, *samples]
            del sample  # its arrays are freed (or held for a group copy) before the next
        rows.flush()
        try:
            return _collate_marked(marked, layout), None
        except Exception:
            # The marked samples did not collate as the layout says (or torch raised): make
            # the batch the ordinary way, so whatever happens is what torch would do.
            return None, [_unmark(m, rows) for m in marked]
    finally:
        del rows
