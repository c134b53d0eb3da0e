"""Where the time inside ``next()`` goes: runs one loader for a number of steps with timing
wrappers around the functions of torch's a batch passes through (its iterator, its queues,
its pin_memory(), its workers' fetch), and pinpool's trace hook (``pinpool.trace``: the steps
pinpool reports, rows named by their events: ``batch.take``, ``slot.claim``, ...), and prints,
per function or event and per thread (main, or torch's pin thread; in the workers, worker),
the calls, total and mean time.

    python benchmarks/next_profile.py --workload tokens --loader pinpool --device cuda

The wrappers cost about a microsecond a call, so absolute times are slightly high; compare
the rows with each other, and the ``next()`` line with the bench's. The ``max us`` column and
the slowest ``next()`` are distorted late in a run: each worker writes all its records to a
file every 50 batches, which takes longer as they grow.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing.queues
import os
import queue
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import pinpool
import pinpool.trace
from pinpool.bench.workloads import collate_of, make_dataset

_TOTALS: dict[tuple[str, str], list[float]] = defaultdict(list)
_LOCK = threading.Lock()


Recorder = Callable[[str, str, float, float], None]

#: The process that runs the loader; the workers are its forked children.
_MAIN_PID = os.getpid()
#: Workers write their totals here (``<pid>.json``) every :data:`_DUMP_EVERY` batches.
_WORKER_DIR = os.path.join(tempfile.gettempdir(), f"next_profile_{_MAIN_PID}")
_DUMP_EVERY = 50
#: The label of torch's fetch (collation included), where a worker uses torch's fetcher.
_WORKER_BATCH = "torch fetch + collate"
#: The label of the call that ends a worker's batch, whichever fetcher made it: the put of
#: its result on torch's data queue.
_WORKER_PUT = "multiprocessing Queue.put"


def _dump_worker_totals() -> None:
    """In a worker: writes its totals, every :data:`_DUMP_EVERY` batches (a DataLoader worker
    exits without running ``atexit`` handlers, so the last few batches may be missing)."""
    with _LOCK:
        done = _TOTALS.get((_WORKER_PUT, "worker"))
        if not done or len(done) % _DUMP_EVERY:
            return  # (none: another recorder than the totals, stall_trace.py's)
        data = {f"{label}\t{who}": xs for (label, who), xs in _TOTALS.items()}
    os.makedirs(_WORKER_DIR, exist_ok=True)
    path = os.path.join(_WORKER_DIR, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _merge_worker_totals() -> None:
    """In the main process: adds every worker's totals to ours (rows with thread "worker",
    or "w-feed" for a worker's queue feeder thread)."""
    if not os.path.isdir(_WORKER_DIR):
        return
    for name in os.listdir(_WORKER_DIR):
        with open(os.path.join(_WORKER_DIR, name)) as f:
            data = json.load(f)
        for key, xs in data.items():
            label, who = key.split("\t")
            _TOTALS[(label, who)].extend(xs)
        os.unlink(os.path.join(_WORKER_DIR, name))
    os.rmdir(_WORKER_DIR)


def _add_to_totals(label: str, who: str, start: float, end: float) -> None:
    with _LOCK:
        _TOTALS[(label, who)].append(end - start)


def _who() -> str:
    """The calling thread: "main" or "pin" (any other thread: torch's pin-memory thread, or
    one of pinpool's) in the main process, "worker" or "w-feed" (its queue's feeder thread)
    in a worker."""
    main_thread = threading.current_thread() is threading.main_thread()
    if os.getpid() == _MAIN_PID:
        return "main" if main_thread else "pin"
    return "worker" if main_thread else "w-feed"


def wrap(owner: Any, name: str, label: str, record: Recorder = _add_to_totals) -> None:
    """Replaces ``owner.name`` (torch's or the standard library's: pinpool's own steps come
    from its trace hook) with a function that calls it and hands ``record`` the label, the
    thread (:func:`_who`), and the call's start and end."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            who = _who()
            record(label, who, t0, time.perf_counter())
            if who == "worker" and label == _WORKER_PUT:
                _dump_worker_totals()

    setattr(owner, name, timed)


def trace_into(record: Recorder = _add_to_totals) -> None:
    """Hands ``record`` every step pinpool reports (``pinpool.trace``), labelled by its
    event's name, in this process and in the workers forked after this."""

    def hook(e: pinpool.trace.Event) -> None:
        record(e.name, _who(), e.start_ns / 1e9, e.end_ns / 1e9)

    pinpool.trace.set_hook(hook)


def instrument(record: Recorder = _add_to_totals) -> None:
    """Wraps torch's functions a batch passes through, and sets pinpool's trace hook."""

    def _wrap(owner: Any, name: str, label: str) -> None:
        wrap(owner, name, label, record)

    it_cls = torch.utils.data.dataloader._MultiProcessingDataLoaderIter
    for name in ("_next_data", "_get_data", "_try_get_data", "_process_data", "_try_put_index"):
        _wrap(it_cls, name, f"torch iter.{name}")
    # The queues between the threads: a worker's batch reaches the pin thread through a
    # multiprocessing queue, and the consumer through a thread queue.
    _wrap(multiprocessing.queues.Queue, "get", "multiprocessing Queue.get")
    _wrap(multiprocessing.queues.Queue, "put", _WORKER_PUT)
    _wrap(queue.Queue, "put", "queue.Queue.put")
    pm = torch.utils.data._utils.pin_memory
    _wrap(pm, "pin_memory", "torch pin_memory()")
    # In the workers (forked after this): torch's fetch (the dataset and the collation, with
    # pinpool's part of it: the worker.* events).
    fetch = torch.utils.data._utils.fetch._MapDatasetFetcher
    _wrap(fetch, "fetch", _WORKER_BATCH)
    trace_into(record)


def _thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds each thread of process ``pid`` has run, by thread id, with its name:
    ``schedstat`` (nanoseconds) where the kernel keeps it, else ``stat`` (clock ticks)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            try:
                with open(f"{base}/schedstat") as f:
                    seconds = int(f.read().split()[0]) / 1e9
            except OSError:
                with open(f"{base}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                seconds = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
        out[int(tid)] = (name, seconds)
    return out


def _cpu_rows(
    before: dict[Any, tuple[str, float]], after: dict[Any, tuple[str, float]], steps: int
) -> list[tuple[str, float]]:
    """CPU time per batch for each kind of thread (threads of one name added up)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    per: dict[str, float] = defaultdict(float)
    for key, (comm, seconds) in after.items():
        pid, tid = key
        used = seconds - before.get(key, (comm, 0.0))[1]
        if pid != os.getpid():
            name = "worker processes (all threads)"
        else:
            name = names.get(tid, comm)
            if name.startswith("Thread-") and "(" in name:  # torch's: "Thread-3 (_pin_memory_loop)"
                name = name[name.index("(") + 1 : -1]
            elif name.startswith("pinpool-copy"):
                name = "pinpool-copy-*"
        per[name] += used
    return sorted(((n, v / steps) for n, v in per.items() if v > 0), key=lambda r: -r[1])


def _all_cpu(pids: list[int]) -> dict[tuple[int, int], tuple[str, float]]:
    return {(pid, tid): v for pid in pids for tid, v in _thread_cpu(pid).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="tokens")
    ap.add_argument(
        "--shape", type=int, nargs="+", default=[8193], help="varlen: the shortest and longest row"
    )
    ap.add_argument("--lengths", default="pareto", help="varlen: pareto, lognormal or ascending")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument(
        "--loader", default="pinpool", choices=["pinpool", "pinpool-zerocopy", "torch-pinned"]
    )
    ap.add_argument("--device", default=None)
    ap.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="sleep this long after each batch (the GIL released, as in a step's GPU wait)",
    )
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
        args.workload, (args.steps + 50) * args.batch_size, tuple(args.shape), "/tmp", args.lengths
    )
    kw: dict[str, Any] = dict(
        batch_size=args.batch_size, num_workers=args.workers, collate_fn=collate_of(dataset)
    )
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
    pids = [os.getpid()] + [p.pid for p in multiprocessing.active_children() if p.pid]
    cpu_before = _all_cpu(pids)
    waits = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        a = time.perf_counter()
        batch = next(it)
        waits.append(time.perf_counter() - a)
        del batch
        if args.step_ms:
            time.sleep(args.step_ms / 1e3)
    wall = time.perf_counter() - t0
    cpu = _cpu_rows(cpu_before, _all_cpu(pids), args.steps)
    del it, loader
    pinpool.trace.set_hook(None)
    _TOTALS.pop((_WORKER_BATCH, "main"), None)
    _merge_worker_totals()
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
                "max_us": float(np.max(xs)) * 1e6,
            }
        )
    w = np.asarray(waits) * 1e6
    head = (
        f"{args.loader} {args.workload} batch {args.batch_size} x {args.shape} "
        f"device={args.device}, {args.step_ms} ms a step: "
        f"{args.steps} steps in {wall:.2f} s = {wall / args.steps * 1e6:.0f} us/batch; "
        f"next() median {np.median(w):.0f} us, p99 {np.percentile(w, 99):.0f} us, "
        f"max {np.max(w):.0f} us (step {int(np.argmax(w))})"
    )
    print(head)
    cols = ("calls", "total ms", "mean us", "p99 us", "max us")
    print(f"  {'function':32s} {'thread':6s} " + " ".join(f"{c:>8s}" for c in cols))
    for r in rows:
        print(
            f"  {r['function']:32s} {r['thread']:6s} {r['calls']:7d} {r['total_ms']:9.1f} "
            f"{r['mean_us']:8.1f} {r['p99_us']:8.1f} {r['max_us']:8.0f}"
        )
    print("  CPU time per batch, by thread (the GIL is one: the main process's Python threads")
    print("  together cannot use more than the time per batch):")
    for name, per_batch in cpu:
        print(f"    {name:40s} {per_batch * 1e6:8.1f} us")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"head": head, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
