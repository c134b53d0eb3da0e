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

Also the helpers that walk a batch: its tensors, its size in bytes, the move to a device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

WORKLOADS = ("synthetic", "memmap", "nested", "ceiling", "tokens")

#: int64 values per item of the tokens workload.
TOKEN_ROW = 8193
#: The tokens workload slices its rows from this many preallocated int64 values (32 MiB).
TOKEN_POOL = 1 << 22

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


def make_dataset(name: str, length: int, shape: tuple[int, ...], data_dir: str) -> Dataset[Any]:
    """Workload ``name`` with ``length`` items of image ``shape`` (tokens: rows of ``shape``)."""
    item_bytes = math.prod(shape)
    if name == "tokens":
        return TokenRows(length, row=shape[0])
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


def batch_nbytes(batch: Any) -> int:
    """Bytes of all tensors in a batch (strings and other leaves count 0)."""
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
