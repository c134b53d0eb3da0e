"""Datasets for the GPU DataLoader tests (importable, so spawned workers can unpickle them)."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset


class Mixed(Dataset):
    """Dict samples: an image, float features, a numpy vector, a label and a name."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {
            "image": torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=g),
            "features": torch.randn(64, generator=g, dtype=torch.float32),
            "half": torch.randn(8, generator=g).to(torch.bfloat16),
            "vec": np.arange(16, dtype=np.int32) * i,
            "label": i,
            "name": f"item-{i}",
        }


class Images(Dataset):
    """uint8 images filled with ``index % 251``, and the index as label."""

    def __init__(self, n: int, c: int, h: int, w: int) -> None:
        self.n, self.shape = n, (c, h, w)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full(self.shape, i % 251, dtype=torch.uint8), i


class Tokens(Dataset):
    """int64 rows of ``length`` tokens: alone (``keys`` empty), or a dict of ``keys``, each row
    ``index * 1000 + k`` plus the position (every leaf one dtype, as token ids, a mask and
    labels are)."""

    def __init__(self, n: int, length: int, keys: tuple[str, ...] = ()) -> None:
        self.n, self.length, self.keys = n, length, keys

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor | dict[str, torch.Tensor]:
        row = torch.arange(self.length, dtype=torch.int64) + i * 1000
        if not self.keys:
            return row
        return {k: row + j for j, k in enumerate(self.keys)}


def strided_leaves(samples: list, rows: int = 6, expanded: bool = True) -> dict:
    """A collate function whose leaves are not contiguous, each in its own way (``rows`` x
    4096 floats: 96 KiB at 6 rows, about 4.7 MiB at 300); ``expanded``: with one whose
    elements share memory (stride 0), which torch's ``pin_memory()`` refuses."""
    x = torch.arange(rows * 4096, dtype=torch.float32).reshape(rows, 4096)
    more = {"expanded": torch.arange(float(rows)).reshape(rows, 1).expand(rows, 64)}
    return {
        "transposed": x.t(),
        **(more if expanded else {}),
        "negative_bit": torch._neg_view(x.t()),
        "sliced": x[:, ::2],
        "channels_last": x.reshape(rows, 4, 32, 32).to(memory_format=torch.channels_last),
        "int_permuted": torch.arange(rows * 60, dtype=torch.int16).reshape(rows, 60).t(),
    }
