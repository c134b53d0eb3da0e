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
