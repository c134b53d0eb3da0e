"""What limits a DataLoader worker on this machine: the collate copy, the making of items, or
the memory bandwidth that all workers share (with the GPU's reads of pinned memory).

N processes (1 up to --max-procs) each repeat what a zero-copy worker does per batch, with
no DataLoader around it, and the aggregate rate is reported per N:

- ``copy``: stack ``--items`` preloaded items (views into one array) into a shared memfd
  slot (the ``ceiling`` workload's work);
- ``make``: only make the items (``torch.full``, the ``synthetic`` workload's items);
- ``make+copy``: both (the ``synthetic`` workload's work);
- ``copy+h2d`` (with CUDA): ``copy`` while the main process streams pinned memory to the GPU
  nonstop, to show how the two share memory bandwidth.

    python benchmarks/worker_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import time
from typing import Any

import torch

MiB = 1 << 20


def worker(
    kind: str, item_shape: tuple[int, ...], items: int, seconds: float, start: Any, q: Any
) -> None:
    torch.set_num_threads(1)
    item_bytes = int(torch.Size(item_shape).numel())
    nbytes = items * item_bytes
    fd = os.memfd_create("probe-slot")
    os.ftruncate(fd, nbytes)
    slot = mmap.mmap(fd, nbytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    os.close(fd)
    dst = torch.frombuffer(slot, dtype=torch.uint8).view(items, *item_shape)
    src = torch.empty((items * 4, *item_shape), dtype=torch.uint8)  # 4 batches' worth
    src.fill_(7)
    start.wait()
    batches = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        base = (batches % 4) * items
        if kind == "make":
            made = [torch.full(item_shape, i % 251, dtype=torch.uint8) for i in range(items)]
            del made
        elif kind == "make+copy":
            made = [torch.full(item_shape, i % 251, dtype=torch.uint8) for i in range(items)]
            torch.stack(made, 0, out=dst)
            del made
        else:
            torch.stack([src[base + i] for i in range(items)], 0, out=dst)
        batches += 1
    elapsed = time.perf_counter() - t0
    del dst
    slot.close()
    q.put((batches * nbytes, elapsed))


def stream_h2d(stop: Any, nbytes: int) -> float:
    """Copies one pinned buffer to the GPU until ``stop`` is set; returns GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copies = 0
    t0 = time.perf_counter()
    while not stop.is_set():
        for _ in range(8):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        copies += 8
    return copies * nbytes / (time.perf_counter() - t0) / 1e9


def run(kind: str, procs: int, args: argparse.Namespace) -> dict[str, float]:
    ctx = mp.get_context("fork")
    start, q = ctx.Event(), ctx.Queue()
    shape = tuple(args.item_shape)
    ps = [
        ctx.Process(
            target=worker,
            args=(kind.replace("+h2d", ""), shape, args.items, args.seconds, start, q),
        )
        for _ in range(procs)
    ]
    for p in ps:
        p.start()
    time.sleep(1.0)  # let every process make and touch its buffers
    h2d = None
    if kind.endswith("+h2d"):
        import threading

        stop = threading.Event()
        out: list[float] = []
        t = threading.Thread(target=lambda: out.append(stream_h2d(stop, 64 * MiB)))
        t.start()
        time.sleep(0.3)
    start.set()
    results = [q.get() for _ in ps]
    if kind.endswith("+h2d"):
        stop.set()
        t.join()
        h2d = out[0]
    for p in ps:
        p.join()
    total = sum(b for b, _ in results) / max(e for _, e in results) / 1e9
    row = {"kind": kind, "procs": procs, "GB/s": total, "GB/s per proc": total / procs}
    if h2d is not None:
        row["h2d GB/s"] = h2d
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=256)
    ap.add_argument("--item-shape", type=int, nargs="+", default=[3, 224, 224])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 4, 8, 14])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kinds = ["copy", "make", "make+copy"]
    if torch.cuda.is_available():
        torch.cuda.init()
        kinds.append("copy+h2d")
    rows = []
    for kind in kinds:
        for n in args.procs:
            row = run(kind, n, args)
            rows.append(row)
            extra = f"  h2d {row['h2d GB/s']:.1f} GB/s" if "h2d GB/s" in row else ""
            print(
                f"{kind:10s} {n:3d} procs  {row['GB/s']:6.1f} GB/s  "
                f"({row['GB/s per proc']:.2f} each){extra}",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "cpus": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
