"""Where each mode's time goes for small batches (the tokens workload): per batch, the main
process's CPU and the workers' CPU, and, from pinpool's trace, what a worker's
``worker.destination`` costs by kind (a zero-copy slot in a kept window, one mapped now, or a
segment); and, per thread of the main process (``/proc/self/task/*/schedstat``), the time it
ran and the time it waited, runnable, for a core (a thread preempted while it holds the GIL
holds up the others).

Each round runs one epoch per mode (pinned CPU batches moved by the consumer, device batches,
zero-copy), in turn, so that the modes share the machine's state:

    python benchmarks/mode_costs.py --rounds 3 --out costs.json

CPU figures: ``getrusage`` of the main process over the epoch, and of its reaped children
(the workers, non-persistent, joined by the end of the epoch) over the same epoch.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import tempfile
import threading
import time
from typing import Any

import torch

import pinpool
import pinpool.trace
from pinpool.bench.workloads import make_dataset

MODES = {
    "cpu": {"device": None},
    "device": {"device": "cuda"},
    "zero-copy": {"device": "cuda", "zero_copy": True},
}


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _threads() -> dict[int, tuple[str, int, int]]:
    """This process's threads: id -> (name, ns run, ns waited runnable)."""
    out = {}
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ran, waited, _ = f.read().split()
        except OSError:
            continue  # (it ended)
        out[int(tid)] = (python_names.get(int(tid), name), int(ran), int(waited))
    return out


def _per_name(first: dict[int, Any], last: dict[int, Any], steps: int) -> dict[str, Any]:
    """Per thread name (numbered names as one), µs run and waited per batch, between the two
    snapshots (threads in both)."""
    rows: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for tid, (name, ran, waited) in last.items():
        if tid in first:
            key = name.rstrip("0123456789-") + "*" if name[-1:].isdigit() else name
            rows[key][0] += (ran - first[tid][1]) / steps / 1e3
            rows[key][1] += (waited - first[tid][2]) / steps / 1e3
    return {k: {"ran": v[0], "waited": v[1]} for k, v in rows.items()}


def _renice(name: str, nice: int) -> None:
    """Sets the nice value of this process's threads called ``name`` (an experiment: what a
    lower priority of pinpool's pipe writers would change)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except OSError:
            pass


def _epoch(
    dl: Any, device: torch.device | None, steps: int, pipe_nice: int = 0
) -> tuple[int, dict[str, Any]]:
    n = 0
    first: dict[int, Any] = {}
    last: dict[int, Any] = {}
    for i, batch in enumerate(dl):
        if device is not None and batch.device.type == "cpu":
            batch = batch.to(device, non_blocking=True)
        n += batch.nbytes
        del batch
        if i == 1:
            if pipe_nice:
                _renice("pinpool-pipe", pipe_nice)
            first = _threads()
        elif i == steps - 2:
            last = _threads()
    return n, _per_name(first, last, steps - 3)


class _PutTimes:
    """Wall time of each index queue put (``DirectQueue.put``) from :func:`_timed_puts` on."""

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0

    def mean(self) -> float:
        return self.ns / max(1, self.calls) / 1e3


def _timed_puts() -> _PutTimes:
    from pinpool._main.epochs import index_queue

    times = _PutTimes()
    put = getattr(index_queue.DirectQueue.put, "__wrapped__", index_queue.DirectQueue.put)

    def timed(self: Any, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter_ns()
        try:
            put(self, *args, **kwargs)
        finally:
            times.ns += time.perf_counter_ns() - t0
            times.calls += 1

    timed.__wrapped__ = put  # type: ignore[attr-defined]
    index_queue.DirectQueue.put = timed  # type: ignore[method-assign]
    return times


def run_mode(name: str, args: argparse.Namespace, traced: bool) -> dict[str, Any]:
    kwargs = dict(MODES[name])
    if not torch.cuda.is_available():
        kwargs["device"] = None
    device = torch.device("cuda") if torch.cuda.is_available() else None
    ds = make_dataset("tokens", args.batch * args.steps, (8193,), tempfile.gettempdir())
    dl = pinpool.DataLoader(ds, batch_size=args.batch, num_workers=args.workers, **kwargs)
    _epoch(dl, device, args.steps)  # (a first epoch: the pool is made, sized, faulted in)
    if device is not None:
        torch.cuda.synchronize()
    time.sleep(0.3)
    main0, kids0, t0 = (
        _cpu(resource.RUSAGE_SELF),
        _cpu(resource.RUSAGE_CHILDREN),
        time.perf_counter(),
    )
    put = _timed_puts()
    nbytes, threads = _epoch(dl, device, args.steps, args.pipe_nice)
    if device is not None:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    main = _cpu(resource.RUSAGE_SELF) - main0
    time.sleep(0.5)  # (the workers are joined off the consumer's thread)
    kids = _cpu(resource.RUSAGE_CHILDREN) - kids0
    out = {
        "mode": name,
        "traced": traced,
        "GB/s": nbytes / wall / 1e9,
        "us per batch": wall / args.steps * 1e6,
        "main CPU us/batch": main / args.steps * 1e6,
        "workers CPU us/batch": kids / args.steps * 1e6,
        "put us": put.mean(),
        "fallbacks": dl.stats().get("zero_copy_fallbacks", 0),
        "threads": threads,
    }
    del dl
    return out


def place_split(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One traced epoch: worker.destination (and the main process's events) by kind."""
    folder = tempfile.mkdtemp(prefix="mode-costs-")
    wanted = {
        "worker.destination",
        "worker.write",
        "batch.adopt",
        "index.put",
        "batch.wait",
        "batch.send",
    }

    def hook(e: Any) -> None:
        if e.name in wanted:
            with open(os.path.join(folder, f"{os.getpid()}.txt"), "a") as f:
                f.write(json.dumps([e.name, e.end_ns - e.start_ns, e.details]) + "\n")

    pinpool.trace.set_hook(hook)
    try:
        run_mode(name, args, traced=True)
    finally:
        pinpool.trace.set_hook(None)
    rows: dict[str, list[float]] = collections.defaultdict(list)
    for file in os.listdir(folder):
        with open(os.path.join(folder, file)) as f:
            for line in f:
                event, ns, details = json.loads(line)
                if event == "worker.destination":
                    kind = "slot" if details.get("slot") else "segment"
                    event += f" {kind}" + (" mapped now" if details.get("mapped") else "")
                rows[event].append(ns / 1e3)
    split = {}
    for event, us in sorted(rows.items()):
        us.sort()
        split[event] = {
            "n": len(us),
            "mean": sum(us) / len(us),
            "median": us[len(us) // 2],
            "p99": us[min(len(us) - 1, int(len(us) * 0.99))],
        }
    return split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--pipe-nice", type=int, default=0, help="nice value for the pipe writers")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = [run_mode(m, args, False) for _ in range(args.rounds) for m in args.modes]
    splits = {m: place_split(m, args) for m in args.modes}
    keys = ["GB/s", "us per batch", "main CPU us/batch", "workers CPU us/batch", "put us"]
    print(
        f"tokens, {args.batch} x 8193 int64, {args.workers} workers, {args.steps} steps, "
        f"pipe writers at nice {args.pipe_nice}"
    )
    print(f"{'mode':10s} " + " ".join(f"{k:>20s}" for k in keys))
    for r in runs:
        print(f"{r['mode']:10s} " + " ".join(f"{r[k]:20.2f}" for k in keys))
        threads = sorted(r["threads"].items(), key=lambda kv: -kv[1]["ran"])
        print(
            "   threads, us ran/waited a batch: "
            + ", ".join(
                f"{k} {v['ran']:.1f}/{v['waited']:.1f}" for k, v in threads if v["ran"] > 0.5
            )
        )
    for m, split in splits.items():
        print(f"-- traced, {m}: us (n, mean, median, p99)")
        for event, s in split.items():
            print(f"   {event:32s} {s['n']:6d} {s['mean']:8.1f} {s['median']:8.1f} {s['p99']:8.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "splits": splits}, f, indent=1)


if __name__ == "__main__":
    main()
