"""Tokens (8 x 8193 int64), 4 persistent workers, device batches, copy mode or zero-copy: a warm
epoch, then two timed ones; run under ``py-spy record --gil`` to see where the main process's
threads hold the GIL per batch. ``python3 tokspy.py copy|zc``"""

import os
import sys
import time

import pinpool
from pinpool.bench.workloads import make_dataset

zc = sys.argv[1] == "zc"
ds = make_dataset("tokens", 8 * 3000, (8193,), "/tmp")
loader = pinpool.DataLoader(
    ds, batch_size=8, num_workers=4, device="cuda", zero_copy=zc, persistent_workers=True
)
for _ in loader:
    pass
print("ready", os.getpid(), flush=True)
t = time.perf_counter()
n = 0
for _ in range(2):
    for _b in loader:
        n += 1
print("zc" if zc else "copy", f"{(time.perf_counter() - t) / n * 1e6:.0f} us/batch", flush=True)
