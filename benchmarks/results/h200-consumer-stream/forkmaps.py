"""Which mappings a pinpool loader leaves in the main process, and the fork time with them."""

import collections
import gc
import os
import statistics
import time

import torch
from torch.utils.data import TensorDataset

import pinpool


def maps():
    out = []
    for line in open("/proc/self/maps"):
        p = line.split()
        lo, hi = (int(x, 16) for x in p[0].split("-"))
        out.append((p[0], p[1], p[5] if len(p) > 5 else "", hi - lo))
    return out


def fork_ms(n=21):
    t = []
    for _ in range(n):
        s = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        t.append((time.perf_counter() - s) * 1e3)
        os.waitpid(pid, 0)
    return statistics.median(t), min(t)


def threads():
    return collections.Counter(
        open(f"/proc/self/task/{x}/comm").read().strip() for x in os.listdir("/proc/self/task")
    )


def diff(a, b, label):
    sa = set(a)
    new = [m for m in b if m not in sa]
    c = collections.Counter()
    for _, perm, name, size in new:
        kind = name if name else ("guard" if perm == "---p" else f"anon {perm}")
        if kind.startswith("anon") and size in (
            8 << 20,
            (8 << 20) + 4096,
            2 << 20,
            (2 << 20) + 4096,
        ):
            kind += f" {size >> 20} MiB (a thread stack?)"
        c[kind] += 1
    print(f"{label}: {len(new)} new mappings, {len(a)} -> {len(b)}")
    for k, v in c.most_common(12):
        print(f"   {v:3d}  {k}")


x = torch.ones(256, 256, device="cuda")
(x @ x).sum().item()
ds = TensorDataset(torch.zeros(512, 3 * 224 * 224, dtype=torch.uint8))
m0 = maps()
f0 = fork_ms()
t0 = threads()
loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=4, pin_memory=True)
for _ in range(2):
    for b in loader:
        b[0].to("cuda", non_blocking=True)
del loader, b
gc.collect()
time.sleep(0.5)
m1 = maps()
f1 = fork_ms()
t1 = threads()
loader = pinpool.DataLoader(ds, batch_size=32, num_workers=4, device="cuda")
for _ in range(2):
    for b in loader:
        del b
pool = loader.pool
m2a = maps()
f2a = fork_ms()
t2a = threads()
del loader, pool
gc.collect()
pinpool.wait_for_freed_pools()
time.sleep(0.5)
m2 = maps()
f2 = fork_ms()
t2 = threads()
print(
    f"fork ms (median, min): CUDA up {f0[0]:.2f} {f0[1]:.2f}"
    f" | after torch pinned loader {f1[0]:.2f} {f1[1]:.2f}"
    f" | pinpool loader alive {f2a[0]:.2f} {f2a[1]:.2f}"
    f" | after it was freed {f2[0]:.2f} {f2[1]:.2f}"
)
diff(m0, m1, "torch pinned loader, 2 epochs")
diff(m1, m2a, "pinpool device loader alive, 2 epochs")
diff(m1, m2, "after the pinpool loader was freed")
print(
    "threads:",
    dict(t0),
    "| after torch:",
    dict(t1),
    "| pinpool alive:",
    dict(t2a),
    "| freed:",
    dict(t2),
)
