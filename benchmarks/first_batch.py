"""Where the time to the first batch goes: each loader's construction, ``iter()``, first
batch and first batch on the device, beside torch's, and for pinpool loaders when the first
batch's size became known (``ensure``), and when the pool's making started (on which
thread) and ended, all in ms from construction, then the arena's size and start-up steps.
38.5 MB batches, 8 workers.

    python benchmarks/first_batch.py --rounds 3 [--start-method forkserver]
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time
from typing import Any

import torch

import pinpool
import pinpool._main.receiver as receiver_module
from pinpool.bench.loaders import build, spec_named, transfer
from pinpool.bench.workloads import make_dataset

EVENTS: list[tuple[str, float]] = []


def _instrument() -> None:
    """Records when a pool's making starts and ends, and the first ``ensure``."""
    real_pool, real_ensure = receiver_module.PinPool, receiver_module.Receiver.ensure

    def timed_pool(*args: Any, **kwargs: Any) -> Any:
        EVENTS.append((f"pool-start[{threading.current_thread().name}]", time.perf_counter()))
        pool = real_pool(*args, **kwargs)
        EVENTS.append(("pool-made", time.perf_counter()))
        return pool

    def timed_ensure(self: Any, nbytes: int, count: int | None = None) -> Any:
        if self.pool is None:
            EVENTS.append((f"ensure({nbytes})", time.perf_counter()))
        return real_ensure(self, nbytes, count)

    receiver_module.PinPool = timed_pool  # type: ignore[misc]
    receiver_module.Receiver.ensure = timed_ensure  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loaders", nargs="+", default=["torch-pinned", "pinpool", "pinpool-device"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--start-method", default=None)
    args = ap.parse_args()
    if args.start_method:
        multiprocessing.set_start_method(args.start_method, force=True)
    _instrument()
    dev = torch.device("cuda")
    torch.ones(1, device=dev)
    ds = make_dataset("synthetic", 40 * 256, (3, 224, 224), "")
    for r in range(args.rounds):
        for name in args.loaders:
            spec = spec_named(name)
            EVENTS.clear()
            t0 = time.perf_counter()
            loader = build(spec, ds, batch_size=256, workers=8, prefetch_factor=2, device="cuda")
            t1 = time.perf_counter()
            it = iter(loader)
            t2 = time.perf_counter()
            batch = next(it)
            t3 = time.perf_counter()
            batch = transfer(spec, batch, dev)
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            for _ in range(5):
                next(it)
            t5 = time.perf_counter()
            events = " ".join(f"{n}@{(t - t0) * 1e3:.0f}" for n, t in EVENTS)
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
