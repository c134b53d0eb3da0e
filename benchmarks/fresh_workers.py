"""Where a fresh worker's first batches of an epoch go: the bench's stall scenario (8 x
3x3344x3344 uint8 = 268 MB batches, 2 workers, prefetch 2, 30 ms of GPU work a step), two
epochs, copy mode and zero-copy, with every library event logged (``pinpool.trace``) in the
main process and in the workers (forked: the hook goes with them).

    python3 benchmarks/fresh_workers.py [--out DIR] [--small]

Prints, per loader, the second epoch's ``next()`` waits and, per worker of that epoch and per
batch, how long its batch's memory took to get (``worker.destination``; ``mapped``: a window mapped
then, ``seg``: a segment of its own) and to write (``worker.stream`` + ``worker.write``). The
raw events go to ``DIR/<loader>.events`` (one line each: pid, name, start ns, end ns,
details).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

import pinpool
import pinpool.trace
from pinpool.bench.gpu_work import ComputeWork
from pinpool.bench.workloads import SyntheticImages

BATCH, SHAPE, WORKERS, BATCHES = 8, (3, 3344, 3344), 2, 23


def _hook_to(path: Path) -> Any:
    def hook(e: pinpool.trace.Event) -> None:
        details = {
            k: (v if isinstance(v, (int, float, bool, str)) else str(v))
            for k, v in (e.details or {}).items()
        }
        line = json.dumps([os.getpid(), e.name, e.start_ns, e.end_ns, details]) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    return hook


def run(
    name: str, zero_copy: bool, out: Path, work: ComputeWork | None, shape: tuple[int, ...]
) -> None:
    path = out / f"{name}.events"
    path.unlink(missing_ok=True)
    device = torch.device("cuda" if work is not None else "cpu")
    loader = pinpool.DataLoader(
        SyntheticImages(BATCH * BATCHES, shape),
        batch_size=BATCH,
        num_workers=WORKERS,
        prefetch_factor=2,
        device=device if zero_copy and work is not None else None,
        zero_copy=zero_copy,
    )
    waits: list[list[float]] = []
    epochs: list[int] = []
    pinpool.trace.set_hook(_hook_to(path))
    try:
        for _epoch in range(2):
            epochs.append(time.perf_counter_ns())
            it, row = iter(loader), []
            while True:
                t0 = time.perf_counter()
                try:
                    images, _labels = next(it)
                except StopIteration:
                    break
                row.append((time.perf_counter() - t0) * 1e3)
                if not zero_copy:
                    images = images.to(device, non_blocking=True)
                if work is not None:
                    work.step(images)
            waits.append(row)
            if work is not None:
                torch.cuda.synchronize()
        stats = loader.stats()
    finally:
        pinpool.trace.set_hook(None)
        del loader
    events = [json.loads(line) for line in path.read_text().splitlines() if line]
    main = os.getpid()
    start2 = epochs[1]
    fresh = sorted({e[0] for e in events if e[0] != main and e[2] >= start2})
    print(
        f"== {name}: fallbacks {stats.get('zero_copy_fallbacks')}, "
        f"zero-copy batches {stats.get('zero_copy_batches')}"
    )
    print("  epoch 2 next() ms:", " ".join(f"{w:.0f}" for w in waits[1]))
    for pid in fresh:
        mine = [e for e in events if e[0] == pid and e[2] >= start2]
        per: dict[str, list[Any]] = collections.defaultdict(list)
        for e in mine:
            per[e[1]].append(e)
        rows = []
        for place in per["worker.destination"]:
            d = place[4]
            kind = "mapped" if d.get("mapped") else ("slot" if d.get("slot") else "seg")
            after = [
                e for e in mine if e[1] in ("worker.stream", "worker.write") and e[2] >= place[3]
            ]
            write = 0.0
            if after:
                nxt = [p for p in per["worker.destination"] if p[2] > place[2]]
                limit = nxt[0][2] if nxt else float("inf")
                write = sum((e[3] - e[2]) for e in after if e[2] < limit) / 1e6
            rows.append(
                f"{(place[2] - start2) / 1e6:.0f}:{kind}"
                f" place {(place[3] - place[2]) / 1e6:.1f} write {write:.0f}"
            )
        print(f"  worker {pid}: " + " | ".join(rows[:8]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/fresh-workers")
    ap.add_argument("--small", action="store_true", help="64x64 images on the CPU (a smoke run)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = None if args.small else ComputeWork(torch.device("cuda"), 30.0)
    shape = (3, 64, 64) if args.small else SHAPE
    for name, zero_copy in (
        ("copy", False),
        ("zerocopy", True),
        ("copy2", False),
        ("zerocopy2", True),
    ):
        run(name, zero_copy, out, work, shape)


if __name__ == "__main__":
    main()
