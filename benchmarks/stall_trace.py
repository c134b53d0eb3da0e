"""Which call stalled the main thread: runs a loader over big batches for two epochs while a
thread sleeps 1 ms at a time, records when each wake-up came late, and the start and end of
every call a batch passes through in the main process (the functions and pinpool's trace
events ``next_profile.py`` times, plus worker start-up, shutdown and the copy to the GPU).
Prints every wake-up later than ``--late-ms`` with the calls that overlapped it, the innermost
last.

    python benchmarks/stall_trace.py --loader pinpool --device cuda
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing.popen_fork
import multiprocessing.popen_forkserver
import multiprocessing.popen_spawn_posix
import sys
import threading
import time
from typing import Any

import next_profile
import torch

import pinpool
from pinpool.bench.workloads import make_dataset, move, tensors

_SPANS: list[tuple[float, float, str, str]] = []


def _keep_span(label: str, who: str, start: float, end: float) -> None:
    _SPANS.append((start, end, label, who))


def _span(owner: Any, name: str, label: str) -> None:
    next_profile.wrap(owner, name, label, _keep_span)


#: Calls (Python and C) that lasted at least --calls-ms: start, end, thread, name, where.
_CALLS: list[tuple[float, float, str, str, str]] = []
#: Calls that wait with the GIL released (their time is not a stall of anyone).
_WAITS = ("acquire", "wait", "sleep", "join", "get", "poll", "select", "recv", "read", "accept")


def _profile_calls(threshold_s: float) -> None:
    """Records, on every Python thread, each call lasting ``threshold_s`` or more."""
    local = threading.local()

    def hook(frame: Any, event: str, arg: Any) -> None:
        stack = getattr(local, "stack", None)
        if stack is None:
            stack = local.stack = []
        if event in ("call", "c_call"):
            stack.append(time.perf_counter())
        elif stack:
            t0 = stack.pop()
            t1 = time.perf_counter()
            if t1 - t0 >= threshold_s:
                c = event.startswith("c_")
                name = getattr(arg, "__qualname__", repr(arg)) if c else frame.f_code.co_qualname
                where = f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}"
                _CALLS.append((t0, t1, threading.current_thread().name, name, where))

    threading.setprofile(hook)
    sys.setprofile(hook)


#: Every Python call and return on every thread (with --events): time, thread, function.
_EVENTS: list[tuple[float, str, str]] = []


def _record_events() -> None:
    """Records every call on every Python thread: a thread that makes calls during a late
    wake-up held the GIL then (no Python code runs without it)."""

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            name = (
                getattr(arg, "__qualname__", "?")
                if event == "c_call"
                else (f"{frame.f_code.co_qualname} ({frame.f_code.co_filename.rsplit('/', 1)[-1]})")
            )
            _EVENTS.append((time.perf_counter(), threading.current_thread().name, name))

    threading.setprofile(hook)
    sys.setprofile(hook)


def _running(due: float, woke: float) -> str:
    """The threads that made calls during a late wake-up, busiest first, with their most
    frequent calls."""
    import bisect
    from collections import Counter

    times = [e[0] for e in _EVENTS]
    lo, hi = bisect.bisect_left(times, due), bisect.bisect_right(times, woke)
    per: dict[str, Counter[str]] = {}
    for _, who, name in _EVENTS[lo:hi]:
        if who != "sleeper":
            per.setdefault(who, Counter())[name] += 1
    parts = []
    for who, names in sorted(per.items(), key=lambda kv: -sum(kv[1].values())):
        top = ", ".join(f"{n} x{c}" for n, c in names.most_common(4))
        parts.append(f"[{who}: {sum(names.values())} calls] {top}")
    # The calls entered last before the wake-up was due: one of them may have held the GIL.
    last: dict[str, tuple[float, str]] = {}
    for t, who, name in reversed(_EVENTS[max(0, lo - 400) : lo]):
        if who != "sleeper" and who not in last:
            last[who] = (t, name)
    before = ", ".join(
        f"[{who}] {name} at {1e3 * (t - due):+.1f} ms"
        for who, (t, name) in sorted(last.items(), key=lambda kv: -kv[1][0])[:3]
    )
    return " | ".join(parts) + f"; last calls before: {before}"


def _timeline(path: str, due: float, woke: float, lateness: float) -> None:
    """Appends every call made from 2 ms before a late wake-up was due until it woke."""
    with open(path, "a") as f:
        f.write(f"--- late {1e3 * lateness:.1f} ms\n")
        for t, who, name in _EVENTS:
            if due - 0.002 <= t <= woke:
                f.write(f"{1e3 * (t - due):+8.3f} {who:28s} {name}\n")


def _holding(due: float, woke: float) -> str:
    """The innermost non-waiting long calls, per thread, that ran across a late wake-up."""
    by_thread: dict[str, list[tuple[float, float, str, str, str]]] = {}
    waiting: set[str] = set()  # threads in a wait that covers the whole wake-up
    for c in _CALLS:
        if c[0] < woke and c[1] > due:
            if not any(w in c[3].lower() for w in _WAITS):
                by_thread.setdefault(c[2], []).append(c)
            elif c[0] <= due and c[1] >= woke:
                waiting.add(c[2])
    parts = []
    for who, calls in by_thread.items():
        if who in waiting:
            continue
        inner = sorted(calls, key=lambda c: c[1] - c[0])[:3]
        parts.append(
            f"[{who}] " + " < ".join(f"{c[3]} ({c[4]}) {1e3 * (c[1] - c[0]):.1f} ms" for c in inner)
        )
    return " | ".join(parts)


#: The thread-state sampler's process (``--states``): reads, as fast as it can, the state and
#: kernel wait channel of every thread of process ``argv[1]`` from ``/proc``, keeping those
#: running (R) or in an uninterruptible wait (D), until its stdin closes; then writes them as
#: JSON lines ``[time, tid, name, state, wchan]`` to stdout.
_STATE_SAMPLER = """
import json, os, sys, threading, time
pid = int(sys.argv[1])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
tasks, seen, out = {}, 0.0, []
print("ready", flush=True)
while not stop.is_set():
    now = time.perf_counter()
    if now - seen > 0.02:  # new threads
        seen = now
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                if tid not in tasks:
                    try:
                        base = f"/proc/{pid}/task/{tid}"
                        tasks[tid] = (os.open(base + "/stat", os.O_RDONLY),
                                      os.open(base + "/wchan", os.O_RDONLY))
                    except OSError:
                        pass
        except OSError:
            break
    for tid, (fs, fw) in list(tasks.items()):
        try:
            stat = os.pread(fs, 512, 0).decode()
        except OSError:
            del tasks[tid]
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        state = rest[0]
        if state in "RD":
            try:
                wchan = os.pread(fw, 128, 0).decode()
            except OSError:
                wchan = "?"
            out.append([now, int(tid), name, state, wchan])
for line in out:
    sys.stdout.write(json.dumps(line) + chr(10))
"""


def _start_sampler() -> Any:
    """Starts the thread-state sampler on this process (``--states``)."""
    import os
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _STATE_SAMPLER, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    if proc.stdout.readline() != b"ready\n":
        raise RuntimeError("the thread-state sampler did not start")
    return proc


def _states(samples: list[list[Any]], names: dict[int, str], due: float, woke: float) -> str:
    """What the sampler saw during a late wake-up: per thread (Python name where known), how
    often it was running (R) or in an uninterruptible wait (D, with the kernel function)."""
    from collections import Counter

    seen: Counter[str] = Counter()
    for t, tid, comm, state, wchan in samples:
        if due <= t <= woke:
            who = names.get(tid, comm)
            seen[f"{who} {state}{'' if state == 'R' else ' ' + wchan}"] += 1
    return ", ".join(f"{k} x{c}" for k, c in seen.most_common(6))


def _whole_pool(dataset: Any, args: argparse.Namespace) -> pinpool.PinPool:
    """``--whole-arena``: a pool made whole now (``background=False``), sized as the loader
    sizes its own (docs/guide.md): the batches in flight plus 4, at 1.25 times the first
    batch's size, at least 64 MiB."""
    batch = sum(t.numel() * t.element_size() for t in tensors(dataset[0])) * args.batch_size
    slot = -(-int(batch * 1.25) // (1 << 20)) << 20
    slots = max(2 * max(args.workers, 1) + 4, -(-(64 << 20) // slot))
    device = args.device or "cpu"
    return pinpool.PinPool(slot, slots, device=device, background=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loader", default="pinpool", choices=["pinpool", "pinpool-zerocopy"])
    ap.add_argument("--device", default=None, help="deliver batches on this device")
    ap.add_argument("--shape", type=int, nargs="+", default=[3, 3344, 3344])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batches", type=int, default=16, help="per epoch")
    ap.add_argument("--late-ms", type=float, default=2.0)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--whole-arena",
        action="store_true",
        help="give the loader a pool made whole (no background preparation; made before the "
        "loader, sized as the loader would size its own from the first batch)",
    )
    ap.add_argument(
        "--start-method",
        choices=["fork", "forkserver", "spawn"],
        help="how the workers start (multiprocessing's default); a forkserver is started, "
        "with torch and pinpool imported, before the loader",
    )
    ap.add_argument(
        "--events",
        action="store_true",
        help="record every call on every thread and name the threads that ran Python during "
        "each late wake-up (slow; use with --start-method forkserver, so workers are not "
        "traced)",
    )
    ap.add_argument("--timeline", help="with --events: write each late wake-up's calls here")
    ap.add_argument(
        "--states",
        action="store_true",
        help="sample, from another process, the state of every thread of this one (running, "
        "or waiting in the kernel and where) and show it for each late wake-up",
    )
    ap.add_argument(
        "--calls-ms",
        type=float,
        help="also record every call, on every thread, lasting this long or more, and name "
        "the ones that ran across each late wake-up (slows the run a little)",
    )
    args = ap.parse_args()
    if args.start_method:
        multiprocessing.set_start_method(args.start_method, force=True)
        if args.start_method == "forkserver":
            multiprocessing.set_forkserver_preload(["torch", "pinpool", "pinpool.bench.workloads"])
            first = multiprocessing.Process(target=time.sleep, args=(0,))
            first.start()
            first.join()
    dataset = make_dataset("synthetic", args.batches * args.batch_size, tuple(args.shape), "/tmp")
    late: list[tuple[float, float]] = []
    stop = threading.Event()

    def sleeper() -> None:
        while not stop.is_set():
            due = time.perf_counter() + 0.001
            time.sleep(0.001)
            now = time.perf_counter()
            late.append((due, now - due))

    # Spans: every function and trace event next_profile times, plus the functions that only
    # run now and then (pinpool's own, pool.make, workers.start, loader.close..., are events).
    next_profile.instrument(_keep_span)
    _span(multiprocessing.popen_fork.Popen, "_launch", "fork a worker")
    _span(multiprocessing.popen_forkserver.Popen, "_launch", "forkserver: start a worker")
    _span(multiprocessing.popen_spawn_posix.Popen, "_launch", "spawn a worker")
    _span(threading.Thread, "start", "start a thread")
    _span(torch.accelerator, "set_device_index", "set_device_index")
    _span(torch, "set_num_threads", "set_num_threads")
    it_cls = torch.utils.data.dataloader._MultiProcessingDataLoaderIter
    _span(it_cls, "_reset", "torch iterator reset")
    _span(it_cls, "_try_put_index", "torch put index")
    _span(it_cls, "_shutdown_workers", "torch shutdown workers")
    _span(it_cls, "__init__", "torch iterator start")
    _span(torch.Tensor, "to", "Tensor.to")
    _span(gc, "collect", "gc.collect")
    gc_start: list[float] = []

    def gc_span(phase: str, info: dict[str, int]) -> None:  # collections the interpreter starts
        if phase == "start":
            gc_start[:] = [time.perf_counter()]
        elif gc_start:
            who = threading.current_thread().name
            _keep_span(f"gc gen {info['generation']}", who, gc_start[0], time.perf_counter())

    gc.callbacks.append(gc_span)
    thread = threading.Thread(target=sleeper, daemon=True, name="sleeper")
    thread.start()
    if args.calls_ms:
        _profile_calls(args.calls_ms / 1e3)
    elif args.events:
        _record_events()
    sampler = _start_sampler() if args.states else None
    names: dict[int, str] = {}  # native thread id -> Python thread name

    def note_threads() -> None:
        names.update({t.native_id: t.name for t in threading.enumerate() if t.native_id})

    time.sleep(0.05)
    marks = []
    t_start = time.perf_counter()
    pool = _whole_pool(dataset, args) if args.whole_arena else None
    loader = pinpool.DataLoader(
        dataset,
        batch_size=args.batch_size,
        num_workers=args.workers,
        zero_copy=args.loader == "pinpool-zerocopy",
        pool=pool,
    )
    for epoch in range(2):
        marks.append((time.perf_counter(), f"epoch {epoch + 1}"))
        for batch in loader:
            if args.device:
                batch = move(batch, torch.device(args.device), True)
            del batch
            note_threads()
    marks.append((time.perf_counter(), "del loader"))
    del loader
    if pool is not None:
        pool.close()
    marks.append((time.perf_counter(), "end"))
    time.sleep(0.05)
    sys.setprofile(None)
    threading.setprofile(None)
    stop.set()
    thread.join()
    samples: list[list[Any]] = []
    if sampler is not None:
        out_bytes, _ = sampler.communicate(timeout=120)
        samples = [json.loads(line) for line in out_bytes.decode().splitlines()]
        note_threads()
    print(
        f"{args.loader}, {args.batches} batches of {args.batch_size} x {args.shape}, 2 epochs"
        f"{', whole arena at once' if args.whole_arena else ''}"
        f"{f', workers started by {args.start_method}' if args.start_method else ''}"
    )
    out = []
    for due, lateness in late:
        if due < t_start or lateness < 2e-4:
            continue
        phase = [m for t, m in marks if t <= due]
        woke = due + lateness
        spans = sorted(
            (s for s in _SPANS if s[0] < woke and s[1] > due), key=lambda s: (s[0], -s[1])
        )
        where = "; ".join(
            f"{label}[{who}] {1e3 * (b - a):.1f} ms from {1e3 * (a - due):+.1f}"
            for a, b, label, who in spans
        )
        if lateness * 1e3 >= args.late_ms:
            print(
                f"  {1e3 * (due - t_start):9.1f} ms {phase[-1] if phase else 'start':10s} late "
                f"{lateness * 1e3:6.1f} ms: {where or '(no traced call)'}"
            )
            if args.calls_ms:
                print(f"      holding: {_holding(due, woke) or '(no long call)'}")
            if args.states:
                print(f"      states: {_states(samples, names, due, woke) or '(none R or D)'}")
            if args.events:
                print(f"      running: {_running(due, woke) or '(no Python ran)'}")
                if args.timeline:
                    _timeline(args.timeline, due, woke, lateness)
        out.append(
            {
                "at_ms": 1e3 * (due - t_start),
                "late_ms": lateness * 1e3,
                "phase": phase[-1] if phase else "start",
                "spans": where,
            }
        )
    # Per phase: the worst wake-up, and the worst one that no worker start overlapped.
    for _, name in marks[:-1]:
        mine = [e for e in out if e["phase"] == name]
        calm = [e for e in mine if "a worker" not in e["spans"]]
        worst = max((e["late_ms"] for e in mine), default=0.0)
        worst_calm = max((e["late_ms"] for e in calm), default=0.0)
        print(f"  {name}: worst {worst:.1f} ms; worst outside worker start-up {worst_calm:.1f} ms")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"loader": args.loader, "device": args.device, "late": out}) + "\n")


if __name__ == "__main__":
    main()
