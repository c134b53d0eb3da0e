"""Where the GPU's idle time goes in the compute scenario, step by step.

Runs the bench's compute loop (``pinpool.bench``'s loaders, ``ComputeWork`` of 30 ms, the
synthetic 38.5 MB batches, 8 workers) for each loader and prints, as means in ms per step:

- ``gpu_gap``: the GPU's time from the end of one step's work to the start of the next's
  (CUDA events), which is what ``idle%`` adds up (a pinned CPU batch's copy to the GPU is
  inside it);
- ``next`` and ``next_cpu``: the wall and the thread's CPU time inside ``next()`` (equal when
  the thread never waits there, for the GIL or a batch);
- ``transfer``: the batch's ``.to(device, non_blocking=True)`` (CPU batches only);
- ``launch``: queuing the step's work; ``loop``: from ``loss.item()`` returning to the next
  ``next()``; ``busy``: the step's work on the GPU.

    python benchmarks/step_gap.py --loaders torch-pinned pinpool pinpool-device --probe

``--probe`` runs a thread that sleeps 1 ms at a time, as the bench's compute runs do.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

import pinpool
from pinpool.bench.gpu_work import ComputeWork
from pinpool.bench.loaders import build, spec_named, transfer
from pinpool.bench.workloads import make_dataset

COLUMNS = ["gpu_gap", "next", "next_cpu", "transfer", "launch", "loop", "busy"]


def _sleeper(stop: threading.Event) -> None:
    while not stop.is_set():
        time.sleep(0.001)


def run(name: str, args: argparse.Namespace, work: ComputeWork, dev: torch.device) -> Any:
    """One loader's steps: an array with a row of :data:`COLUMNS` per timed step."""
    spec = spec_named(name)
    ds = make_dataset("synthetic", (args.warmup + args.steps) * args.batch, (3, 224, 224), "")
    loader = build(
        spec, ds, batch_size=args.batch, workers=args.workers, prefetch_factor=2, device=str(dev)
    )
    it = iter(loader)
    rows = []
    prev_end: Any = None
    prev_t = 0.0
    for i in range(args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        batch = next(it)
        t1, c1 = time.perf_counter(), time.thread_time()
        on_device = transfer(spec, batch, dev)
        del batch
        t2 = time.perf_counter()
        start, end, loss = work.step(on_device)
        t3 = time.perf_counter()
        loss.item()
        t4 = time.perf_counter()
        del on_device
        if i >= args.warmup:
            ms = [t1 - t0, c1 - c0, t2 - t1, t3 - t2, t0 - prev_t]
            gap = prev_end.elapsed_time(start)
            rows.append([gap, *(x * 1e3 for x in ms), start.elapsed_time(end)])
        prev_end, prev_t = end, t4
    del it, loader
    return np.array(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loaders", nargs="+", default=["torch-pinned", "pinpool", "pinpool-device"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--probe", action="store_true", help="a 1 ms sleeper thread, as in the bench")
    ap.add_argument("--switch", type=float, default=None, help="sys.setswitchinterval(SECONDS)")
    args = ap.parse_args()
    if args.switch:
        sys.setswitchinterval(args.switch)
    dev = torch.device("cuda")
    work = ComputeWork(dev, 30.0)
    stop = threading.Event()
    if args.probe:
        threading.Thread(target=_sleeper, args=(stop,), daemon=True).start()
    print(f"probe={args.probe} switch={sys.getswitchinterval()} pinpool={pinpool.__file__}")
    print(f"{'loader':18s} idle% " + " ".join(f"{c:>9s}" for c in COLUMNS) + "   (means, ms)")
    for name in args.loaders:
        a = run(name, args, work, dev)
        idle = a[:, 0].sum() / (a[:, 0].sum() + a[:, 6].sum()) * 100
        cells = " ".join(f"{a[:, j].mean():9.3f}" for j in range(len(COLUMNS)))
        print(f"{name:18s} {idle:5.2f} " + cells, flush=True)
        medians = " ".join(f"{c}={np.median(a[:, j]):.3f}" for j, c in enumerate(COLUMNS))
        p90 = f"p90 next={np.percentile(a[:, 1], 90):.3f} gap={np.percentile(a[:, 0], 90):.3f}"
        print(f"   medians: {medians}  {p90}", flush=True)
        pinpool.wait_for_freed_pools(timeout=60)
    stop.set()


if __name__ == "__main__":
    main()
