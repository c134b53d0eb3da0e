"""Runs the whole benchmark: the scenarios (``scenarios``), the loaders taking turns in each,
the ceilings they are held against (``ceilings``), the report written (``output_files``).

Scenarios: each workload in ``throughput`` mode, then in ``compute`` mode (CUDA only; not
the ``tokens`` and ``varlen`` workloads, whose batches take microseconds next to the compute
step), then the
``stall`` scenario (synthetic images, big batches, the loader's whole life: construction,
first batch, two epochs, ``del`` and ``gc.collect()``, each phase's worst main-thread stall on
its own). Within a scenario the loaders take turns: ``for repeat: for loader:``, each run with
a freshly made loader, so slow drifts of the machine touch every loader alike; the workers'
ceiling (``ceilings.WORKERS``) takes its turn after them, and before them the pinned H2D
ceiling is measured once (CUDA only). One progress bar covers every run.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import hashlib
import multiprocessing
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
import warnings
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate
from tqdm import tqdm

import pinpool

from .ceilings import WORKERS, binding, has_rate, rotation, workers_ceilings
from .cli import CHURN_ITEMS, Config, cpu_count, resolve
from .gpu_work import ComputeWork, h2d_ceiling
from .loaders import BASELINE, LoaderSpec, check, same_here, spec_named
from .measure import run_once
from .output_files import write_all
from .ranks import DataParallelStep, Ranks, launch, missing_gpus, totals
from .report import summarize, table
from .scenarios import describe, plan_scenarios
from .workloads import VarlenRows, batch_nbytes, collate_of, make_dataset


def source() -> dict[str, Any]:
    """Which pinpool ran: its version, its directory, the compiled extension file (with a
    hash, so a wheel can be told apart) and, when the package is the tracked source of a git
    checkout, the commit (None otherwise: an installed wheel, no git)."""
    pkg = os.path.dirname(os.path.abspath(pinpool.__file__))

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=pkg, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip()

    commit = dirty = None
    # Only a package git tracks: a wheel installed into a venv inside some checkout is not it.
    if git("ls-files", "--error-unmatch", "__init__.py") is not None:
        commit = git("rev-parse", "HEAD") or None
        status = git("status", "--porcelain", "--untracked-files=no")
        dirty = None if commit is None or status is None else bool(status)
    native = getattr(pinpool._native, "__file__", None)
    digest = None
    if native:
        try:
            with open(native, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            pass
    return {
        "pinpool_version": pinpool.__version__,
        "pinpool_dir": pkg,
        "pinpool_native": native,
        "pinpool_native_sha256": digest,
        "git_commit": commit,
        "git_dirty": dirty,
    }


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
        **source(),
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


def run_all(
    cfg: Config, specs: list[LoaderSpec], result: dict[str, Any], ranks: Ranks | None = None
) -> None:
    """Every run of every scenario, into ``result["runs"]``, under one progress bar (rank 0's,
    in a data-parallel run: see ``ranks``)."""
    scenarios = plan_scenarios(cfg)
    device = torch.device(cfg.device) if cfg.device else None
    world, rank = (ranks.world, ranks.rank) if ranks is not None else (1, 0)
    bar = tqdm(
        total=sum(cfg.repeats * len(rotation(specs, sc.mode)) for sc in scenarios.values()),
        unit="run",
        file=sys.stderr,
        disable=rank != 0,
    )
    work: ComputeWork | None = None
    try:
        for name, sc in scenarios.items():
            bar.set_description(f"{name}: preparing data")
            length = (sc.warmup + sc.steps) * sc.batch_size
            if sc.mode == "churn":
                length = CHURN_ITEMS
            dataset = make_dataset(
                sc.workload, length * world, sc.shape, cfg.data_dir, cfg.varlen_lengths
            )
            sampler: Any = None
            if ranks is not None:  # this rank's shard: warmup + steps batches, as one rank's
                sampler = torch.utils.data.distributed.DistributedSampler(
                    dataset, num_replicas=world, rank=rank, shuffle=False, drop_last=True
                )
            sc.description = describe(sc, dataset, cfg)
            if device is not None and has_rate(sc.mode):
                bar.set_description(f"{name}: pinned H2D ceiling")
                if isinstance(dataset, VarlenRows):  # batches of every size: the mean one
                    nbytes = int(dataset.batch_bytes(sc.batch_size).mean())
                else:
                    collate = collate_of(dataset) or default_collate
                    nbytes = batch_nbytes(collate([dataset[i] for i in range(sc.batch_size)]))
                result["h2d_ceiling_gbps"][name] = h2d_ceiling(nbytes, device)
            if sc.mode == "compute" and work is None and device is not None:
                bar.set_description("calibrating GPU work")
                step = DataParallelStep(device) if ranks is not None else None
                work = ComputeWork(device, cfg.compute_ms, data_parallel=step)
                result["calibration"] = work.calibration
            for repeat in range(cfg.repeats):
                for spec in rotation(specs, sc.mode):
                    bar.set_description(f"{name} {spec.name} #{repeat + 1}")
                    head = {"scenario": name, "loader": spec.name, "repeat": repeat}
                    if ranks is not None:
                        head["rank"] = rank
                        ranks.barrier()  # every rank's run of this loader starts together
                    try:
                        rec = run_once(
                            spec,
                            dataset,
                            sc,
                            device,
                            # (The workers' ceiling: no GPU work, its batches dropped.)
                            work if sc.mode == "compute" and spec is not WORKERS else None,
                            sampler=sampler,
                        )
                    except Exception as exc:
                        rec = {"error": f"{type(exc).__name__}: {exc}"}
                        bar.write(f"{name} {spec.name} #{repeat + 1} failed: {rec['error']}")
                    if "error" in rec:
                        gc.collect()  # the exception held the loader in a cycle: free it now
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
        split = sum(s.get("split_batches", 0) for s in stats)
        if overflow:
            notes.append(f"{name}: {overflow} batches went to unpinned memory (overflow)")
        if split:
            notes.append(f"{name}: {split} batches went into the arena in pieces (split)")
        if zero or (fell and spec_named(name).kwargs.get("zero_copy")):
            notes.append(f"{name}: {fell} of {fell + zero} batches went through copy mode")
    return notes


def main(argv: list[str] | None = None) -> int:
    """``python -m pinpool.bench``: returns 0, 1 if a run failed or it was interrupted, 2 if
    ``--ranks`` asks for more GPUs than the machine has (said in one line)."""
    argv = sys.argv[1:] if argv is None else argv
    warnings.filterwarnings("ignore", message=".*pin_memory.*no accelerator")
    tqdm.monitor_interval = 0  # no monitor thread: workers are forked from this process
    cfg = resolve(argv, torch.cuda.is_available())
    ranks = Ranks.from_env()
    if ranks is None and cfg.ranks > 1:
        why = missing_gpus(cfg.ranks, torch.cuda.device_count()) if cfg.device else None
        if why is not None:  # one line, not each rank's "invalid device ordinal"
            print(f"pinpool.bench: {why}", file=sys.stderr)
            return 2
        return launch(argv, cfg.ranks)  # this run, as cfg.ranks ranks under torchrun
    try:
        return _run(cfg, argv, ranks)
    finally:
        if ranks is not None:
            ranks.end()


def _nothing() -> None:
    """A worker that does nothing (readies the forkserver)."""


def start_workers_by(method: str | None) -> float | None:
    """Makes ``method`` how workers start in this process. For ``forkserver``, starts the
    server, with this module (torch, pinpool, the datasets) imported once in it, and waits
    until it has forked a first worker, as a training script would before its first loader;
    returns how long that took, in seconds (else None)."""
    if method is None:
        return None
    multiprocessing.set_start_method(method, force=True)
    if method != "forkserver":
        return None
    # What every worker needs, imported once by the server rather than by each worker.
    multiprocessing.set_forkserver_preload([__name__])
    t = time.perf_counter()
    first = multiprocessing.Process(target=_nothing)
    first.start()
    first.join()
    return time.perf_counter() - t


def _run(cfg: Config, argv: list[str], ranks: Ranks | None) -> int:
    ready_s = start_workers_by(cfg.start_method)
    if cfg.switch_interval is not None:
        sys.setswitchinterval(cfg.switch_interval)
    if ranks is not None:
        cfg.device = ranks.start(cfg.device is not None)
        cfg.ranks = ranks.world
    specs: list[LoaderSpec] = []
    skipped: dict[str, str] = {}
    for name in cfg.loaders:
        why = check(spec_named(name), cfg.device)
        if why is None:
            specs.append(spec_named(name))
        else:
            skipped[name] = why
    names = [s.name for s in specs]
    baseline = BASELINE if BASELINE in names or not names else names[0]
    # Loaders that are the baseline itself on this machine: no ratio between them.
    twins = [
        n
        for n in names
        if n != baseline and same_here(spec_named(n), spec_named(baseline), cfg.device)
    ]
    notes = []
    if cfg.device is None:
        notes.append("torch ignores pin_memory=True without an accelerator: torch-pinned = torch")
        if "compute" in cfg.modes:
            notes.append("compute loop (GPU idle share) skipped: no CUDA device")
    if twins:
        notes.append(
            f"{', '.join(twins)} = {baseline} on this machine (the same code runs): "
            "no ratio shown for it (x-)"
        )
    if "tokens" in cfg.workloads and "compute" in cfg.modes and cfg.device is not None:
        notes.append("tokens runs in throughput mode only: a compute step would hide its batches")
    if "varlen" in cfg.workloads:
        if "throughput" not in cfg.modes:
            notes.append("varlen runs in throughput mode only: not run (--modes)")
        elif cfg.device is None:
            notes.append(
                "varlen: no CUDA, so torch holds no pinned memory (pinned held: n/a); "
                "pinpool's arena is ordinary host memory here, its size is shown"
            )
    if "memmap" in cfg.workloads:
        notes.append(f"memmap reads a file under {cfg.data_dir} (page cache once written)")
    result: dict[str, Any] = {
        "meta": machine(cfg, argv),
        "config": dataclasses.asdict(cfg),
        "baseline": baseline,
        "loaders": names,
        "same_as_baseline": twins,
        "skipped": skipped,
        "notes": notes,
        "calibration": None,
        "h2d_ceiling_gbps": {},
        "workers_ceiling_gbps": {},  # filled from the summary: see ceilings
        "binding_ceiling": {},
        "interrupted": False,
        "scenarios": {},
        "runs": [],
        "summary": {},
    }
    result["meta"]["switch_interval_s"] = sys.getswitchinterval()
    if cfg.switch_interval is not None:
        notes.append(f"GIL switch interval set to {cfg.switch_interval * 1e3:g} ms")
    if ready_s is not None:
        result["meta"]["forkserver_ready_s"] = ready_s
        notes.append(
            f"workers started by a forkserver (ready {ready_s:.2f} s before the first run): "
            "the training process sends each worker's arguments, the server forks it"
        )
    if ranks is not None:
        result["meta"]["ranks"] = ranks.world
        notes.append(
            f"{ranks.world} ranks (torchrun), rank r on cuda:r, each loading its shard through a "
            "DistributedSampler; the compute step adds a DistributedDataParallel layer whose "
            "gradients are all-reduced"
            if cfg.device
            else f"{ranks.world} ranks (torchrun, gloo), each loading its shard"
        )
    run_all(cfg, specs, result, ranks)
    if ranks is not None:
        every = ranks.gather(result["runs"])
        h2d = ranks.gather(result["h2d_ceiling_gbps"])
        if ranks.rank != 0:
            return 1 if any(r.get("error") for r in result["runs"]) else 0
        result["runs"] = [r for runs in every for r in runs]
        result["h2d_ceiling_gbps_per_rank"] = h2d
        result["ranks_summary"] = totals(result["runs"], ranks.world)
    notes += loader_notes(result)
    result["summary"] = summarize(result["runs"], baseline, no_ratio=[*twins, WORKERS.name])
    result["workers_ceiling_gbps"] = workers_ceilings(result["summary"])
    result["binding_ceiling"] = binding(
        result["summary"], names, result["workers_ceiling_gbps"], result["h2d_ceiling_gbps"]
    )
    paths = write_all(result, cfg.out)
    print(table(result))
    print(f"\nwrote {len(paths)} files to {cfg.out}: " + ", ".join(map(os.path.basename, paths)))
    failed = any(r.get("error") for r in result["runs"])
    return 1 if failed or result["interrupted"] else 0
