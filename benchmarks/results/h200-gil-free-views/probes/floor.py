"""Floor of torch's DataLoader machinery: tiny batches, 4 workers."""
import sys, time, torch
from torch.utils.data import DataLoader, Dataset
import pinpool
from pinpool.bench.workloads import make_dataset

class Tiny(Dataset):
    def __len__(self): return 1 << 30
    def __getitem__(self, i): return torch.zeros(1)

def run(name, loader, steps):
    it = iter(loader)
    for _ in range(200): next(it)
    t = time.perf_counter()
    for _ in range(steps): next(it)
    dt = (time.perf_counter() - t) / steps
    print(f"{name:40s} {dt*1e6:8.1f} us/batch", flush=True)
    del it

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
dev = "cuda" if torch.cuda.is_available() else None
kw = dict(batch_size=8, num_workers=4, prefetch_factor=4)
class Ints(Tiny):
    def __getitem__(self, i): return i
def ident(x): return x
run("torch ints identity-collate (floor)", DataLoader(Ints(), collate_fn=ident, **kw), steps)
run("torch tiny nopin", DataLoader(Tiny(), **kw), steps)
if dev: run("torch tiny pin", DataLoader(Tiny(), pin_memory=True, **kw), steps)
run("pinpool tiny cpu", pinpool.DataLoader(Tiny(), **kw), steps)
if dev: run("pinpool tiny cuda", pinpool.DataLoader(Tiny(), device=dev, **kw), steps)
