"""Where the time to the first batch goes: each loader's construction, ``iter()``, first
batch and first batch on the device, beside torch's, and for pinpool loaders when the first
batch's size became known (``ensure``), and when the pool's making started (on which
thread) and ended, all in ms from construction, then the arena's size and start-up steps.
38.5 MB batches, 8 workers. Those moments come from pinpool's trace hook (``pinpool.trace``:
events ``pool.ensure`` and ``pool.make``).

    python benchmarks/first_batch.py --rounds 3 [--start-method forkserver]
    python benchmarks/first_batch.py --device cpu --loaders pinpool --batch-size 4 --workers 2
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

import torch

import pinpool
import pinpool.trace
from pinpool.bench.loaders import build, spec_named, transfer
from pinpool.bench.workloads import make_dataset

EVENTS: list[tuple[str, float]] = []


def _record(e: pinpool.trace.Event) -> None:
    """Keeps when the pool was first needed (``ensure``), and when its making started (on
    which thread) and ended, in ``time.perf_counter()`` seconds."""
    if e.name == "pool.ensure":
        EVENTS.append((f"ensure({e.details['nbytes']})", e.start_ns / 1e9))
    elif e.name == "pool.make":
        EVENTS.append((f"pool-start[{e.thread}]", e.start_ns / 1e9))
        EVENTS.append(("pool-made", e.end_ns / 1e9))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loaders", nargs="+", default=["torch-pinned", "pinpool", "pinpool-device"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--start-method", default=None)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (no copy to a device)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--shape", type=int, nargs="+", default=[3, 224, 224])
    args = ap.parse_args()
    if args.start_method:
        multiprocessing.set_start_method(args.start_method, force=True)
    pinpool.trace.set_hook(_record)
    dev = torch.device(args.device) if args.device != "cpu" else None
    if dev is not None:
        torch.ones(1, device=dev)
    ds = make_dataset("synthetic", 40 * args.batch_size, tuple(args.shape), "")
    for r in range(args.rounds):
        for name in args.loaders:
            spec = spec_named(name)
            EVENTS.clear()
            t0 = time.perf_counter()
            loader = build(
                spec,
                ds,
                batch_size=args.batch_size,
                workers=args.workers,
                prefetch_factor=2,
                device=args.device if dev is not None else None,
            )
            t1 = time.perf_counter()
            it = iter(loader)
            t2 = time.perf_counter()
            batch = next(it)
            t3 = time.perf_counter()
            batch = transfer(spec, batch, dev)
            if dev is not None:
                torch.cuda.synchronize()
            t4 = time.perf_counter()
            for _ in range(5):
                next(it)
            t5 = time.perf_counter()
            events = " ".join(
                f"{n}@{(t - t0) * 1e3:.0f}" for n, t in sorted(EVENTS, key=lambda x: x[1])
            )
            pool = getattr(loader, "pool", None)
            if pool is not None:  # the arena's start-up steps, in ms
                steps = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in pool.startup.items())
                events += f" | {pool.arena_bytes >> 20} MiB: {steps}"
            print(
                f"{name:16s} r{r} ctor {1e3 * (t1 - t0):5.1f} iter {1e3 * (t2 - t1):5.1f} "
                f"first@{1e3 * (t3 - t0):6.1f} on-dev@{1e3 * (t4 - t0):6.1f} "
                f"+5 {1e3 * (t5 - t4):6.1f} ms | {events}",
                flush=True,
            )
            del batch, it, loader
            pinpool.wait_for_freed_pools(timeout=60)


if __name__ == "__main__":
    main()
