"""Does unmapping shared memory on another thread hold up the threads of the process?

Maps a memfd of ``--mib`` MiB, faults it in, then unmaps it from a thread that does not hold
the GIL (a ctypes call), whole or in chunks, while two Python threads run: one sleeps 1 ms at a
time (as the bench's stall probe does), one maps and unmaps a page in a loop (as freeing a
semaphore or allocating a large buffer does; C code that does it while holding the GIL stops
every Python thread for as long). Prints the unmap's time, the sleeper's worst lateness and the
slowest page map during it, beside a quiet stretch of the same length. Repeats ``--repeats``
times per chunk size.

    python3 benchmarks/unmap_probe.py [--mib 1024] [--chunks-mib 0 64 8] [--out F]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import threading
import time
from collections.abc import Callable

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]  # fmt: skip
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PROT_RW, MAP_SHARED, MADV_POPULATE_WRITE = 3, 1, 23


class Timed:
    """A thread that runs ``step`` in a loop (``pause`` seconds apart) and records when each
    run started and how long it took."""

    def __init__(self, step: Callable[[], None], pause: float = 0.0) -> None:
        self.step, self.pause = step, pause
        self.times: list[tuple[float, float]] = []  # (start, seconds)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            self.step()
            self.times.append((t, time.perf_counter() - t))
            if self.pause:
                time.sleep(self.pause)

    def worst_ms(self, start: float, end: float, expected: float = 0.0) -> float:
        """The longest run that started within ``[start, end)``, less ``expected``, in ms."""
        return 1e3 * max((d - expected for t, d in self.times if start <= t < end), default=0.0)


def sleep_1ms() -> None:
    """The bench's stall probe: late wake-ups are time the process's threads could not run."""
    time.sleep(0.001)


def map_a_page() -> None:
    """What freeing a semaphore or allocating a large buffer does: its slowest round is how
    long any ``mmap``/``munmap`` elsewhere in the process can be held up."""
    m = mmap.mmap(-1, 4096)
    m[0] = 1
    m.close()


def mapped(nbytes: int) -> tuple[int, int]:
    fd = os.memfd_create("pinpool-unmap-probe")
    os.ftruncate(fd, nbytes)
    addr = _libc.mmap(None, nbytes, PROT_RW, MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    _libc.madvise(addr, nbytes, MADV_POPULATE_WRITE)
    return fd, addr


def unmap(addr: int, nbytes: int, chunk: int) -> None:
    if chunk <= 0:
        _libc.munmap(addr, nbytes)
        return
    end = nbytes
    while end > 0:  # from the end: each call trims the mapping, no split
        start = max(0, end - chunk)
        _libc.munmap(addr + start, end - start)
        end = start


def how(chunk_mib: int) -> str:
    if chunk_mib < 0:
        return "pinpool arena"
    return "whole" if not chunk_mib else f"{chunk_mib} MiB chunks"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--chunks-mib", type=int, nargs="+", default=[0, 64, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--pinpool",
        action="store_true",
        help="instead, free a pinpool arena of --mib MiB (host memory without CUDA, else the "
        "pool's default on the current device): close() then wait_for_freed_pools(); the chunk "
        "size is pinpool's own",
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    nbytes = args.mib << 20
    sleeper = Timed(sleep_1ms)
    mapper = Timed(map_a_page, pause=0.0002)
    rows = []
    for chunk_mib in [-1] if args.pinpool else args.chunks_mib:
        for _ in range(args.repeats):
            if args.pinpool:
                import pinpool

                pool = pinpool.PinPool(64 << 20, max(1, args.mib // 64))
                time.sleep(0.05)
                t0 = time.perf_counter()
                pool.close()
                pinpool.wait_for_freed_pools()
                t1 = time.perf_counter()
            else:
                fd, addr = mapped(nbytes)
                time.sleep(0.05)
                t0 = time.perf_counter()
                worker = threading.Thread(target=unmap, args=(addr, nbytes, chunk_mib << 20))
                worker.start()
                worker.join()
                t1 = time.perf_counter()
                os.close(fd)
            time.sleep(max(0.05, t1 - t0))
            t2 = time.perf_counter()
            time.sleep(t1 - t0)
            t3 = time.perf_counter()
            row = {
                "chunk_mib": chunk_mib,
                "unmap_ms": 1e3 * (t1 - t0),
                "worst_late_ms": sleeper.worst_ms(t0, t1, 0.001),
                "quiet_worst_late_ms": sleeper.worst_ms(t2, t3, 0.001),
                "mmap_worst_ms": mapper.worst_ms(t0, t1),
                "quiet_mmap_worst_ms": mapper.worst_ms(t2, t3),
            }
            rows.append(row)
            print(
                f"{args.mib} MiB, {how(chunk_mib):14s}"
                f" unmap {row['unmap_ms']:7.1f} ms, sleeper worst late {row['worst_late_ms']:5.2f}"
                f" ms (quiet: {row['quiet_worst_late_ms']:.2f}); a page mmap+munmap meanwhile, "
                f"worst {row['mmap_worst_ms']:.2f} ms (quiet: {row['quiet_mmap_worst_ms']:.2f})",
                flush=True,
            )
    sleeper.stop.set()
    mapper.stop.set()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
