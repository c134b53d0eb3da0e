"""accelerate's ``prepare`` with a ``pinpool.DataLoader`` on a GPU: a few training steps of a
small model, with accelerate's device placement (the pinpool loader then delivers batches on
``accelerator.device`` itself) and without it (pinned CPU batches, views into the arena), in
copy and zero-copy mode; then a state taken mid-epoch, resumed in a newly prepared loader.
Prints the versions, and for each mode the batches that went through the pool; exits 1 if a
check fails. Needs nothing but torch, accelerate and pinpool (no network, no test files):

    PYTHONPATH=/tmp/pinpool-site python3 benchmarks/accelerate_gpu.py
    PYTHONPATH=/tmp/pinpool-site torchrun --nproc-per-node 2 benchmarks/accelerate_gpu.py
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device

import pinpool

SAMPLES = 512
BATCH = 32


class Images(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample ``i``: a 3x64x64 image filled with ``i``, and ``i``."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((3, 64, 64), float(i)), torch.tensor(i)


def resolved(device: torch.device) -> torch.device:
    """``device`` with its index ("cuda" is the current CUDA device, as tensors name it)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def in_pool(pool: Any, x: torch.Tensor) -> bool:
    start = x.untyped_storage().data_ptr()
    return pool is not None and pool.address <= start < pool.address + pool.arena_bytes


def run(accelerator: Accelerator, zero_copy: bool, placement: bool) -> list[str]:
    """Trains one epoch; returns what went wrong."""
    failures: list[str] = []
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 64 * 64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = pinpool.DataLoader(
        Images(), batch_size=BATCH, shuffle=True, num_workers=2, zero_copy=zero_copy
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    shard = accelerator.prepare_data_loader(loader, device_placement=placement)
    base = shard.base_dataloader
    if type(base) is not pinpool.DataLoader:
        return [f"accelerate's shard loads from a {type(base)}, not a pinpool.DataLoader"]
    steps = 0
    seen: list[int] = []
    for images, labels in shard:
        if placement:
            if images.device != resolved(accelerator.device):
                failures.append(f"a batch on {images.device}, not {accelerator.device}")
            moved = send_to_device(images, accelerator.device)
            if moved.data_ptr() != images.data_ptr():
                failures.append("accelerate's send_to_device copied a batch already there")
        else:
            if not (images.is_pinned() and in_pool(shard.pool, images)):
                failures.append("a CPU batch outside the pinned arena")
            images = images.to(accelerator.device, non_blocking=True)
            labels = labels.to(accelerator.device, non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(images), labels % 10)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seen += labels.tolist()
        steps += 1
    torch.cuda.synchronize()
    stats = shard.stats()
    expected = SAMPLES // BATCH // accelerator.num_processes
    pool = shard.pool
    print(
        f"rank {accelerator.process_index} {'zero-copy' if zero_copy else 'copy'} "
        f"placement={placement}: steps {steps}, batches through the pool {stats['batches']}, "
        f"zero-copy {stats['zero_copy_batches']}, fallbacks {stats['zero_copy_fallbacks']}, "
        f"overflow {stats['overflow_batches']}, loader device {base.device}, "
        f"pool {pool.memory if pool is not None else None} "
        f"{pool.arena_bytes if pool is not None else 0} bytes",
        flush=True,
    )
    if steps != expected or stats["batches"] != steps:
        failures.append(f"{steps} steps and {stats['batches']} pool batches, not {expected}")
    if stats["overflow_batches"]:
        failures.append("batches in ordinary memory")
    if pool is None or pool.memory != "pinned":
        failures.append(f"the arena is not pinned: {pool.memory if pool else None}")
    if zero_copy and not stats["zero_copy_batches"]:
        failures.append("no zero-copy batch")
    if len(set(seen)) != len(seen):
        failures.append("a sample twice on one rank")

    # Mid-epoch: 3 batches, a state, the rest; a newly prepared loader resumes the rest.
    torch.manual_seed(5)
    it = iter(shard)
    for _ in range(3):
        next(it)
    state = shard.state_dict()
    rest = [labels.tolist() for _, labels in it]
    again = accelerator.prepare_data_loader(
        pinpool.DataLoader(
            Images(), batch_size=BATCH, shuffle=True, num_workers=2, zero_copy=zero_copy
        ),
        device_placement=placement,
    )
    again.load_state_dict(state)
    resumed = [labels.tolist() for _, labels in again]
    if resumed != rest:
        failures.append("the resumed loader did not yield the rest of the epoch")
    return list(dict.fromkeys(failures))  # each kind once


def main() -> int:
    accelerator = Accelerator()
    if accelerator.is_main_process:
        print(
            f"torch {torch.__version__}, accelerate {importlib.metadata.version('accelerate')}, "
            f"pinpool {pinpool.__version__} from {pinpool.__file__}, "
            f"device {accelerator.device}, processes {accelerator.num_processes}",
            flush=True,
        )
    if accelerator.device.type != "cuda":
        print("no CUDA device: this check is for a GPU machine", flush=True)
        return 1
    failures = []
    for zero_copy in (False, True):
        for placement in (True, False):
            failures += run(accelerator, zero_copy, placement)
    for failure in failures:
        print(f"rank {accelerator.process_index} FAILED: {failure}", flush=True)
    if not failures:
        print(f"rank {accelerator.process_index} OK", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
