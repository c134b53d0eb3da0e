"""accelerate with pinpool, as the user guide shows it: accelerate's loader stays in charge of the
sampling (and of sharding between ranks), ``pinpool.pinned`` puts its batches in pinned slots.

    python tests/frameworks/accelerate_ranks.py OUT_DIR                  (one process)
    torchrun --nproc-per-node 2 tests/frameworks/accelerate_ranks.py OUT_DIR   (two CPU ranks)

Each rank writes ``OUT_DIR/rank<N>.json``: the sample indices it saw, the steps, what the
wrapper's ``stats()`` counted, whether every batch lay in the pool, and the warnings raised.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

import pinpool

SAMPLES = 32
BATCH = 4


class Numbers(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((8,), float(i)), "idx": torch.tensor(i)}


def main() -> None:
    out = sys.argv[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # A GPU per rank where there are enough, else CPU ranks (gloo).
        ranks = int(os.environ.get("WORLD_SIZE", "1"))
        accelerator = Accelerator(cpu=torch.cuda.device_count() < ranks)
        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        inner = DataLoader(Numbers(), batch_size=BATCH, shuffle=True, num_workers=2)
        model, optimizer = accelerator.prepare(model, optimizer)
        # accelerate shards and shuffles; pinpool pins (and, on a GPU, copies to the device).
        shard = accelerator.prepare_data_loader(inner, device_placement=False)
        device = accelerator.device if accelerator.device.type == "cuda" else None
        loader = pinpool.pinned(shard, device=device)
        seen: list[int] = []
        steps = 0
        in_pool = True
        for batch in loader:
            x = batch["x"]
            if device is None:
                pool = loader.pool
                start = x.untyped_storage().data_ptr()
                in_pool = (
                    in_pool
                    and pool is not None
                    and pool.address <= start < pool.address + pool.arena_bytes
                )
            else:
                in_pool = in_pool and x.device.type == "cuda"
            seen += batch["idx"].tolist()
            loss = model(x).sum()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    report = {
        "rank": accelerator.process_index,
        "seen": seen,
        "steps": steps,
        "batches": loader.stats()["batches"],
        "in_pool": in_pool,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    }
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
