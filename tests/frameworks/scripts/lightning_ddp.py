"""Lightning ``strategy="ddp"`` with two CPU ranks (gloo), each with a pinpool.DataLoader.

Run as a script (Lightning's launcher starts rank 1 by running this file again):

    python tests/frameworks/scripts/lightning_ddp.py OUT_DIR [hook|passed]

``hook``: the loader is made in ``train_dataloader`` (and ``pinpool`` first imported there);
``passed``: made up front and handed to ``Trainer.fit``. Each rank writes
``OUT_DIR/rank<N>.json``: the sample indices its steps saw, the steps run, what its loader's
``stats()`` counted, its pool's slot size and count, whether every batch lay in the pool, and
the warnings raised.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import Dataset

SAMPLES = 32
BATCH = 4
SLOT_BYTES = 1 << 20
NUM_SLOTS = 7


class Numbers(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((8,), float(i)), "idx": torch.tensor(i)}


def make_loader() -> Any:
    import pinpool  # first imported here in the "hook" case

    # Settings of pinpool's own, which a rebuilt loader must keep.
    return pinpool.DataLoader(
        Numbers(), batch_size=BATCH, num_workers=2, slot_bytes=SLOT_BYTES, num_slots=NUM_SLOTS
    )


class Model(pl.LightningModule):
    def __init__(self, loader: Any = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.loader = loader
        self.seen: list[int] = []
        self.in_pool = True

    def train_dataloader(self) -> Any:
        if self.loader is None:
            self.loader = make_loader()
        return self.loader

    def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
        self.seen += batch["idx"].tolist()
        used = self.trainer.train_dataloader  # the loader Lightning iterates (maybe rebuilt)
        pool = used.pool
        start = batch["x"].untyped_storage().data_ptr()
        ok = pool is not None and pool.address <= start < pool.address + pool.arena_bytes
        self.in_pool = self.in_pool and ok
        return self.layer(batch["x"]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    out, how = sys.argv[1], sys.argv[2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = Model(make_loader() if how == "passed" else None)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model)
    used = trainer.train_dataloader
    report = {
        "rank": trainer.global_rank,
        "seen": model.seen,
        "steps": trainer.global_step,
        "loader": type(used).__module__ + "." + type(used).__qualname__,
        "batches": used.stats()["batches"],
        "pool": [used.pool.slot_bytes, used.pool.num_slots] if used.pool is not None else None,
        "in_pool": model.in_pool,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
