"""Where the consumer's thread and torch's pin thread spend each small batch, by mode: for
the tokens workload, the wall time and the thread's own CPU time of each step of the main
process's path (wall minus CPU: the time the thread was off its core, waiting for the GIL,
a lock or a wake-up); and the epoch's GB/s under a few settings of the interpreter's switch
interval and torch's ``prefetch_factor``, which tell whether the loop is bound by one thread's
work, by the GIL's hand-offs, or by the batches in flight.

    python benchmarks/consumer_path.py --rounds 2 --out path.json

Steps timed (each wrapped where it is called, so a step nested in another counts in both):

- ``next``: the training loop's ``next()`` on the loader's iterator;
- ``wait``: ``Pending.wait`` on the consumer's thread (a background copy waited for, the
  batch sent to the device in its turn);
- ``send_in_turn``: within it, the device allocation, the one native send and the rebuild;
  ``allocate``, ``raw_stream``, ``rebuild`` its parts;
- ``take``: the pin thread's ``Receiver.take`` (zero-copy: the slot adopted; copy mode: the
  segment opened and its copy into the slot started); ``adopt`` its zero-copy part.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import pinpool
from pinpool._main.route import delivery, intake, receiver
from pinpool._wire import leaves
from pinpool.bench.workloads import make_dataset

MODES = {
    "cpu": {"device": None},
    "device": {"device": "cuda"},
    "zero-copy": {"device": "cuda", "zero_copy": True},
}

#: step -> list of (wall ns, thread CPU ns), appended by the wrappers while ``_timing`` is set.
_times: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
_timing = threading.Event()


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _timing.is_set():
            return fn(*args, **kwargs)
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            _times[name].append((time.perf_counter_ns() - w0, time.thread_time_ns() - c0))

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _install() -> None:
    """Wraps the steps the module's doc names (once)."""
    targets = [
        (delivery.Pending, "wait", "wait"),
        (delivery.Delivery, "send_in_turn", "send_in_turn"),
        (delivery.Delivery, "_allocate", "allocate"),
        (delivery.Delivery, "current_raw_stream", "raw_stream"),
        (receiver.Receiver, "take", "take"),
        (intake.Intake, "adopt", "adopt"),
    ]
    for owner, attr, name in targets:
        setattr(owner, attr, _timed(name, getattr(owner, attr)))
    leaves.rebuild = _timed("rebuild", leaves.rebuild)  # (called as leaves.rebuild)


def _summary(rows: list[tuple[int, int]]) -> dict[str, float]:
    walls = sorted(w for w, _ in rows)
    n = len(rows)
    wall = sum(walls) / n / 1e3
    cpu = sum(c for _, c in rows) / n / 1e3
    return {
        "n": n,
        "wall mean": wall,
        "wall median": walls[n // 2] / 1e3,
        "cpu mean": cpu,
        "off-cpu mean": wall - cpu,
    }


def run(mode: str, args: argparse.Namespace, switch: float, prefetch: int) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(MODES[mode])
    if not torch.cuda.is_available():
        kwargs["device"] = None
    device = torch.device("cuda") if torch.cuda.is_available() else None
    ds = make_dataset("tokens", args.batch * args.steps, (8193,), tempfile.gettempdir())
    dl = pinpool.DataLoader(
        ds, batch_size=args.batch, num_workers=args.workers, prefetch_factor=prefetch, **kwargs
    )
    old = sys.getswitchinterval()
    sys.setswitchinterval(switch)
    try:
        for timed in (False, True):  # (a first epoch makes, sizes and faults in the pool)
            _times.clear()
            if timed:
                _timing.set()
            t0 = time.perf_counter()
            nbytes = 0
            it = iter(dl)
            nxt = _timed("next", it.__next__)
            while True:
                try:
                    batch = nxt()
                except StopIteration:
                    break
                if device is not None and batch.device.type == "cpu":
                    batch = batch.to(device, non_blocking=True)
                nbytes += batch.nbytes
                del batch
            if device is not None:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            _timing.clear()
    finally:
        sys.setswitchinterval(old)
    out = {
        "mode": mode,
        "switch ms": switch * 1e3,
        "prefetch": prefetch,
        "GB/s": nbytes / wall / 1e9,
        "us per batch": wall / args.steps * 1e6,
        "steps": {name: _summary(rows) for name, rows in sorted(_times.items()) if rows},
    }
    del dl
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--switch-ms", nargs="+", type=float, default=[5.0, 0.5])
    ap.add_argument("--prefetch", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    _install()
    runs = [
        run(m, args, s / 1e3, p)
        for _ in range(args.rounds)
        for s in args.switch_ms
        for p in args.prefetch
        for m in args.modes
    ]
    print(f"tokens, {args.batch} x 8193 int64, {args.workers} workers, {args.steps} steps")
    print(f"{'mode':10s} {'switch ms':>9s} {'prefetch':>8s} {'GB/s':>6s} {'us/batch':>8s}")
    for r in runs:
        print(
            f"{r['mode']:10s} {r['switch ms']:9.1f} {r['prefetch']:8d} {r['GB/s']:6.2f} "
            f"{r['us per batch']:8.1f}"
        )
    print("-- steps, us a call: n, wall mean, wall median, CPU mean, off-CPU mean")
    for r in runs:
        print(f"{r['mode']} (switch {r['switch ms']:.1f} ms, prefetch {r['prefetch']})")
        for name, s in r["steps"].items():
            print(
                f"   {name:14s} {s['n']:6d} {s['wall mean']:8.1f} {s['wall median']:8.1f} "
                f"{s['cpu mean']:8.1f} {s['off-cpu mean']:8.1f}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
