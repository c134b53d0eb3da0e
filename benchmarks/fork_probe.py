"""What a worker's start costs the process that starts it, stage by stage.

``os.fork()`` holds the GIL while the kernel copies the parent's page tables, so its time is
a stall of every Python thread. This prints, as the process grows (torch imported, CUDA up,
cuBLAS loaded, a pinpool arena, torch pinned memory, plain anonymous memory), how long a fork
takes and how much anonymous memory the process has; then what starting a worker through a
warm forkserver costs the parent instead (``Process.start()``, and the worst lateness of a
1 ms sleeper thread meanwhile).

With ``--arenas``, before those stages: the fork time with a pinpool arena of each size in
GiB, pinned through the driver and made whole, one at a time, after the CUDA context (does
pinpool's arena add to the fork stall? ``0``: none).

    python3 benchmarks/fork_probe.py [--arenas 0 1 4 8] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import threading
import time


def fork_ms(n: int = 7) -> dict[str, float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        times.append((time.perf_counter() - t) * 1e3)
        os.waitpid(pid, 0)
    return {"fork_ms_median": statistics.median(times), "fork_ms_min": min(times)}


def memory() -> dict[str, float]:
    out: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key + "_mib"] = int(value.split()[0]) / 1024
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "AnonHugePages":
                out["AnonHugePages_mib"] = int(value.split()[0]) / 1024
    with open("/proc/self/maps") as f:
        out["mappings"] = sum(1 for _ in f)
    return out


def _nothing() -> None:
    pass


class Sleeper:
    """A thread sleeping 1 ms at a time; ``worst()`` is its worst lateness since ``reset()``."""

    def __init__(self) -> None:
        self.late = 0.0
        self.stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop:
            t = time.perf_counter()
            time.sleep(0.001)
            self.late = max(self.late, time.perf_counter() - t - 0.001)

    def reset(self) -> None:
        self.late = 0.0

    def worst_ms(self) -> float:
        return self.late * 1e3


def starts(ctx: multiprocessing.context.BaseContext, sleeper: Sleeper, n: int = 4) -> dict:
    """``Process.start()`` of ``n`` workers in a row, as a DataLoader starts them."""
    sleeper.reset()
    t = time.perf_counter()
    procs = [ctx.Process(target=_nothing) for _ in range(n)]
    for p in procs:
        p.start()
    started = (time.perf_counter() - t) * 1e3
    time.sleep(0.01)
    worst = sleeper.worst_ms()
    for p in procs:
        p.join()
    return {"start_ms": started, "sleeper_worst_ms": worst}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--arenas", type=float, nargs="*", default=[], help="GiB, see above")
    args = ap.parse_args()
    import numpy as np
    import torch

    import pinpool

    keep: list = []
    rows = []

    def stage(name: str) -> None:
        row = {"stage": name, **memory(), **fork_ms()}
        rows.append(row)
        print(
            f"{name:28s} fork {row['fork_ms_median']:6.2f} ms (min {row['fork_ms_min']:.2f})  "
            f"anon {row['RssAnon_mib']:7.0f} MiB (huge {row.get('AnonHugePages_mib', 0):.0f})  "
            f"rss {row['VmRSS_mib']:7.0f} MiB  {row['mappings']} mappings",
            flush=True,
        )

    stage("torch imported")
    cuda = torch.cuda.is_available()
    if cuda:
        keep.append(torch.ones(1, device="cuda"))
        stage("CUDA context")
        a = torch.randn(1024, 1024, device="cuda")
        keep.append(a @ a)
        torch.cuda.synchronize()
        stage("cuBLAS used")
        for gib in args.arenas:
            slots = int(gib * 16)  # of 64 MiB
            if not slots:
                stage("no pinpool arena")
                continue
            pool = pinpool.PinPool(64 << 20, slots, device=0, background=False)
            stage(f"pinpool arena {gib:g} GiB, {pool.backend}")
            pool.close()
            del pool
            pinpool.wait_for_freed_pools(timeout=120)
            stage(f"  after it was freed ({gib:g} GiB)")
    keep.append(pinpool.PinPool(64 << 20, 16))
    stage("pinpool arena 1 GiB")
    if cuda:
        keep.append(torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True))
        stage("torch pinned 1 GiB")
    keep.append(np.ones(1 << 30, np.uint8))
    stage("anonymous 1 GiB touched")

    sleeper = Sleeper()
    fork_ctx = multiprocessing.get_context("fork")
    server = multiprocessing.get_context("forkserver")
    t = time.perf_counter()
    p = server.Process(target=_nothing)
    p.start()
    p.join()
    ready = time.perf_counter() - t
    result = {"stages": rows, "forkserver_ready_s": ready, "starts": {}}
    for name, ctx in (("fork", fork_ctx), ("forkserver", server)):
        runs = [starts(ctx, sleeper) for _ in range(3)]
        result["starts"][name] = runs
        print(
            f"4 workers started by {name:10s}: Process.start() x4 "
            + ", ".join(f"{r['start_ms']:.1f}" for r in runs)
            + " ms; sleeper's worst lateness "
            + ", ".join(f"{r['sleeper_worst_ms']:.1f}" for r in runs)
            + " ms",
            flush=True,
        )
    print(f"forkserver ready (first worker started and joined) in {ready:.2f} s")
    sleeper.stop = True
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
