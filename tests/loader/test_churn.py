"""Loaders made, run and dropped in a loop (an evaluation loader per epoch, a sweep, a test
suite) give their memory back as fast as they are made, even with every core busy: the
process's resident memory grows by at most two arenas and its threads by a fixed few, and each
loader takes the arena of the one dropped before it rather than make its own.

Each loop runs in a process of its own (its memory and threads are measured), beside processes
that keep every core busy (the freeing thread, at idle priority, gets little of them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_LOOP = textwrap.dedent(
    """
    import json, os, sys, time
    import torch, pinpool
    from pinpool._main.epochs import ending_thread

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def threads():
        return len(os.listdir("/proc/self/task"))

    cycles, workers, zero_copy = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    ds = torch.utils.data.TensorDataset(torch.randn(24, 8), torch.arange(24))
    kw = dict(batch_size=4, num_workers=workers, zero_copy=zero_copy)
    if workers:
        kw["multiprocessing_context"] = "fork"
    # One loader first: what it leaves alive (the arena it keeps for the next, its threads)
    # is the baseline.
    loader = pinpool.DataLoader(ds, **kw)
    for batch in loader:
        pass
    arena = loader.pool.arena_bytes
    del loader, batch
    ending_thread.wait_all(30)
    base_rss, base_threads = rss(), threads()
    peak_rss, peak_threads = base_rss, base_threads
    t0 = time.perf_counter()
    kept = 0
    for _ in range(cycles):
        loader = pinpool.DataLoader(ds, **kw)
        for batch in loader:
            pass
        kept += "kept from a pool dropped before" in loader.pool.startup
        del loader, batch
        peak_rss, peak_threads = max(peak_rss, rss()), max(peak_threads, threads())
    took = (time.perf_counter() - t0) / cycles
    print(json.dumps({
        "arena": arena, "rss_growth": peak_rss - base_rss,
        "thread_growth": peak_threads - base_threads, "ms_per_loader": took * 1e3,
        "kept": kept,
    }))
    """
)


def _busy(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` processes that spin on a core each until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.mark.parametrize(
    ("cycles", "workers", "zero_copy"),
    [(100, 0, False), (12, 2, False), (12, 2, True)],
    ids=["no-workers", "copy-2-workers", "zero-copy-2-workers"],
)
def test_loaders_made_in_a_loop_beside_busy_cores_stay_bounded(
    cycles: int, workers: int, zero_copy: bool
) -> None:
    hogs = _busy(os.cpu_count() or 2)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _LOOP, str(cycles), str(workers), str(int(zero_copy))],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # Two arenas at most (one being made while the last one's comes back), and the slack of a
    # Python process's own heap.
    assert got["rss_growth"] <= 2 * got["arena"] + (32 << 20), got
    assert got["thread_growth"] <= 12, got
    # Loaders take the arena of the one before (the cost of a loader: `python -m pinpool.bench
    # --modes churn`); not every one: a pool whose arena is still being made ready is let go
    # by its prepare thread only at the end of a step (`PREPARE_STEP`), and the next pool
    # waits for that at most 10 ms, which a thread at idle priority beside busy cores (and the
    # rest of the suite) can outlast.
    assert got["kept"] >= cycles // 2, got
