"""Which call stalled the main thread: runs a loader over big batches for two epochs while a
thread sleeps 1 ms at a time, records when each wake-up came late, and the start and end of
every call a batch passes through in the main process (the functions ``next_profile.py``
times, plus worker start-up, shutdown and the copy to the GPU). Prints every wake-up later than
``--late-ms`` with the calls that overlapped it, the innermost last.

    python benchmarks/stall_trace.py --loader pinpool --device cuda
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing.popen_fork
import threading
import time
from typing import Any

import next_profile
import torch

import pinpool
import pinpool._main.receiver
from pinpool.bench.workloads import make_dataset, move

_SPANS: list[tuple[float, float, str, str]] = []


def _keep_span(label: str, who: str, start: float, end: float) -> None:
    _SPANS.append((start, end, label, who))


def _span(owner: Any, name: str, label: str) -> None:
    next_profile.wrap(owner, name, label, _keep_span)


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
        help="make the loader's arena whole at the first batch (no background preparation)",
    )
    args = ap.parse_args()
    if args.whole_arena:
        made = pinpool._main.receiver.PinPool

        def whole(*a: Any, **kw: Any) -> Any:
            kw["background"] = False
            return made(*a, **kw)

        pinpool._main.receiver.PinPool = whole  # type: ignore[misc]
    dataset = make_dataset("synthetic", args.batches * args.batch_size, tuple(args.shape), "/tmp")
    late: list[tuple[float, float]] = []
    stop = threading.Event()

    def sleeper() -> None:
        while not stop.is_set():
            due = time.perf_counter() + 0.001
            time.sleep(0.001)
            now = time.perf_counter()
            late.append((due, now - due))

    # Spans: every function next_profile times, plus the ones that only run now and then.
    next_profile.instrument(_keep_span)
    _span(multiprocessing.popen_fork.Popen, "_launch", "fork a worker")
    it_cls = torch.utils.data.dataloader._MultiProcessingDataLoaderIter
    _span(it_cls, "_shutdown_workers", "torch shutdown workers")
    _span(it_cls, "__init__", "torch iterator start")
    _span(torch.Tensor, "to", "Tensor.to")
    _span(pinpool._main.receiver.Receiver, "close", "receiver.close")
    _span(gc, "collect", "gc.collect")
    thread = threading.Thread(target=sleeper, daemon=True)
    thread.start()
    time.sleep(0.05)
    marks = []
    t_start = time.perf_counter()
    loader = pinpool.DataLoader(
        dataset,
        batch_size=args.batch_size,
        num_workers=args.workers,
        zero_copy=args.loader == "pinpool-zerocopy",
    )
    for epoch in range(2):
        marks.append((time.perf_counter(), f"epoch {epoch + 1}"))
        for batch in loader:
            if args.device:
                batch = move(batch, torch.device(args.device), True)
            del batch
    marks.append((time.perf_counter(), "del loader"))
    del loader
    marks.append((time.perf_counter(), "end"))
    time.sleep(0.05)
    stop.set()
    thread.join()
    print(
        f"{args.loader}, {args.batches} batches of {args.batch_size} x {args.shape}, 2 epochs"
        f"{', whole arena at once' if args.whole_arena else ''}"
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
        calm = [e for e in mine if "fork a worker" not in e["spans"]]
        worst = max((e["late_ms"] for e in mine), default=0.0)
        worst_calm = max((e["late_ms"] for e in calm), default=0.0)
        print(f"  {name}: worst {worst:.1f} ms; worst outside worker start-up {worst_calm:.1f} ms")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"loader": args.loader, "device": args.device, "late": out}) + "\n")


if __name__ == "__main__":
    main()
