"""How fast can fresh shared memory be faulted in: one memfd or several, by thread count.

Informs how the arena is populated at start-up (`src/memory/arena/`). Prints GB/s.

    python benchmarks/arena_populate.py [--gib 4] [--threads 16] [--files 1 4 16]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import threading
import time

MADV_POPULATE_WRITE = 23
MADV_HUGEPAGE = 14


def populate(total: int, threads: int, files: int, huge: bool) -> float:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    per_file = total // files
    maps = []
    for _ in range(files):
        fd = os.memfd_create("populate-bench")
        os.ftruncate(fd, per_file)
        maps.append(mmap.mmap(fd, per_file, mmap.MAP_SHARED))
        os.close(fd)
    bases = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in maps]
    if huge:
        for b in bases:
            libc.madvise(b, per_file, MADV_HUGEPAGE)
    per_thread = max(1, threads // files)
    chunk = per_file // per_thread
    work = [(b + i * chunk, chunk) for b in bases for i in range(per_thread)]
    errors: list[int] = []

    def run(addr: int, n: int) -> None:
        if libc.madvise(addr, n, MADV_POPULATE_WRITE) != 0:
            errors.append(ctypes.get_errno())

    t0 = time.perf_counter()
    pool = [threading.Thread(target=run, args=w) for w in work]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise OSError(errors[0], "madvise(MADV_POPULATE_WRITE)")
    del bases
    for m in maps:
        m.close()
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--files", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    total = int(args.gib * (1 << 30))
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read().strip()
    except OSError:
        thp = "unknown"
    print(f"populate {args.gib:g} GiB with {args.threads} threads (shmem THP: {thp})")
    for r in range(args.rounds):
        for files in args.files:
            for huge in (False, True):
                s = populate(total, args.threads, files, huge)
                print(
                    f"  round {r + 1}: {files:3d} memfd(s), hugepage hint {huge!s:5}: "
                    f"{s * 1e3:7.0f} ms = {total / s / 1e9:5.1f} GB/s",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
