"""The soak's cases: one draw from the whole matrix of a loader's modes, and the datasets they
load (in an importable module, so that ``forkserver`` workers can unpickle them).

A case is drawn from a seeded generator (:func:`draw`): the delivery mode (copy or zero-copy,
torch's pin thread or not, the device where there is one), the workers, the start method, the
distribution of batch sizes, what the consumer keeps, persistent workers, a ``break`` in the
first epoch. ``tests/soak/test_soak.py`` runs each against torch's own loader.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

#: Size distributions of the batches, in bytes (:func:`batch_sizes`).
SIZES = ("fixed", "lognormal", "ascending", "descending", "alternating", "at_max")
#: What the consumer keeps of the batches it is handed.
KEEPS = ("nothing", "last", "everything")
#: How many batches the consumer keeps with ``keep="last"``.
KEPT_LAST = 3


@dataclasses.dataclass(frozen=True)
class Case:
    """One run of the soak."""

    seed: int
    zero_copy: bool
    pin_thread: bool
    device: str | None
    workers: int
    context: str
    sizes: str
    keep: str
    persistent: bool
    brk: bool
    streamed: bool
    batches: int
    batch_size: int
    median: int  # bytes of a typical batch

    @property
    def id(self) -> str:
        mode = ("zero-copy" if self.zero_copy else "copy") + ("+pin" if self.pin_thread else "")
        mode += f"+{self.device}" if self.device else ""
        parts = [mode, f"w{self.workers}", self.context, self.sizes, f"keep-{self.keep}"]
        parts += ["persistent"] * self.persistent + ["break"] * self.brk
        parts += ["streamed" if self.streamed else "padded", f"s{self.seed}"]
        return "-".join(parts)


def draw(seed: int, devices: tuple[str, ...] = ()) -> Case:
    """The case of ``seed``: every dimension drawn independently (the device from
    ``devices``, where there are any)."""
    rng = random.Random(seed)
    workers = rng.choice((0, 1, 2, 8))
    sizes = rng.choice(SIZES)
    return Case(
        seed=seed,
        zero_copy=rng.random() < 0.5,
        pin_thread=rng.random() < 0.5,
        device=rng.choice((None, *devices)) if devices else None,
        workers=workers,
        context=rng.choice(("fork", "forkserver")),
        sizes=sizes,
        keep=rng.choice(KEEPS),
        persistent=workers > 0 and rng.random() < 0.4,
        brk=rng.random() < 0.3,
        # (a batch at the largest allowed is one array: its bytes are exactly the batch's)
        streamed=sizes == "at_max" or rng.random() < 0.5,
        batches=rng.randint(16, 40),
        batch_size=rng.choice((4, 8, 16)),
        median=rng.choice((64 << 10, 256 << 10, 1 << 20)),
    )


def batch_sizes(case: Case) -> list[int]:
    """Each batch's bytes, in order, before rounding to whole rows."""
    n, m = case.batches, case.median
    rng = np.random.default_rng(case.seed)
    if case.sizes == "fixed":
        sizes = np.full(n, m, dtype=float)
    elif case.sizes == "lognormal":
        sizes = np.clip(np.exp(rng.normal(np.log(m), 0.5, n)), m / 4, 2.5 * m)
    elif case.sizes == "ascending":
        sizes = np.linspace(m / 4, 2.5 * m, n)
    elif case.sizes == "descending":
        sizes = np.linspace(2.5 * m, m / 4, n)
    elif case.sizes == "alternating":
        sizes = np.where(np.arange(n) % 2 == 0, 4096.0, 2.5 * m)
    else:  # at_max: one batch at the largest the loader allows, the others below it
        sizes = np.clip(np.exp(rng.normal(np.log(m), 0.3, n)), m / 4, 2 * m)
        sizes[n // 2] = 2.5 * m
    return [int(s) for s in sizes]


def row_lengths(case: Case) -> list[int]:
    """Each batch's row length, in int64 tokens: a padded batch is two arrays (ids, mask) of
    ``batch_size`` rows, a streamed one one array."""
    arrays = 1 if case.streamed else 2
    return [max(1, s // (case.batch_size * 8 * arrays)) for s in batch_sizes(case)]


class BatchRows(Dataset):  # type: ignore[type-arg]
    """Item ``i`` is one int64 row of batch ``i // batch_size``'s length: ``i * 7 + j`` at
    ``j``. With ``ragged``, each row of a batch but the last is a little shorter (padding
    makes the batch as long as its longest row)."""

    def __init__(self, lengths: list[int], batch_size: int, ragged: bool) -> None:
        self.lengths = lengths
        self.batch_size = batch_size
        self.ragged = ragged

    def __len__(self) -> int:
        return len(self.lengths) * self.batch_size

    def __getitem__(self, i: int) -> torch.Tensor:
        n = self.lengths[i // self.batch_size]
        if self.ragged and i % self.batch_size != self.batch_size - 1:
            n = max(1, n - (i % 7))
        return torch.arange(n, dtype=torch.int64) + i * 7


def pad_collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dynamic padding: the rows padded to the longest, and an attention mask."""
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.int64)
    mask = torch.zeros(len(rows), longest, dtype=torch.int64)
    for k, r in enumerate(rows):
        ids[k, : len(r)] = r
        mask[k, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def dataset_of(case: Case) -> tuple[Dataset, Any]:  # type: ignore[type-arg]
    """The case's dataset and collate function (None: torch's default, streamed)."""
    if case.streamed:
        return BatchRows(row_lengths(case), case.batch_size, ragged=False), None
    return BatchRows(row_lengths(case), case.batch_size, ragged=True), pad_collate
