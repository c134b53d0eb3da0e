"""Where a batch's time goes, zero-copy against copy mode: every trace event of the main
process and of the (forked) workers, per mode, with the epochs' wall time and the loader's
fallbacks. Workers write their events to files of their own (the hook is inherited by fork).

    python3 zcprobe.py --workload synthetic --shape 3,3344,3344 --batch 8 --workers 2
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import pinpool
import pinpool.trace
from pinpool.bench.workloads import make_dataset


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="synthetic")
    ap.add_argument("--shape", default="3,3344,3344")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batches", type=int, default=23)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--device", default="", help="device batches on it (default: pinned CPU)")
    ap.add_argument("--modes", nargs="+", default=["copy", "zero-copy"])
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split(","))
    print("nodes:", len(glob.glob("/sys/devices/system/node/node[0-9]*")),
          "shmem THP:", Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip()
          if os.path.exists("/sys/kernel/mm/transparent_hugepage/shmem_enabled") else "?")
    for mode in a.modes:
        folder = tempfile.mkdtemp(prefix="zcprobe-")
        main_events: list[pinpool.trace.Event] = []
        me = os.getpid()

        def hook(e: pinpool.trace.Event) -> None:
            if os.getpid() == me:
                main_events.append(e)
            else:
                with open(f"{folder}/{os.getpid()}", "a") as f:
                    mapped = " mapped" if e.details.get("mapped") else ""
                    f.write(f"{e.name}{mapped} {(e.end_ns - e.start_ns) / 1e6:.3f}\n")

        pinpool.trace.set_hook(hook)
        ds = make_dataset(a.workload, a.batch * a.batches, shape, "/tmp")
        loader = pinpool.DataLoader(ds, batch_size=a.batch, num_workers=a.workers,
                                    zero_copy=mode == "zero-copy", device=a.device or None)
        walls, nbytes = [], 0
        for _ in range(a.epochs):
            t = time.perf_counter()
            for b in loader:
                if isinstance(b, torch.Tensor):
                    nbytes += b.numel() * b.element_size()
                elif isinstance(b, dict):
                    nbytes += sum(v.numel() * v.element_size() for v in b.values() if isinstance(v, torch.Tensor))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            walls.append(time.perf_counter() - t)
        stats = loader.stats()
        del loader
        pinpool.trace.set_hook(None)
        print(f"== {mode}: epochs {' '.join(f'{w*1e3:.0f}' for w in walls)} ms; "
              f"{nbytes / sum(walls) / 1e9:.2f} GB/s; zero-copy batches {stats.get('zero_copy_batches')}, "
              f"fallbacks {stats.get('zero_copy_fallbacks')} (no slot {stats.get('zero_copy_no_ticket')})")
        agg: dict[str, list[float]] = collections.defaultdict(list)
        for e in main_events:
            agg["main " + e.name + (" " + str(e.details.get("what") or e.details.get("how") or e.details.get("got") or "") if e.name in ("batch.wait", "batch.copy", "slot.claim", "slot.reserve") else "")].append((e.end_ns - e.start_ns) / 1e6)
        for f in glob.glob(folder + "/*"):
            for line in open(f):
                name, ms = line.rsplit(" ", 1)
                agg["worker " + name].append(float(ms))
        for k, v in sorted(agg.items()):
            v.sort()
            print(f"  {k:34s} n={len(v):4d} median {statistics.median(v):8.3f} p90 {v[int(0.9 * (len(v) - 1))]:8.3f} sum {sum(v):9.1f} ms")


if __name__ == "__main__":
    main()
