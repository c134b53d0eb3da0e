"""Data-parallel runs of the bench: N ranks, one GPU each, every rank loading its own shard.

``python -m pinpool.bench --ranks N`` starts N copies of itself under torchrun
(``python -m torch.distributed.run --standalone --nproc-per-node N -m pinpool.bench ...``);
``torchrun --nproc-per-node N -m pinpool.bench ...`` is the same run. Each rank uses
``cuda:LOCAL_RANK`` and joins a process group (NCCL with GPUs, gloo without); its datasets are
``N`` times a one-rank run's, and a ``DistributedSampler`` gives it its shard, so every rank
times the same number of batches as a one-rank run. The compute scenario's step adds a
``DistributedDataParallel`` model's forward and backward, whose gradients are all-reduced over
NCCL, so the loaders run next to real collective traffic.

Invariants:

- every rank plans the same scenarios and runs the same loaders in the same order, and each
  run starts on every rank at once (:meth:`Ranks.barrier`): a run's figures on each rank are
  taken while the other ranks load the same way, so their sum is the host's total;
- only rank 0 writes the report; it holds every rank's runs, each tagged with its ``rank``,
  and :func:`totals` sums the ranks' rates run by run (the same repeat of the same loader).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """This process's place in a data-parallel run (from torchrun's environment)."""

    rank: int
    world: int
    local_rank: int

    @classmethod
    def from_env(cls) -> Ranks | None:
        """The run's ranks when torchrun started more than one, else None."""
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world <= 1:
            return None
        return cls(
            rank=int(os.environ["RANK"]),
            world=world,
            local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
        )

    def start(self, cuda: bool) -> str | None:
        """Joins the process group; returns this rank's CUDA device (None without CUDA).
        Exits (status 2, one line from local rank 0) when the host has fewer GPUs than
        ranks: a started ``torchrun --nproc-per-node N -m pinpool.bench`` gets there."""
        device = None
        if cuda:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world) or self.world)
            why = missing_gpus(local, torch.cuda.device_count())
            if why is not None:
                if self.local_rank == 0:
                    print(f"pinpool.bench: {why}", file=sys.stderr, flush=True)
                raise SystemExit(2)
            torch.cuda.set_device(self.local_rank)
            device = f"cuda:{self.local_rank}"
        dist.init_process_group("nccl" if cuda else "gloo")
        return device

    def barrier(self) -> None:
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (on every rank)."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def end(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def missing_gpus(ranks: int, gpus: int) -> str | None:
    """Why ``ranks`` ranks, one GPU each, cannot run on a host with ``gpus`` GPUs (None: they
    can). One line, for the user."""
    if gpus >= ranks:
        return None
    return (
        f"--ranks {ranks} needs {ranks} GPUs (one per rank) but this machine has {gpus}; "
        f"use --ranks {max(1, gpus)} or fewer, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run "
        "the ranks on the CPU over gloo"
    )


def launch(argv: list[str], ranks: int) -> int:
    """Runs the bench with ``argv`` as ``ranks`` ranks under torchrun; its exit code."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        "pinpool.bench",
        *argv,
    ]
    print("running: " + " ".join(command), file=sys.stderr, flush=True)
    return subprocess.call(command)


class DataParallelStep:
    """The part of a compute step a data-parallel model adds: a ``DistributedDataParallel``
    linear layer's forward and backward on the current stream; its gradients (``width``^2
    floats) are all-reduced across the ranks as the backward runs."""

    def __init__(self, device: torch.device, width: int = 2048) -> None:
        layer = torch.nn.Linear(width, width, device=device)
        self.model = torch.nn.parallel.DistributedDataParallel(layer, device_ids=[device.index])
        self.x = torch.randn(64, width, device=device)

    def __call__(self, scale: torch.Tensor) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        out = self.model(self.x * scale.detach()).float().mean()
        out.backward()
        return out.detach()


def totals(runs: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """``{scenario: {loader: {...}}}``: per rank the median GB/s and GPU idle share and the
    worst probe lateness; over ranks the total GB/s of each repeat (the sum of the ranks'
    rates: their runs were timed together), its median, and how many repeats every rank
    finished."""
    by: dict[tuple[str, str], dict[int, dict[int, dict[str, Any]]]] = {}
    for r in runs:
        if r.get("error"):
            continue
        key = (r["scenario"], r["loader"])
        by.setdefault(key, {}).setdefault(r["repeat"], {})[r.get("rank", 0)] = r
    out: dict[str, Any] = {}
    for (scenario, loader), repeats in by.items():
        whole = [reps for reps in repeats.values() if len(reps) == world]
        sums = [sum(reps[k]["gb_per_s"] for k in reps) for reps in whole]

        out.setdefault(scenario, {})[loader] = {
            "total_gbps_median": statistics.median(sums) if sums else None,
            "total_gbps": sums,
            "per_rank_gbps": _per_rank(repeats, world, "gb_per_s", statistics.median),
            "per_rank_idle_share": _per_rank(repeats, world, "idle_share", statistics.median),
            "per_rank_probe_max_ms": _per_rank(repeats, world, "probe_max_ms", max),
            "complete_repeats": len(whole),
        }
    return out


def _per_rank(
    repeats: dict[int, dict[int, dict[str, Any]]], world: int, field: str, pick: Any
) -> list[float | None]:
    """``pick`` (median, max) of each rank's ``field`` over its repeats."""
    values = []
    for rank in range(world):
        got = [
            reps[rank][field]
            for reps in repeats.values()
            if rank in reps and reps[rank].get(field) is not None
        ]
        values.append(pick(got) if got else None)
    return values


def table_lines(result: dict[str, Any]) -> list[str]:
    """The ranks' block of the text report."""
    world = result["meta"].get("ranks", 1)
    lines = [
        "",
        f"{world} ranks, each loading its own shard: total GB/s (sum of the "
        "ranks' rates, median over repeats, xR = / the baseline's total) | per rank GB/s | "
        "per rank GPU idle | per rank worst probe late ms",
    ]
    base_name = result["baseline"]
    for scenario, by_loader in result.get("ranks_summary", {}).items():
        lines.append(f"  {scenario}")
        base = (by_loader.get(base_name) or {}).get("total_gbps_median")
        for loader in result["loaders"]:
            t = by_loader.get(loader)
            if t is None:
                continue
            total = t["total_gbps_median"]
            ratio = f" x{total / base:.2f}" if total and base and loader != base_name else ""

            def show(values: list[float | None], fmt: str) -> str:
                return " / ".join("-" if v is None else fmt.format(v) for v in values)

            lines.append(
                f"    {loader:<18} {'-' if total is None else f'{total:.2f}'}{ratio:<7} | "
                f"{show(t['per_rank_gbps'], '{:.2f}')} | "
                f"{show(t['per_rank_idle_share'], '{:.1%}')} | "
                f"{show(t['per_rank_probe_max_ms'], '{:.2f}')}"
            )
    return lines
