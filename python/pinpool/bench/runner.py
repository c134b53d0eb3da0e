"""Runs the whole benchmark: plans the scenarios, alternates the loaders, writes the report.

Scenarios: each workload in ``throughput`` mode, then in ``compute`` mode (CUDA only), then
the ``stall`` scenario (synthetic images, big batches). Within a scenario the loaders take
turns: ``for repeat: for loader:``, each run with a freshly made loader, so slow drifts of
the machine touch every loader alike. One progress bar covers every run.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import multiprocessing
import os
import platform
import shlex
import socket
import sys
import warnings
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate
from tqdm import tqdm

import pinpool

from .cli import STALL_ITEMS, Config, cpu_count, resolve
from .loaders import BASELINE, LoaderSpec, check, spec_named
from .measure import ComputeWork, Scenario, h2d_ceiling, run_once
from .report import summarize, table, write_all
from .workloads import batch_nbytes, make_dataset


def machine(cfg: Config, argv: list[str]) -> dict[str, Any]:
    """What ran where: versions, CPUs, the GPU, the date, the exact command line."""
    cuda = cfg.device is not None
    name = torch.cuda.get_device_name(cfg.device) if cuda else None
    path = (
        f"host -> {cfg.device} ({name}): batches are copied to the GPU"
        if cuda
        else "HOST-ONLY: torch sees no CUDA device, so batches are not copied to a GPU and the "
        "compute loop is skipped; throughput = batches delivered to the consumer"
    )
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, "-m", "pinpool.bench", *argv]),
        "cwd": os.getcwd(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "numpy": np.__version__,
            "pinpool": pinpool.__version__,
        },
        "cpu_count": os.cpu_count(),
        "cpus_usable": cpu_count(),
        "start_method": multiprocessing.get_start_method(),
        "host_only": not cuda,
        "device": cfg.device,
        "device_name": name,
        "path": path,
        "machine": f"torch {torch.__version__}; {cpu_count()} CPUs; preset {cfg.preset}; "
        f"{cfg.repeats} repeats",
    }


def plan_scenarios(cfg: Config) -> dict[str, Scenario]:
    """Scenario name -> what its runs do."""
    out: dict[str, Scenario] = {}
    for workload in cfg.workloads:
        for mode in ("throughput", "compute"):
            if mode in cfg.modes and (mode != "compute" or cfg.device is not None):
                out[f"{workload}/{mode}"] = Scenario(
                    workload, mode, cfg.batch_size, cfg.shape, cfg.workers,
                    cfg.prefetch_factor, cfg.warmup, cfg.steps,
                )  # fmt: skip
    if "stall" in cfg.modes:
        out["stall"] = Scenario(
            "synthetic", "stall", STALL_ITEMS, cfg.stall_shape, cfg.stall_workers,
            cfg.prefetch_factor, cfg.stall_warmup, cfg.stall_steps,
        )  # fmt: skip
    return out


def describe(sc: Scenario, dataset: Any, cfg: Config) -> str:
    """One line: the batch, the workers, the steps, what the consumer does."""
    nbytes = batch_nbytes(dataset[0]) * sc.batch_size
    what = {
        "throughput": "no compute",
        "compute": f"{cfg.compute_ms:g} ms GPU work + loss.item() per step",
        "stall": "big batches: main-thread stalls",
    }[sc.mode]
    return (
        f"{sc.workload}, batch {sc.batch_size} x {'x'.join(map(str, sc.shape))} = "
        f"{nbytes / 1e6:.1f} MB, {sc.workers} workers x prefetch {sc.prefetch_factor}, "
        f"{sc.steps} steps after {sc.warmup} warm-up, "
        f"{f'then .to({cfg.device})' if cfg.device else 'no device copy'}, {what}"
    )


def run_all(cfg: Config, specs: list[LoaderSpec], result: dict[str, Any]) -> None:
    """Every run of every scenario, into ``result["runs"]``, under one progress bar."""
    scenarios = plan_scenarios(cfg)
    device = torch.device(cfg.device) if cfg.device else None
    bar = tqdm(total=len(scenarios) * cfg.repeats * len(specs), unit="run", file=sys.stderr)
    work: ComputeWork | None = None
    try:
        for name, sc in scenarios.items():
            bar.set_description(f"{name}: preparing data")
            length = (sc.warmup + sc.steps) * sc.batch_size
            dataset = make_dataset(sc.workload, length, sc.shape, cfg.data_dir)
            sc.description = describe(sc, dataset, cfg)
            if device is not None and sc.mode != "compute":
                bar.set_description(f"{name}: pinned H2D ceiling")
                nbytes = batch_nbytes(default_collate([dataset[i] for i in range(sc.batch_size)]))
                result["h2d_ceiling_gbps"][name] = h2d_ceiling(nbytes, device)
            if sc.mode == "compute" and work is None and device is not None:
                bar.set_description("calibrating GPU work")
                work = ComputeWork(device, cfg.compute_ms)
                result["calibration"] = work.calibration
            for repeat in range(cfg.repeats):
                for spec in specs:
                    bar.set_description(f"{name} {spec.name} #{repeat + 1}")
                    head = {"scenario": name, "loader": spec.name, "repeat": repeat}
                    try:
                        rec = run_once(
                            spec, dataset, sc, device, work if sc.mode == "compute" else None
                        )
                    except Exception as exc:
                        rec = {"error": f"{type(exc).__name__}: {exc}"}
                        bar.write(f"{name} {spec.name} #{repeat + 1} failed: {rec['error']}")
                    if rec.get("leaked_workers"):
                        bar.write(f"warning: {rec['leaked_workers']} worker(s) outlived the run")
                    result["runs"].append({**head, **rec})
                    bar.update()
            del dataset
            gc.collect()
    except KeyboardInterrupt:
        result["interrupted"] = True
        result["notes"].append("interrupted: partial results")
    finally:
        bar.close()
        result["scenarios"] = {k: dataclasses.asdict(v) for k, v in scenarios.items()}


def loader_notes(result: dict[str, Any]) -> list[str]:
    """Batches that missed a pinned slot, or zero-copy batches that fell back to a copy."""
    notes = []
    for name in result["loaders"]:
        stats = [
            r["loader_stats"]
            for r in result["runs"]
            if r["loader"] == name and r.get("loader_stats")
        ]
        overflow = sum(s.get("overflow_batches", 0) for s in stats)
        fell = sum(s.get("zero_copy_fallbacks", 0) for s in stats)
        zero = sum(s.get("zero_copy_batches", 0) for s in stats)
        if overflow:
            notes.append(f"{name}: {overflow} batches went to unpinned memory (overflow)")
        if zero or (fell and spec_named(name).kwargs.get("zero_copy")):
            notes.append(f"{name}: {fell} of {fell + zero} batches went through copy mode")
    return notes


def main(argv: list[str] | None = None) -> int:
    """``python -m pinpool.bench``: returns 0, or 1 if a run failed or it was interrupted."""
    argv = sys.argv[1:] if argv is None else argv
    warnings.filterwarnings("ignore", message=".*pin_memory.*no accelerator")
    tqdm.monitor_interval = 0  # no monitor thread: workers are forked from this process
    cfg = resolve(argv, torch.cuda.is_available())
    specs: list[LoaderSpec] = []
    skipped: dict[str, str] = {}
    for name in cfg.loaders:
        why = check(spec_named(name), cfg.device)
        if why is None:
            specs.append(spec_named(name))
        else:
            skipped[name] = why
    names = [s.name for s in specs]
    notes = []
    if cfg.device is None:
        notes.append("torch ignores pin_memory=True without an accelerator: torch-pinned = torch")
        if "compute" in cfg.modes:
            notes.append("compute loop (GPU idle share) skipped: no CUDA device")
    if "memmap" in cfg.workloads:
        notes.append(f"memmap reads a file under {cfg.data_dir} (page cache once written)")
    result: dict[str, Any] = {
        "meta": machine(cfg, argv),
        "config": dataclasses.asdict(cfg),
        "baseline": BASELINE if BASELINE in names or not names else names[0],
        "loaders": names,
        "skipped": skipped,
        "notes": notes,
        "calibration": None,
        "h2d_ceiling_gbps": {},
        "interrupted": False,
        "scenarios": {},
        "runs": [],
        "summary": {},
    }
    run_all(cfg, specs, result)
    notes += loader_notes(result)
    result["summary"] = summarize(result["runs"], result["baseline"])
    paths = write_all(result, cfg.out)
    print(table(result))
    print(f"\nwrote {len(paths)} files to {cfg.out}: " + ", ".join(map(os.path.basename, paths)))
    failed = any(r.get("error") for r in result["runs"])
    return 1 if failed or result["interrupted"] else 0
