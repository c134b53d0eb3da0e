"""How long an epoch's final ``next()`` takes (the one that raises ``StopIteration`` and shuts
the workers down), epoch after epoch, for torch's loader and pinpool's variants, with the
time inside the workers' shutdown from pinpool's trace hook (``workers.shutdown``), and how
long the epoch's start (``iter()`` and the first ``next()``: the workers forked or started)
took.

    python3 benchmarks/end_of_epoch.py [--epochs 4] [--rounds 2] [--workers 8]
        [--batch-size 256] [--variants NAME ...]

38.5 MB batches (256 x 3x224x224 uint8) made cheaply in the workers, 12 batches an epoch.
``--variants`` picks loaders by name (default: all; ``pinpool device`` needs CUDA).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import pinpool
import pinpool.trace


class Images(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 224, 224), i % 251, dtype=torch.uint8)


def run(make: Callable[[], Any], epochs: int) -> tuple[list[float], list[float], list[float]]:
    """Per epoch (ms): the wall time of ``iter()`` and the first ``next()`` (the workers'
    start), of the final ``next()``, and of the workers.shutdown spans in it."""
    loader = make()
    starts, ends, shutdowns = [], [], []
    for _ in range(epochs):
        t = time.perf_counter()
        it = iter(loader)
        next(it)
        starts.append((time.perf_counter() - t) * 1e3)
        for _ in range(len(loader) - 1):
            next(it)
        spans: list[pinpool.trace.Event] = []
        old = pinpool.trace.set_hook(spans.append)
        t = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            pass
        ends.append((time.perf_counter() - t) * 1e3)
        pinpool.trace.set_hook(old)
        shutdowns.append(
            sum((e.end_ns - e.start_ns) / 1e6 for e in spans if e.name == "workers.shutdown")
        )
        del it
    return starts, ends, shutdowns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--variants", nargs="+", help="loader names (default: all)")
    args = ap.parse_args()
    data = Images(args.batch_size * 12)
    kw: dict[str, Any] = dict(batch_size=args.batch_size, num_workers=args.workers)
    variants: dict[str, Callable[[], Any]] = {
        "torch pinned": lambda: torch.utils.data.DataLoader(data, pin_memory=True, **kw),
        "pinpool": lambda: pinpool.DataLoader(data, **kw),
        "pinpool keep_worker_memory=False": lambda: pinpool.DataLoader(
            data, keep_worker_memory=False, **kw
        ),
        "pinpool device": lambda: pinpool.DataLoader(data, device="cuda", **kw),
        "pinpool zero-copy": lambda: pinpool.DataLoader(data, zero_copy=True, **kw),
        "pinpool stream_samples=False": lambda: pinpool.DataLoader(
            data, stream_samples=False, **kw
        ),
        "pinpool worker_copy_threads=1": lambda: pinpool.DataLoader(
            data, worker_copy_threads=1, **kw
        ),
        "pinpool persistent": lambda: pinpool.DataLoader(data, persistent_workers=True, **kw),
        "pinpool forkserver": lambda: pinpool.DataLoader(
            data, multiprocessing_context="forkserver", **kw
        ),
    }
    unknown = set(args.variants or ()) - set(variants)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}: choose from {sorted(variants)}")
    if args.variants:
        variants = {name: variants[name] for name in args.variants}
    elif not torch.cuda.is_available():
        del variants["pinpool device"]
    for r in range(args.rounds):
        for name, make in variants.items():
            starts, ends, shut = run(make, args.epochs)
            print(
                f"r{r} {name:34s} final next() ms: "
                + " ".join(f"{e:6.1f}" for e in ends)
                + f"  (median {statistics.median(ends):.1f}; workers.shutdown "
                + " ".join(f"{s:.1f}" for s in shut)
                + ")  first next() ms: "
                + " ".join(f"{e:.1f}" for e in starts),
                flush=True,
            )
            pinpool.wait_for_freed_pools(timeout=60)


if __name__ == "__main__":
    main()
