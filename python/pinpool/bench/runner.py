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
from tqdm import tqdm

import pinpool

from .cli import STALL_ITEMS, Config, cpu_count, resolve
from .loaders import BASELINE, LoaderSpec, Unsupported, check, spec_named
from .measure import ComputeWork, RunPlan, run_once
from .report import summarize, table, write_all
from .workloads import batch_nbytes, make_dataset


def machine(cfg: Config, argv: list[str]) -> dict[str, Any]:
    """What ran where: versions, CPUs, the GPU, the date, the exact command line."""
    cuda = cfg.device is not None
    name = torch.cuda.get_device_name(cfg.device) if cuda else None
    cpus = cpu_count()
    if cuda:
        path = f"host -> {cfg.device} ({name}): batches are copied to the GPU"
    else:
        path = (
            "HOST-ONLY: torch sees no CUDA device, so batches are not copied to a GPU and the "
            "compute loop is skipped; throughput = batches delivered to the consumer"
        )
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, "-m", "pinpool.bench", *argv]),
        "cwd": os.getcwd(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "numpy": np.__version__,
        "pinpool": pinpool.__version__,
        "cpu_count": os.cpu_count(),
        "cpus_usable": cpus,
        "start_method": multiprocessing.get_start_method(),
        "cuda_available": cuda,
        "host_only": not cuda,
        "device": cfg.device,
        "device_name": name,
        "pinpool_cuda_available": pinpool.cuda_available(),
        "path": path,
        "machine": f"torch {torch.__version__}; {cpus} CPUs; preset {cfg.preset}; "
        f"{cfg.repeats} repeats",
    }


def plan_scenarios(cfg: Config) -> dict[str, dict[str, Any]]:
    """Scenario name -> workload, mode, sizes and a one-line description."""
    where = f"then .to({cfg.device})" if cfg.device else "no device copy"
    out: dict[str, dict[str, Any]] = {}
    modes = [m for m in ("throughput", "compute") if m in cfg.modes]
    for workload in cfg.workloads:
        for mode in modes:
            if mode == "compute" and cfg.device is None:
                continue
            what = f"{cfg.compute_ms:g} ms GPU work + loss.item() per step"
            out[f"{workload}/{mode}"] = {
                "workload": workload,
                "mode": mode,
                "batch_size": cfg.batch_size,
                "shape": cfg.shape,
                "workers": cfg.workers,
                "warmup": cfg.warmup,
                "steps": cfg.steps,
                "what": what if mode == "compute" else "no compute",
            }
    if "stall" in cfg.modes:
        out["stall"] = {
            "workload": "synthetic",
            "mode": "stall",
            "batch_size": STALL_ITEMS,
            "shape": cfg.stall_shape,
            "workers": cfg.stall_workers,
            "warmup": min(3, cfg.warmup),
            "steps": cfg.stall_steps,
            "what": "big batches: main-thread stalls",
        }
    for sc in out.values():
        sc["where"] = where
    return out


def _describe(sc: dict[str, Any], dataset: Any, prefetch: int) -> str:
    nbytes = batch_nbytes(dataset[0]) * sc["batch_size"]
    shape = "x".join(map(str, sc["shape"]))
    return (
        f"{sc['workload']}, batch {sc['batch_size']} x {shape} = {nbytes / 1e6:.1f} MB, "
        f"{sc['workers']} workers x prefetch {prefetch}, {sc['steps']} steps after "
        f"{sc['warmup']} warm-up, {sc['where']}, {sc['what']}"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m pinpool.bench``: returns 0, or 1 if a run failed or it was interrupted."""
    argv = sys.argv[1:] if argv is None else argv
    warnings.filterwarnings("ignore", message=".*pin_memory.*no accelerator")
    tqdm.monitor_interval = 0  # no monitor thread: workers are forked from this process
    cfg = resolve(argv, torch.cuda.is_available())
    device = torch.device(cfg.device) if cfg.device else None
    specs: list[LoaderSpec] = []
    skipped: dict[str, str] = {}
    for name in cfg.loaders:
        why = check(spec_named(name), cfg.device)
        if why is None:
            specs.append(spec_named(name))
        else:
            skipped[name] = why
    names = [s.name for s in specs]
    baseline = BASELINE if BASELINE in names else (names[0] if names else BASELINE)
    notes = []
    if device is None:
        notes.append("torch ignores pin_memory=True without an accelerator: torch-pinned = torch")
        if "compute" in cfg.modes:
            notes.append("compute loop (GPU idle share) skipped: no CUDA device")
    if "memmap" in cfg.workloads:
        notes.append(f"memmap reads a file under {cfg.data_dir} (page cache once written)")
    scenarios = plan_scenarios(cfg)
    result: dict[str, Any] = {
        "meta": machine(cfg, argv),
        "config": dataclasses.asdict(cfg),
        "baseline": baseline,
        "loaders": names,
        "skipped": skipped,
        "notes": notes,
        "calibration": None,
        "scenarios": scenarios,
        "runs": [],
        "summary": {},
    }
    total = len(scenarios) * cfg.repeats * len(specs)
    bar = tqdm(total=total, unit="run", dynamic_ncols=True, file=sys.stderr)
    work: ComputeWork | None = None
    try:
        for name, sc in scenarios.items():
            bar.set_description(f"{name}: preparing data")
            length = (sc["warmup"] + sc["steps"]) * sc["batch_size"]
            dataset = make_dataset(sc["workload"], length, sc["shape"], cfg.data_dir)
            sc["description"] = _describe(sc, dataset, cfg.prefetch_factor)
            if sc["mode"] == "compute" and work is None:
                assert device is not None
                bar.set_description("calibrating GPU work")
                work = ComputeWork(device, cfg.compute_ms)
                result["calibration"] = work.calibration
            plan = RunPlan(
                mode=sc["mode"],
                batch_size=sc["batch_size"],
                workers=sc["workers"],
                prefetch_factor=cfg.prefetch_factor,
                warmup=sc["warmup"],
                steps=sc["steps"],
                device=device,
            )
            for repeat in range(cfg.repeats):
                for spec in specs:
                    bar.set_description(f"{name} {spec.name} #{repeat + 1}")
                    head = {"scenario": name, "loader": spec.name, "repeat": repeat}
                    step_work = work if plan.mode == "compute" else None
                    try:
                        rec = run_once(spec, dataset, plan, step_work)
                    except (Exception, Unsupported) as exc:
                        rec = {"error": f"{type(exc).__name__}: {exc}"}
                        bar.write(f"{name} {spec.name} #{repeat + 1} failed: {rec['error']}")
                    result["runs"].append({**head, **rec})
                    if rec.get("leaked_workers"):
                        bar.write(f"warning: {rec['leaked_workers']} worker(s) outlived the run")
                    bar.update()
            del dataset
            gc.collect()
    except KeyboardInterrupt:
        notes.append("interrupted: partial results")
    finally:
        bar.close()
    result["summary"] = summarize(result["runs"], baseline)
    for sc in scenarios.values():
        sc.setdefault("description", "not run")
    paths = write_all(result, cfg.out)
    print(table(result))
    print(f"\nwrote {len(paths)} files to {cfg.out}: " + ", ".join(map(os.path.basename, paths)))
    failed = any(r.get("error") for r in result["runs"])
    return 1 if failed or "interrupted: partial results" in notes else 0
