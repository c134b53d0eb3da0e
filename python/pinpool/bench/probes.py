"""Sleepers that time how late they wake: what a stall of the loader's process (a thread
keeping the GIL, the address-space lock) or of the whole machine (every CPU taken) looks like
from outside the loader (``measure``'s ``probe_*`` and ``outside_*`` figures).

Invariants: a probe only records (when each wake-up was due, how late it came); every figure
is read afterwards, for any stretch of time (:meth:`Lateness.late_ms`); stopping a probe
that never started, or twice, does nothing.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from types import TracebackType

import numpy as np


class Lateness:
    """A sleeper's record: when each wake-up was due (``perf_counter`` seconds, the system's
    monotonic clock, the same in every process) and how late it came, so the lateness within
    any stretch of time can be read afterwards: :meth:`late_ms`."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.due: list[float] = []  # when each wake-up was due
        self.lateness: list[float] = []  # how late it came, in seconds

    def late_ms(self, start: float, end: float) -> np.ndarray:
        """How long each wake-up was held up within ``[start, end)``, in ms: its lateness (the
        stretch from when it was due to when it woke) clipped to that span, for every wake-up
        whose lateness overlaps it. A stall that runs across a boundary is split there: a
        ``gc.collect()`` right after a short ``del`` is charged to the collect."""
        n = min(len(self.due), len(self.lateness))
        due = np.asarray(self.due[:n])
        woke = due + np.asarray(self.lateness[:n])
        inside = ((due >= start) & (due < end)) | ((due < start) & (woke > start))
        held = np.minimum(woke[inside], end) - np.maximum(due[inside], start)
        return np.maximum(held, 0.0) * 1e3


class StallProbe(Lateness):
    """A thread of the loader's process that sleeps ``interval`` seconds in a loop and records
    how late it wakes: held up while another thread keeps the GIL, while the process waits
    (its address-space lock), or while every CPU is taken."""

    def __init__(self, interval: float = 0.001) -> None:
        super().__init__(interval)
        self._final_cpu: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-probe", daemon=True)

    def _loop(self) -> None:
        clock, sleep, interval = time.perf_counter, time.sleep, self.interval
        due, late = self.due, self.lateness
        while not self._stop.is_set():
            t = clock()
            sleep(interval)
            woke = clock()
            due.append(t + interval)
            late.append(woke - t - interval)
        self._final_cpu = time.thread_time()

    def start(self) -> StallProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the thread (a no-op if it was never started or has stopped)."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()

    def cpu_s(self) -> float:
        """The probe thread's CPU time so far (it may be read from another thread)."""
        if self._final_cpu is not None:
            return self._final_cpu
        ident = self._thread.ident
        if ident is None:
            return 0.0
        return time.clock_gettime(time.pthread_getcpuclockid(ident))

    def __enter__(self) -> StallProbe:
        return self.start()

    def __exit__(self, *_exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()


#: The outside probe's process: the same sleeper loop, until a line comes on its stdin (or it
#: closes); then the due times and the lateness, as two arrays of doubles, on stdout. (Not
#: the pipe's end alone: DataLoader workers forked meanwhile hold a copy of its write end,
#: and a worker still alive, say after a loader failed, would keep it open.)
_OUTSIDE_SLEEPER = """
import array, sys, threading, time
interval = float(sys.argv[1])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
due, late = array.array("d"), array.array("d")
clock, sleep = time.perf_counter, time.sleep
print("ready", flush=True)
while not stop.is_set():
    t = clock()
    sleep(interval)
    woke = clock()
    due.append(t + interval)
    late.append(woke - t - interval)
sys.stdout.buffer.write(due.tobytes() + late.tobytes())
"""


class OutsideProbe(Lateness):
    """The same sleeper in a process of its own, which shares nothing with the loader's
    process but the machine's CPUs (no GIL, no address space). Late at the same moments as
    :class:`StallProbe`, it shows the machine was busy (every core taken, a wake-up waits for
    the scheduler) rather than the loader's process held up."""

    def __init__(self, interval: float = 0.001) -> None:
        super().__init__(interval)
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OutsideProbe:
        cmd = [sys.executable, "-I", "-S", "-c", _OUTSIDE_SLEEPER, repr(self.interval)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self._proc.stdout is not None
        if self._proc.stdout.readline() != b"ready\n":
            self.stop()
            raise RuntimeError("the outside probe's process did not start")
        return self

    def stop(self) -> None:
        """Stops the process and reads its record (a no-op once stopped)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        out, _ = proc.communicate(b"stop\n", timeout=60)
        values = np.frombuffer(out[: len(out) // 16 * 16], dtype=np.float64)
        half = len(values) // 2
        self.due, self.lateness = values[:half].tolist(), values[half:].tolist()
