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
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    ap.add_argument("--to-cuda", action="store_true", help="each batch .to('cuda'), as in stall")
    ap.add_argument("--parts", action="store_true", help="also time the worker's calls (wrapped)")
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split(","))
    thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    nodes = len(glob.glob("/sys/devices/system/node/node[0-9]*"))
    print("nodes:", nodes, "shmem THP:", thp.read_text().strip() if thp.exists() else "?")
    for mode in a.modes:
        folder = tempfile.mkdtemp(prefix="zcprobe-")
        main_events: list[pinpool.trace.Event] = []
        hook = _hook(folder, os.getpid(), main_events)
        pinpool.trace.set_hook(hook)
        if a.parts:
            _wrap_parts(folder, os.getpid())
        ds = make_dataset(a.workload, a.batch * a.batches, shape, "/tmp")
        loader = pinpool.DataLoader(
            ds,
            batch_size=a.batch,
            num_workers=a.workers,
            zero_copy=mode == "zero-copy",
            device=a.device or None,
        )
        walls, nbytes = [], 0
        for _ in range(a.epochs):
            t = time.perf_counter()
            for b in loader:
                arrays = _tensors(b)
                if a.to_cuda:
                    moved = [t.to("cuda", non_blocking=True) for t in arrays]
                    del moved
                nbytes += sum(t.numel() * t.element_size() for t in arrays)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            walls.append(time.perf_counter() - t)
        stats = loader.stats()
        del loader
        pinpool.trace.set_hook(None)
        epochs = " ".join(f"{w * 1e3:.0f}" for w in walls)
        print(
            f"== {mode}: epochs {epochs} ms; {nbytes / sum(walls) / 1e9:.2f} GB/s; zero-copy "
            f"batches {stats.get('zero_copy_batches')}, fallbacks "
            f"{stats.get('zero_copy_fallbacks')} (no slot {stats.get('zero_copy_no_ticket')})"
        )
        agg: dict[str, list[float]] = collections.defaultdict(list)
        for e in main_events:
            kind = e.details.get("what") or e.details.get("how") or e.details.get("got") or ""
            split = e.name in ("batch.wait", "batch.copy", "slot.claim", "slot.reserve")
            name = f"main {e.name} {kind}" if split else f"main {e.name}"
            agg[name].append((e.end_ns - e.start_ns) / 1e6)
        for f in glob.glob(folder + "/*"):
            for line in open(f):
                name, ms = line.rsplit(" ", 1)
                agg["worker " + name].append(float(ms))
        for k, v in sorted(agg.items()):
            v.sort()
            p90 = v[int(0.9 * (len(v) - 1))]
            print(
                f"  {k:34s} n={len(v):4d} median {statistics.median(v):8.3f} p90 {p90:8.3f} "
                f"sum {sum(v):9.1f} ms"
            )


def _hook(
    folder: str, me: int, main_events: list[pinpool.trace.Event]
) -> Callable[[pinpool.trace.Event], None]:
    """Keeps the main process's events; a worker's go to a file of its own."""

    def hook(e: pinpool.trace.Event) -> None:
        if os.getpid() == me:
            main_events.append(e)
        else:
            with open(f"{folder}/{os.getpid()}", "a") as f:
                mapped = " mapped" if e.details.get("mapped") else ""
                f.write(f"{e.name}{mapped} {(e.end_ns - e.start_ns) / 1e6:.3f}\n")

    return hook


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return [t for t in batch if isinstance(t, torch.Tensor)]
    return []


_FOLDER: list[str] = []


def _wrap_parts(folder: str, me: int) -> None:
    """Times, in the workers, pinpool's collate per batch and the calls inside it (a probe's
    wrapping: the library itself is unchanged)."""
    import functools

    _FOLDER[:] = [folder]

    from pinpool._worker import collate, places, streaming

    try:
        from pinpool._worker import windows
    except ImportError:  # (before the window thread: the windows were in places)
        windows = None

    def timed(owner: object, name: str, label: str) -> None:
        inner = getattr(owner, name)
        if getattr(inner, "_timed", False):
            return

        @functools.wraps(inner)
        def wrapper(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                if os.getpid() != me:
                    with open(f"{_FOLDER[0]}/{os.getpid()}", "a") as f:
                        f.write(f"part.{label} {(time.perf_counter_ns() - t0) / 1e6:.3f}\n")

        wrapper._timed = True  # type: ignore[attr-defined]
        setattr(owner, name, wrapper)

    timed(collate.PinCollate, "__call__", "collate(all)")
    if windows is None:
        timed(places, "open_window", "open_window")
        timed(places, "_close_window", "close_window")
    else:  # what the worker's thread waits for, and what the window thread does
        timed(windows, "open_for", "open_window")
        timed(windows, "close", "close_window")
        timed(windows, "_open", "thread: open")
        timed(windows, "_close", "thread: close")
    timed(places.Place, "send", "place.send")
    timed(streaming, "collate_streaming", "collate_streaming")
    timed(places._Ring, "acquire", "ring.acquire")


if __name__ == "__main__":
    main()
