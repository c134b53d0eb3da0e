"""Copy bandwidth from a worker-style segment into a slot, by thread count.

Runs in two child processes, with ``PINPOOL_STREAMING_COPY=1`` (non-temporal stores, the
default) and ``=0`` (plain ``memcpy``), and prints GB/s for each thread count.

    python benchmarks/copy_bench.py [--mib 38] [--threads 1 2 4 8 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def measure(mib: int, threads: list[int], repeats: int) -> dict[int, float]:
    import pinpool
    from pinpool._native import WorkerSegment

    nbytes = mib << 20
    seg = WorkerSegment(nbytes)
    memoryview(seg)[:nbytes] = bytes(range(256)) * (nbytes // 256)
    out = {}
    for n in threads:
        # (The pinned memory of CUDA's device 0 where there is one; locked host memory else.)
        device = 0 if pinpool.cuda_available() else "cpu"
        pool = pinpool.PinPool(nbytes, 2, device=device, copy_threads=n)
        cache = pinpool._native.SegmentCache(pool)
        cache.insert((1, 1), os.dup(seg.fd), seg.total_len, seg.nonce)
        with pool.checkout() as slot:
            cache.copy((1, 1), slot, [(0, 0, nbytes)])
            t0 = time.perf_counter()
            for _ in range(repeats):
                cache.copy((1, 1), slot, [(0, 0, nbytes)])
            out[n] = nbytes * repeats / (time.perf_counter() - t0) / 1e9
        del cache
        pool.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=38)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.mib, args.threads, args.repeats)))
        return 0
    results = {}
    for streaming in ("1", "0"):
        env = dict(os.environ, PINPOOL_STREAMING_COPY=streaming)
        cmd = [sys.executable, __file__, "--child", "--mib", str(args.mib), "--repeats"]
        cmd += [str(args.repeats), "--threads", *map(str, args.threads)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        results["streaming" if streaming == "1" else "memcpy"] = json.loads(proc.stdout)
    print(f"copy {args.mib} MiB segment -> slot, GB/s")
    print("threads  " + "  ".join(f"{n:>6}" for n in args.threads))
    for name, row in results.items():
        print(f"{name:<9}" + "  ".join(f"{row[str(n)]:6.1f}" for n in args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
