"""``accelerator.prepare`` with a ``pinpool.DataLoader``, on every rank, in copy and in
zero-copy mode (one launch for both).

    python tests/frameworks/scripts/accelerate_ranks.py OUT_DIR                      (one process)
    torchrun --nproc-per-node 2 tests/frameworks/scripts/accelerate_ranks.py OUT_DIR (two CPU ranks)

accelerate is imported before pinpool here (the in-process tests import pinpool first), so
the hook patches a module already loaded. For each mode, each rank trains a few steps on the
shard ``prepare`` returned and records what it saw; loads the same epoch from accelerate's own
shard of a plain torch loader, from the same seeds, for comparison; and checks that a state
taken mid-epoch, loaded into a newly prepared loader, yields the rest of that epoch. Each rank
writes ``OUT_DIR/rank<N>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import accelerate.data_loader
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

import pinpool

SAMPLES = 32
BATCH = 4
SETTINGS: dict[str, Any] = {"slot_bytes": 1 << 20, "num_slots": 7, "copy_threads": 1}


class Numbers(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((8,), float(i)), "idx": torch.tensor(i)}


def in_pool(loader: Any, x: torch.Tensor) -> bool:
    pool = loader.pool
    start = x.untyped_storage().data_ptr()
    return pool is not None and pool.address <= start < pool.address + pool.arena_bytes


def epoch(accelerator: Accelerator, loader: Any, seed: int) -> list[list[int]]:
    torch.manual_seed(seed)
    return [batch["idx"].tolist() for batch in loader]


def mode(accelerator: Accelerator, zero_copy: bool) -> dict[str, Any]:
    def ours() -> Any:
        torch.manual_seed(1)  # prepare draws the sampler's seed from torch's RNG
        made = pinpool.DataLoader(
            Numbers(),
            batch_size=BATCH,
            shuffle=True,
            num_workers=2,
            zero_copy=zero_copy,
            **SETTINGS,
        )
        return accelerator.prepare(made)

    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    shard = ours()
    torch.manual_seed(2)
    seen: list[int] = []
    steps = 0
    pooled = True
    for batch in shard:
        pooled = pooled and in_pool(shard, batch["x"])
        seen += batch["idx"].tolist()
        loss = model(batch["x"]).sum()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    stats = shard.stats()
    base = shard.base_dataloader
    # accelerate's own shard of a torch loader, from the same seeds.
    torch.manual_seed(1)
    plain = accelerator.prepare(
        DataLoader(Numbers(), batch_size=BATCH, shuffle=True)  # (workers change no order)
    )
    expected = epoch(accelerator, plain, 2)
    # Mid-epoch: a state after 2 batches, then the epoch's rest; a newly prepared loader
    # given that state yields the same rest.
    torch.manual_seed(3)
    it = iter(shard)
    head = [next(it)["idx"].tolist() for _ in range(2)]
    state = shard.state_dict()
    rest = [b["idx"].tolist() for b in it]
    again = ours()
    again.load_state_dict(state)
    torch.manual_seed(4)  # (the state puts the RNG back as it was)
    resumed = [b["idx"].tolist() for b in again]
    return {
        "seen": seen,
        "batches_seen": [seen[i : i + BATCH] for i in range(0, len(seen), BATCH)],
        "expected": expected,
        "steps": steps,
        "batches": stats["batches"],
        "zero_copy_batches": stats["zero_copy_batches"],
        "in_pool": pooled,
        "loader": f"{type(base).__module__}.{type(base).__qualname__}",
        "settings": [getattr(base, name) for name in (*SETTINGS, "zero_copy")],
        "head": head,
        "rest": rest,
        "resumed": resumed,
        "resumed_batches": again.stats()["batches"],
    }


def main() -> None:
    out = sys.argv[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = Accelerator(cpu=True)  # gloo between CPU ranks under torchrun
        report: dict[str, Any] = {
            "rank": accelerator.process_index,
            "ranks": accelerator.num_processes,
            "hooked": hasattr(accelerate.data_loader.prepare_data_loader, "__pinpool_wraps__"),
        }
        for zero_copy in (False, True):
            report["zero-copy" if zero_copy else "copy"] = mode(accelerator, zero_copy)
    report["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
