"""The datasets the benchmark loads from, i.e. what a DataLoader worker does per item.

- ``synthetic``: a freshly made uint8 image per item (filled from its index) and an int label;
- ``memmap``: items are slices of one large ``numpy.memmap`` file, made on first use under
  ``--data-dir`` and reused by later runs (it is read from the page cache once written);
- ``nested``: dict items: a uint8 image, float32 features, int64 tokens, string metadata;
- ``ceiling``: items are views into one preloaded in-memory array, so a worker's only work
  is the collate copy (the most a loader can deliver);
- ``tokens``: small batches shaped like a language model's: each item is one row of
  :data:`TOKEN_ROW` int64 token ids (a context of 8192 plus the next token), sliced from one
  preallocated array, so a batch of 8 is 512 KiB and the loader's per-batch cost, not the
  dataset, is what is measured. It has its own batch size, workers and steps (``--token-*``).
- ``varlen``: variable-size batches, the usual NLP "dynamic padding": each item is one row of
  int64 token ids whose length is drawn once, seeded, between :data:`VARLEN_MIN` and
  :data:`VARLEN_MAX` tokens, and :func:`pad_collate` pads each batch to its own longest row
  (``input_ids`` and an int64 ``attention_mask``). The lengths (``--varlen-lengths``,
  :data:`VARLEN_LENGTHS`): a long Pareto tail (batch sizes vary by 100x and more), lognormal,
  or that lognormal draw in ascending order (a length curriculum: the first batch is the
  smallest). Every loader sees the same batches, in the same order. It has its own batch size,
  workers and steps (``--varlen-*``).

Also the helpers that walk a batch: its tensors, its size in bytes, the move to a device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

WORKLOADS = ("synthetic", "memmap", "nested", "ceiling", "tokens", "varlen")

#: int64 values per item of the tokens workload.
TOKEN_ROW = 8193
#: The tokens workload slices its rows from this many preallocated int64 values (32 MiB).
TOKEN_POOL = 1 << 22

#: Row lengths of the varlen workload, in tokens: a Pareto tail from VARLEN_MIN, shape
#: VARLEN_ALPHA (a row is longer than x tokens with probability (VARLEN_MIN / x) ** VARLEN_ALPHA:
#: half the rows are at most 43 tokens, one in 18 over 1,000, one in 240 at VARLEN_MAX),
#: clipped at VARLEN_MAX, drawn from VARLEN_SEED.
VARLEN_MIN = 16
VARLEN_MAX = 40_000
VARLEN_ALPHA = 0.7
VARLEN_SEED = 25
#: The varlen workload's row lengths: a Pareto tail, lognormal (median VARLEN_MAX / 8, sigma
#: VARLEN_SIGMA: with 16 rows a batch, padded, is about 1.2 to 8 MB), or that lognormal draw
#: sorted, shortest first.
VARLEN_LENGTHS = ("pareto", "lognormal", "ascending")
VARLEN_SIGMA = 0.5
#: The varlen workload slices its rows from this many preallocated int64 values (8 MiB).
VARLEN_POOL = 1 << 20

#: The memmap file holds at most this much; item indices wrap around beyond it.
MEMMAP_MAX_BYTES = 8 << 30
#: The ceiling workload preloads at most this much; item indices wrap around beyond it.
CEILING_MAX_BYTES = 1 << 30


class SyntheticImages(Dataset[Any]):
    """``(image, label)``: a uint8 image filled with ``index % 251``, made per item."""

    def __init__(self, length: int, shape: tuple[int, ...]) -> None:
        self.length = length
        self.shape = shape

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return torch.full(self.shape, i % 251, dtype=torch.uint8), i


class NestedItems(SyntheticImages):
    """A dict per item: image, 256 float32 features, 128 int64 tokens, string metadata."""

    def __getitem__(self, i: int) -> Any:
        return {
            "image": torch.full(self.shape, i % 251, dtype=torch.uint8),
            "features": torch.full((256,), float(i), dtype=torch.float32),
            "tokens": torch.arange(i, i + 128, dtype=torch.int64),
            "meta": {"id": f"item-{i:08d}", "split": "train"},
        }


class PreloadedImages(Dataset[Any]):
    """``(image, label)`` where the image is a view into one array preloaded in memory
    (shared with forked workers, never written after start-up)."""

    def __init__(self, length: int, shape: tuple[int, ...], unique: int) -> None:
        self.length = length
        self.data = torch.empty((unique, *shape), dtype=torch.uint8)
        fill = (torch.arange(unique) % 251).to(torch.uint8).view(-1, *[1] * len(shape))
        self.data.copy_(fill.expand_as(self.data))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return self.data[i % len(self.data)], i


class TokenRows(Dataset[Any]):
    """One row of ``row`` int64 token ids per item: a view into a preallocated ``arange``
    (shared with forked workers, never written after start-up), starting ``row - 1`` values
    after the previous item's start, as consecutive windows of one long text would."""

    def __init__(self, length: int, row: int = TOKEN_ROW, pool: int = TOKEN_POOL) -> None:
        self.length = length
        self.row = row
        self.data = torch.arange(max(pool, 2 * row), dtype=torch.int64)
        self.starts = (len(self.data) - row) // (row - 1) + 1 if row > 1 else len(self.data)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        start = (i % self.starts) * (self.row - 1)
        return self.data[start : start + self.row]


def varlen_lengths(
    length: int,
    low: int = VARLEN_MIN,
    high: int = VARLEN_MAX,
    alpha: float = VARLEN_ALPHA,
    seed: int = VARLEN_SEED,
    kind: str = "pareto",
) -> np.ndarray:
    """``length`` row lengths (int64) from ``low`` to ``high`` tokens, the same for the same
    arguments: with a Pareto tail of shape ``alpha`` (see :data:`VARLEN_ALPHA`), or lognormal
    around ``high / 8``, or that lognormal draw in ascending order (:data:`VARLEN_LENGTHS`)."""
    rng = np.random.default_rng(seed)
    if kind == "pareto":
        u = 1.0 - rng.random(length)  # in (0, 1]
        drawn = low * u ** (-1.0 / alpha)
    elif kind in ("lognormal", "ascending"):
        drawn = np.exp(rng.normal(np.log(high / 8), VARLEN_SIGMA, length))
    else:
        raise ValueError(f"unknown varlen lengths {kind!r}: one of {VARLEN_LENGTHS}")
    lengths = np.clip(np.floor(drawn), low, high).astype(np.int64)
    return np.sort(lengths) if kind == "ascending" else lengths


def pad_collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dynamic padding, as NLP training scripts collate: the rows (1-d int64 token ids of
    different lengths) padded with 0 to the batch's longest one, and the attention mask (1 on
    a row's tokens, 0 on its padding), both ``(len(rows), longest)`` int64."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    input_ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
    positions = torch.arange(input_ids.shape[1], dtype=torch.int64)
    attention_mask = (positions < lengths[:, None]).to(torch.int64)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


class VarlenRows(Dataset[Any]):
    """One row of int64 token ids per item, of a length from :func:`varlen_lengths` (drawn
    once, here, so every loader and every worker sees the same rows): a view into a
    preallocated ``arange`` (shared with forked workers, never written after start-up).
    Batches are made by :attr:`collate_fn` (:func:`pad_collate`)."""

    collate_fn = staticmethod(pad_collate)

    def __init__(
        self, length: int, low: int = VARLEN_MIN, high: int = VARLEN_MAX, kind: str = "pareto"
    ) -> None:
        self.length = length
        self.kind = kind
        self.lengths = varlen_lengths(length, low, high, kind=kind)
        self.data = torch.arange(max(VARLEN_POOL, 2 * high), dtype=torch.int64)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        n = int(self.lengths[i])
        start = (i * 7919) % (len(self.data) - n + 1)
        return self.data[start : start + n]

    def batch_bytes(self, batch_size: int) -> np.ndarray:
        """Bytes of each whole batch of ``batch_size`` rows, in order (``drop_last``), as
        :func:`batch_nbytes` counts them: two int64 arrays of rows x the longest row."""
        whole = len(self.lengths) // batch_size * batch_size
        longest = self.lengths[:whole].reshape(-1, batch_size).max(axis=1)
        return longest * batch_size * 2 * 8


def collate_of(dataset: Any) -> Any:
    """The collate function a workload's batches are made with (None: torch's default)."""
    return getattr(dataset, "collate_fn", None)


class MemmapImages(Dataset[Any]):
    """``(image, label)`` where the image views item ``i`` of a uint8 ``numpy.memmap``.

    Each process maps the file itself on first use (copy-on-write, so views are writable
    and torch does not warn); the mapping is not pickled.
    """

    def __init__(self, path: str, items: int, shape: tuple[int, ...], length: int) -> None:
        self.path = path
        self.items = items
        self.shape = shape
        self.length = length
        self._array: np.ndarray | None = None

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_array": None}

    def __getitem__(self, i: int) -> Any:
        if self._array is None:
            self._array = np.memmap(self.path, np.uint8, "c", shape=(self.items, *self.shape))
        return torch.from_numpy(self._array[i % self.items]), i


def ensure_memmap(data_dir: str, items: int, shape: tuple[int, ...]) -> str:
    """The path of a file of ``items`` uint8 images of ``shape`` (item ``i`` filled with
    ``i % 251``), written in large chunks the first time it is asked for."""
    item_bytes = math.prod(shape)
    os.makedirs(data_dir, exist_ok=True)
    name = f"images-{'x'.join(map(str, shape))}-{items}.u8"
    path = os.path.join(data_dir, name)
    if os.path.exists(path) and os.path.getsize(path) == items * item_bytes:
        return path
    tmp = f"{path}.{os.getpid()}.tmp"
    chunk = max(1, (64 << 20) // item_bytes)
    with open(tmp, "wb") as f:
        for start in range(0, items, chunk):
            index = np.arange(start, min(items, start + chunk))
            block = np.empty((len(index), item_bytes), dtype=np.uint8)
            block[:] = (index % 251).astype(np.uint8)[:, None]
            f.write(block.data)
    os.replace(tmp, path)
    return path


def make_dataset(
    name: str, length: int, shape: tuple[int, ...], data_dir: str, lengths: str = "pareto"
) -> Dataset[Any]:
    """Workload ``name`` with ``length`` items of image ``shape`` (tokens: rows of ``shape``;
    varlen: rows of ``shape[0]`` to ``shape[1]`` tokens, their lengths drawn as ``lengths``
    says)."""
    item_bytes = math.prod(shape)
    if name == "tokens":
        return TokenRows(length, row=shape[0])
    if name == "varlen":
        return VarlenRows(length, low=shape[0], high=shape[1], kind=lengths)
    if name == "synthetic":
        return SyntheticImages(length, shape)
    if name == "nested":
        return NestedItems(length, shape)
    if name == "ceiling":
        return PreloadedImages(length, shape, max(1, min(length, CEILING_MAX_BYTES // item_bytes)))
    if name == "memmap":
        items = max(1, min(length, MEMMAP_MAX_BYTES // item_bytes))
        return MemmapImages(ensure_memmap(data_dir, items, shape), items, shape, length)
    raise ValueError(f"unknown workload {name!r}")


# -- batches ------------------------------------------------------------------------------


def tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a batch (nested tuples, lists and dicts)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from tensors(v)


class MadeBatch(NamedTuple):
    """What a worker sends for a batch it made and dropped: only its size."""

    nbytes: int


class MadeAndDropped:
    """A collate function that makes each batch, then drops it and returns its size
    (:class:`MadeBatch`): a loader with it moves nothing but a number, so its rate is the
    workers' own.

    With ``collate`` (a workload's own), the batch is what it makes. Without, it is torch's
    default collation with each stack written into memory the worker keeps from one batch to
    the next (as pinpool's workers write into memory they keep), not into fresh pages, whose
    faulting in would make the workers' rate lower than what a loader can reach."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate
        self._kept: dict[tuple[Any, ...], torch.Tensor] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"collate": self.collate, "_kept": {}}  # (each worker keeps its own memory)

    def __call__(self, samples: Any) -> MadeBatch:
        if self.collate is not None:
            return MadeBatch(batch_nbytes(self.collate(samples)))
        from torch.utils.data._utils.collate import collate, default_collate_fn_map

        kept = {**default_collate_fn_map, torch.Tensor: self._stack_into_kept}
        return MadeBatch(batch_nbytes(collate(samples, collate_fn_map=kept)))

    def _stack_into_kept(self, batch: Any, *, collate_fn_map: Any = None) -> torch.Tensor:
        first = batch[0]
        key = (len(batch), tuple(first.shape), first.dtype)
        out = self._kept.get(key)
        if out is None:
            out = self._kept[key] = torch.empty((len(batch), *first.shape), dtype=first.dtype)
        return torch.stack(batch, 0, out=out)


def batch_nbytes(batch: Any) -> int:
    """Bytes of all tensors in a batch (strings and other leaves count 0); a batch made and
    dropped in its worker counts the bytes it had."""
    if isinstance(batch, MadeBatch):
        return batch.nbytes
    return sum(t.nbytes for t in tensors(batch))


def largest(batch: Any) -> torch.Tensor:
    """The batch's largest tensor (the images)."""
    return max(tensors(batch), key=lambda t: t.numel())


def move(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    """The batch with every tensor moved by ``.to(device, non_blocking=...)``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: move(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move(v, device, non_blocking) for v in batch)
    return batch
