"""The pool's own numbers, side by side with torch's in the same run.

- arena start-up: a ``PinPool`` of ``--arena-gib`` per backend, against torch's pinned
  ``empty`` of the same size (``cudaHostAlloc`` through torch's caching host allocator);
- the Python round trip ``checkout()`` + ``release()`` (p50 / p99), against torch's cached
  pinned ``empty`` of one slot's size (a cache hit after the first call);
- H2D bandwidth from a slot, from a torch pinned tensor and from pageable memory.

Without CUDA only the round trip (host backend) is measured. Prints a table, writes JSON.

    python benchmarks/pool_bench.py --out /tmp/pinpool-bench/pool.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch

import pinpool


def _quantiles(samples_ns: list[int]) -> dict[str, float]:
    s = sorted(samples_ns)
    return {
        "p50_us": s[len(s) // 2] / 1e3,
        "p99_us": s[int(len(s) * 0.99)] / 1e3,
        "mean_us": statistics.fmean(s) / 1e3,
    }


def round_trip(pool: pinpool.PinPool, n: int, stream: Any) -> dict[str, float]:
    """checkout() + release() from Python, one sample per pair."""
    samples = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        slot = pool.checkout()
        slot.release(stream)
        samples.append(clock() - t0)
    return _quantiles(samples)


def torch_cached_empty(nbytes: int, n: int) -> dict[str, float]:
    """torch.empty(pin_memory=True) + drop, after a first call filled the cache."""
    torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    samples = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        del t
        samples.append(clock() - t0)
    return _quantiles(samples)


def startup(nbytes: int, slot_bytes: int, rounds: int = 2) -> dict[str, Any]:
    """Seconds until an arena of ``nbytes`` is usable, per backend and for torch's pinned
    empty, alternating, ``rounds`` times (the first round also pays for the machine's first
    touch of that much memory). Keeps each pool's own breakdown (``pool.startup``)."""
    out: dict[str, Any] = {"rounds": []}
    for _ in range(rounds):
        row: dict[str, Any] = {}
        for backend in ("cuda-register", "cuda-hostalloc"):
            t0 = time.perf_counter()
            pool = pinpool.PinPool(slot_bytes, nbytes // slot_bytes, device=0, backend=backend)
            row[backend] = time.perf_counter() - t0
            row[f"{backend} steps"] = dict(pool.startup)
            pool.close()
            del pool
        t0 = time.perf_counter()
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        row["torch pinned empty"] = time.perf_counter() - t0
        del t
        torch.cuda.synchronize()
        torch._C._host_emptyCache() if hasattr(torch._C, "_host_emptyCache") else None
        out["rounds"].append(row)
    out["best"] = {
        k: min(r[k] for r in out["rounds"])
        for k in ("cuda-register", "cuda-hostalloc", "torch pinned empty")
    }
    return out


def h2d(nbytes: int, repeats: int = 10) -> dict[str, float]:
    """GB/s of a non_blocking H2D copy of ``nbytes`` from each kind of host memory."""
    pool = pinpool.PinPool(nbytes, 1, device=0)
    slot = pool.checkout()
    sources = {
        "pinpool slot": torch.frombuffer(slot, dtype=torch.uint8, count=nbytes),
        "torch pinned": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
        "pageable": torch.empty(nbytes, dtype=torch.uint8),
    }
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, src in sources.items():
        src.fill_(1)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        out[name] = nbytes * repeats / (start.elapsed_time(end) / 1e3) / 1e9
    del sources
    slot.release()
    pool.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arena-gib", type=float, default=4.0)
    ap.add_argument("--slot-mib", type=int, default=64)
    ap.add_argument("--round-trips", type=int, default=200_000)
    ap.add_argument("--h2d-mib", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and pinpool.cuda_available()
    slot_bytes = args.slot_mib << 20
    result: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "torch": torch.__version__,
        "cuda": cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
    }
    rows = []
    if cuda:
        torch.cuda.init()
        nbytes = int(args.arena_gib * (1 << 30)) // slot_bytes * slot_bytes
        result["startup_seconds"] = startup(nbytes, slot_bytes)
        for i, row in enumerate(result["startup_seconds"]["rounds"]):
            for name in ("cuda-register", "cuda-hostalloc", "torch pinned empty"):
                label = f"{args.arena_gib:g} GiB ready, round {i + 1}: {name}"
                steps = row.get(f"{name} steps")
                detail = (
                    ""
                    if not steps
                    else "  (" + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in steps.items()) + ")"
                )
                rows.append((label, f"{row[name] * 1e3:9.1f} ms{detail}"))
        result["h2d_gbps"] = h2d(args.h2d_mib << 20)
        for name, gbps in result["h2d_gbps"].items():
            rows.append((f"H2D {args.h2d_mib} MiB from {name}", f"{gbps:9.1f} GB/s"))

    pool = pinpool.PinPool(slot_bytes, 4, device=0 if cuda else "cpu")
    result["backend"] = pool.backend
    trips: dict[str, Any] = {}
    trips["checkout+release, default stream"] = round_trip(pool, args.round_trips, None)
    if cuda:
        raw = torch.cuda.current_stream().cuda_stream
        trips["checkout+release, stream given"] = round_trip(pool, args.round_trips, raw)
        trips["torch pinned empty (cached)"] = torch_cached_empty(slot_bytes, args.round_trips)
    pool.close()
    result["round_trip"] = trips
    for name, q in trips.items():
        rows.append((f"{name}", f"p50 {q['p50_us']:6.2f} us  p99 {q['p99_us']:6.2f} us"))

    width = max(len(r[0]) for r in rows)
    print(f"pinpool pool benchmark ({result['gpu'] or 'no GPU: host backend only'})")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
