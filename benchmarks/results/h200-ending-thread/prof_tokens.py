"""Main-process profile of the tokens workload, copy mode against zero-copy (H200)."""

import cProfile
import io
import pstats
import time

import torch

import pinpool
from pinpool.bench.workloads import make_dataset

N = 2000
for i, zc in enumerate((False, True, False, True)):
    ds = make_dataset("tokens", 8 * N, (8193,), "/tmp")
    dl = pinpool.DataLoader(ds, batch_size=8, num_workers=4, zero_copy=zc, persistent_workers=True)
    for b in dl:
        b.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for b in dl:
        b.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    plain = (time.perf_counter() - t) / N * 1e6
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    for b in dl:
        b.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    pr.disable()
    prof = (time.perf_counter() - t) / N * 1e6
    made = dl.stats()["zero_copy_batches"]
    print(f"== zero_copy={zc}: {plain:.0f} us/batch ({prof:.0f} profiled); stats {made} zero-copy")
    if i < 2:
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
        print("\n".join(line[:130] for line in s.getvalue().splitlines()[6:32]))
    del dl
