"""Which scenarios a bench run has, and the one line that describes each in the report.

Invariants: the scenarios follow the configuration alone (``cli.Config``): each workload in
``throughput`` mode, then ``compute`` (CUDA only; not the ``tokens`` and ``varlen`` workloads),
then ``stall`` and ``churn`` where asked; a description is read off the dataset a run uses
(its first item, or the varlen rows' sizes over the epoch), never off a run's results.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .cli import CHURN_BATCH, CHURN_ITEMS, CHURN_LOADERS, STALL_ITEMS, Config
from .measure import Scenario
from .workloads import (
    TOKEN_ROW,
    VARLEN_ALPHA,
    VARLEN_MAX,
    VARLEN_MIN,
    VARLEN_SEED,
    VARLEN_SIGMA,
    VarlenRows,
    batch_nbytes,
    largest,
)


def plan_scenarios(cfg: Config) -> dict[str, Scenario]:
    """Scenario name -> what its runs do."""
    out: dict[str, Scenario] = {}
    for workload in cfg.workloads:
        for mode in ("throughput", "compute"):
            if mode not in cfg.modes or (mode == "compute" and cfg.device is None):
                continue
            if workload == "tokens":
                if mode == "throughput":
                    out[f"{workload}/{mode}"] = Scenario(
                        workload, mode, cfg.token_batch_size, (TOKEN_ROW,), cfg.token_workers,
                        cfg.prefetch_factor, cfg.token_warmup, cfg.token_steps,
                    )  # fmt: skip
                continue
            if workload == "varlen":
                if mode == "throughput":
                    out[f"{workload}/{mode}"] = Scenario(
                        workload, mode, cfg.varlen_batch_size, (VARLEN_MIN, VARLEN_MAX),
                        cfg.varlen_workers, cfg.prefetch_factor, cfg.varlen_warmup,
                        cfg.varlen_steps,
                    )  # fmt: skip
                continue
            out[f"{workload}/{mode}"] = Scenario(
                workload, mode, cfg.batch_size, cfg.shape, cfg.workers,
                cfg.prefetch_factor, cfg.warmup, cfg.steps,
            )  # fmt: skip
    if "churn" in cfg.modes:
        # (warm-up: none; steps: the loaders made; the shape: one small image an item)
        out["churn"] = Scenario(
            "synthetic", "churn", CHURN_BATCH, (3, 16, 16), 0, cfg.prefetch_factor, 0,
            CHURN_LOADERS,
        )  # fmt: skip
    if "stall" in cfg.modes:
        out["stall"] = Scenario(
            "synthetic", "stall", STALL_ITEMS, cfg.stall_shape, cfg.stall_workers,
            cfg.prefetch_factor, cfg.stall_warmup, cfg.stall_steps,
        )  # fmt: skip
    return out


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.0f} KB"


def describe_varlen(sc: Scenario, dataset: VarlenRows, cfg: Config) -> str:
    """One line for the varlen workload: the rows, the padded batches' sizes over the epoch."""
    sizes = dataset.batch_bytes(sc.batch_size)
    drawn = {
        "pareto": f"Pareto tail, alpha {VARLEN_ALPHA:g}",
        "lognormal": f"lognormal, sigma {VARLEN_SIGMA:g}",
        "ascending": f"lognormal, sigma {VARLEN_SIGMA:g}, shortest first",
    }[dataset.kind]
    return (
        f"varlen, batch {sc.batch_size} rows of {sc.shape[0]}..{sc.shape[1]} int64 tokens "
        f"({drawn}, seed {VARLEN_SEED}), padded per batch to its "
        f"longest row: input_ids + int64 attention_mask = {_size(sizes.min())} to "
        f"{_size(sizes.max())} ({sizes.max() / sizes.min():.0f}x), median "
        f"{_size(float(np.median(sizes)))}, mean {_size(float(sizes.mean()))} over the epoch; "
        f"{sc.workers} workers x prefetch {sc.prefetch_factor}, {sc.steps} steps after "
        f"{sc.warmup} warm-up, {f'then .to({cfg.device})' if cfg.device else 'no device copy'}, "
        "no compute"
    )


def describe(sc: Scenario, dataset: Any, cfg: Config) -> str:
    """One line: the batch, the workers, the steps, what the consumer does."""
    if isinstance(dataset, VarlenRows):
        return describe_varlen(sc, dataset, cfg)
    item = dataset[0]
    nbytes = batch_nbytes(item) * sc.batch_size
    dtype = str(largest(item).dtype).removeprefix("torch.")
    what = {
        "throughput": "no compute",
        "compute": f"{cfg.compute_ms:g} ms GPU work + loss.item() per step",
        "stall": "big batches, the loader's whole life: main-thread stalls per phase",
        "churn": f"{sc.steps} loaders made one after the other, each run for one epoch of "
        f"{CHURN_ITEMS} items and dropped",
    }[sc.mode]
    steps = f"{sc.steps} steps after {sc.warmup} warm-up"
    if sc.mode == "stall":
        steps = f"2 epochs of {sc.warmup + sc.steps} batches (timed steps: the last {sc.steps} "
        steps += "of epoch 1)"
    elif sc.mode == "churn":
        steps = f"{CHURN_ITEMS // sc.batch_size} batches a loader"
    size = _size(nbytes)
    return (
        f"{sc.workload}, batch {sc.batch_size} x {'x'.join(map(str, sc.shape))} {dtype} = "
        f"{size}, {sc.workers} workers x prefetch {sc.prefetch_factor}, {steps}, "
        f"{f'then .to({cfg.device})' if cfg.device else 'no device copy'}, {what}"
    )
