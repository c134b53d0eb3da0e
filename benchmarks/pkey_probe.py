"""What a zero-copy worker's protection between batches costs with ``mprotect`` and with memory
protection keys, on this machine (no pinpool needed).

A worker keeps a window (a shared mapping of an arena memfd, faulted in) and makes it
writable only while it writes a batch. With ``mprotect`` that changes every page's entry twice
a batch; with a protection key the pages keep their protection and key, and the thread
switches its own access with one ``WRPKRU`` (glibc's ``pkey_set``). This prints, per size:
the time of ``mprotect`` there and back, of ``pkey_set`` there and back, whether a write
with access switched off kills the writer (SIGSEGV, in a child), and whether another thread
of the process is kept out while the opener has access (one started before the key
was made, and one started while the opener had access, which inherits it).

    python3 benchmarks/pkey_probe.py [--mib 0.5 38.5 268] [--rounds 20]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import threading
import time

PROT_NONE, PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
PKEY_DISABLE_ACCESS = 1

libc = ctypes.CDLL(None, use_errno=True)
for name in ("pkey_alloc", "pkey_set", "pkey_mprotect", "pkey_free"):
    getattr(libc, name).restype = ctypes.c_int
libc.mprotect.restype = ctypes.c_int
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.pkey_mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]


def flags() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return " ".join(f for f in ("pku", "ospke") if f in have) or "none"
    return "?"


def window(nbytes: int) -> tuple[mmap.mmap, int]:
    fd = os.memfd_create("pkey-probe")
    os.ftruncate(fd, nbytes)
    m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, PROT_RW)
    os.close(fd)
    m.write(b"\1" * 0)
    for at in range(0, nbytes, mmap.PAGESIZE):  # (faulted in, as a kept window is)
        m[at] = 1
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    return m, addr


def timed(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def write_kills_in_child(addr: int) -> str:
    pid = os.fork()
    if pid == 0:
        libc.pkey_set(KEY, PKEY_DISABLE_ACCESS)
        ctypes.memset(addr, 7, 1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return "SIGSEGV" if os.WIFSIGNALED(status) and os.WTERMSIG(status) == 11 else f"{status}"


class Writer(threading.Thread):
    """A thread that, when asked, writes one byte at an address in a child it forks (a fault
    kills only the child) and says whether the write went through."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.asked: list[int] = []
        self.go = threading.Event()
        self.done = threading.Event()
        self.result = ""
        self.start()

    def run(self) -> None:
        while True:
            self.go.wait()
            self.go.clear()
            addr = self.asked.pop()
            pid = os.fork()
            if pid == 0:
                ctypes.memset(addr, 9, 1)
                os._exit(0)
            s = os.waitpid(pid, 0)[1]
            self.result = "kept out" if os.WIFSIGNALED(s) and os.WTERMSIG(s) == 11 else "wrote"
            self.done.set()

    def write(self, addr: int) -> str:
        self.done.clear()
        self.asked.append(addr)
        self.go.set()
        self.done.wait()
        return self.result


def main() -> None:
    global KEY
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, nargs="+", default=[0.5, 38.5, 268.0])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    print(f"cpu flags: {flags()}; kernel {os.uname().release}")
    before = Writer()  # (started before the key exists)
    KEY = libc.pkey_alloc(0, PKEY_DISABLE_ACCESS)
    if KEY < 0:
        print(f"pkey_alloc failed: errno {ctypes.get_errno()}")
    print(f"key {KEY}")
    rows = []
    for mib in args.mib:
        nbytes = int(mib * (1 << 20)) // mmap.PAGESIZE * mmap.PAGESIZE
        m, addr = window(nbytes)
        # mprotect there and back
        mp = timed(
            lambda a=addr, n=nbytes: (libc.mprotect(a, n, PROT_RW), libc.mprotect(a, n, PROT_NONE)),
            args.rounds,
        )
        row = [f"{mib:g} MiB", f"mprotect open+close {mp:.3f} ms"]
        if KEY >= 0:
            assert libc.pkey_mprotect(addr, nbytes, PROT_RW, KEY) == 0, ctypes.get_errno()
            pk = timed(
                lambda: (libc.pkey_set(KEY, 0), libc.pkey_set(KEY, PKEY_DISABLE_ACCESS)),
                args.rounds * 50,
            )
            libc.pkey_set(KEY, 0)
            ctypes.memset(addr, 3, nbytes)  # (the opener writes)
            kept = before.write(addr)
            later = Writer().write(addr)  # (started while the opener has access)
            libc.pkey_set(KEY, PKEY_DISABLE_ACCESS)
            row += [
                f"pkey_set open+close {pk * 1e3:.2f} us",
                f"write while switched off: {write_kills_in_child(addr)}",
                f"while open, a thread started before: {kept}, one started then: {later}",
            ]
        rows.append(row)
        del m
    for row in rows:
        print(" | ".join(row))


KEY = -1

if __name__ == "__main__":
    main()
