"""Where the time inside ``next()`` goes: runs one loader for a number of steps with timing
wrappers around the functions a batch passes through in the main process (torch's iterator,
pinpool's decoder, the handles), and prints, per function and per thread (main, or torch's
pin thread), the calls, total and mean time.

    python benchmarks/next_profile.py --workload tokens --loader pinpool --device cuda

The wrappers cost about a microsecond a call, so absolute times are slightly high; compare
the rows with each other, and the ``next()`` line with the bench's.
"""

from __future__ import annotations

import argparse
import functools
import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import pinpool
import pinpool.loader
from pinpool._main import delivery, receiver
from pinpool._wire import codec, handle
from pinpool.bench.workloads import make_dataset

_TOTALS: dict[tuple[str, str], list[float]] = defaultdict(list)
_LOCK = threading.Lock()


Recorder = Callable[[str, str, float, float], None]


def _add_to_totals(label: str, who: str, start: float, end: float) -> None:
    with _LOCK:
        _TOTALS[(label, who)].append(end - start)


def wrap(owner: Any, name: str, label: str, record: Recorder = _add_to_totals) -> None:
    """Replaces ``owner.name`` with a function that calls it and hands ``record`` the label,
    the thread ("main" or "pin", torch's pin-memory thread), and the call's start and end."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            who = "main" if threading.current_thread() is threading.main_thread() else "pin"
            record(label, who, t0, time.perf_counter())

    setattr(owner, name, timed)


def instrument(record: Recorder = _add_to_totals) -> None:
    """Wraps every function a batch passes through in the main process."""

    def _wrap(owner: Any, name: str, label: str) -> None:
        wrap(owner, name, label, record)

    it_cls = torch.utils.data.dataloader._MultiProcessingDataLoaderIter
    for name in ("_next_data", "_get_data", "_try_get_data", "_process_data"):
        _wrap(it_cls, name, f"torch iter.{name}")
    pm = torch.utils.data._utils.pin_memory
    _wrap(pm, "pin_memory", "torch pin_memory()")
    _wrap(pinpool.loader, "finish", "pinpool finish")
    rec = receiver.Receiver
    for name in ("take", "_receive", "_adopt", "_copy_in", "_claim", "drop"):
        _wrap(rec, name, f"receiver.{name}")
    _wrap(delivery.Delivery, "__call__", "delivery")
    _wrap(receiver.Tickets, "assign", "tickets.assign")
    _wrap(delivery.OnDevice, "wait", "OnDevice.wait")
    for name in ("pin_memory", "take", "__setstate__"):
        _wrap(handle.BatchHandle, name, f"BatchHandle.{name}")
    for name in ("rebuild", "views_for"):
        _wrap(codec, name, f"codec.{name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="tokens")
    ap.add_argument("--shape", type=int, nargs="+", default=[8193])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument(
        "--loader", default="pinpool", choices=["pinpool", "pinpool-zerocopy", "torch-pinned"]
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--pin-thread",
        action="store_true",
        help="without an accelerator, make torch start its pin thread anyway (as on a GPU box)",
    )
    args = ap.parse_args()
    if args.pin_thread and not torch.accelerator.is_available():
        torch.accelerator.is_available = lambda: True
        torch.accelerator.current_accelerator = lambda *a: torch.device("cuda")
        torch.accelerator.current_device_index = lambda: 0
        torch.accelerator.set_device_index = lambda index: None
    dataset = make_dataset(
        args.workload, (args.steps + 50) * args.batch_size, tuple(args.shape), "/tmp"
    )
    kw: dict[str, Any] = dict(batch_size=args.batch_size, num_workers=args.workers)
    if args.loader == "torch-pinned":
        loader: Any = torch.utils.data.DataLoader(dataset, pin_memory=True, **kw)
    else:
        loader = pinpool.DataLoader(
            dataset, zero_copy=args.loader == "pinpool-zerocopy", device=args.device, **kw
        )
    instrument()
    it = iter(loader)
    for _ in range(50):
        next(it)
    _TOTALS.clear()
    waits = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        a = time.perf_counter()
        batch = next(it)
        waits.append(time.perf_counter() - a)
        del batch
    wall = time.perf_counter() - t0
    del it, loader
    rows = []
    for (label, who), xs in sorted(_TOTALS.items(), key=lambda kv: -sum(kv[1])):
        rows.append(
            {
                "function": label,
                "thread": who,
                "calls": len(xs),
                "total_ms": sum(xs) * 1e3,
                "mean_us": float(np.mean(xs)) * 1e6,
                "p99_us": float(np.percentile(xs, 99)) * 1e6,
            }
        )
    w = np.asarray(waits) * 1e6
    head = (
        f"{args.loader} {args.workload} batch {args.batch_size} x {args.shape} "
        f"device={args.device}: "
        f"{args.steps} steps in {wall:.2f} s = {wall / args.steps * 1e6:.0f} us/batch; "
        f"next() median {np.median(w):.0f} us, p99 {np.percentile(w, 99):.0f} us"
    )
    print(head)
    cols = ("calls", "total ms", "mean us", "p99 us")
    print(f"  {'function':32s} {'thread':6s} " + " ".join(f"{c:>8s}" for c in cols))
    for r in rows:
        print(
            f"  {r['function']:32s} {r['thread']:6s} {r['calls']:7d} {r['total_ms']:9.1f} "
            f"{r['mean_us']:8.1f} {r['p99_us']:8.1f}"
        )
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"head": head, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
