"""Single-thread cost of each step of a device delivery (512 KiB tokens batch), no other
threads: what the pin thread would pay without any GIL contention."""
import sys, time
import numpy as np, torch
import pinpool
from pinpool._main.delivery import Delivery
from pinpool._wire import codec

dev = torch.device("cuda", 0)
pool = pinpool.PinPool(1 << 20, 8, device=0)
batch = torch.arange(8 * 8193, dtype=torch.int64).view(8, 8193)
p = codec.plan(batch)
specs = codec.checked_specs([tuple(s) for s in p.specs], 1 << 20)
need = p.nbytes
d = Delivery(dev)
cs = d.copy_stream
N = 2000

def timeit(name, fn, n=N):
    for _ in range(50): fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    dt = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    print(f"{name:44s} {dt*1e6:8.1f} us", flush=True)

def deliver():
    s = pool.checkout()
    out = d(p.tree, specs, s, need)
    out.wait()
timeit("checkout + Delivery() + wait (whole)", deliver)
slot = pool.checkout()
base = torch.frombuffer(slot, dtype=torch.uint8, count=need)
timeit("checkout + release(cs)", lambda: pool.checkout().release(cs))
timeit("torch.frombuffer(slot)", lambda: torch.frombuffer(slot, dtype=torch.uint8, count=need))
def ctx():
    with torch.cuda.stream(cs): pass
timeit("stream context", ctx)
timeit(".to(dev, non_blocking) 512K", lambda: base.to(dev, non_blocking=True))
small = base[:64]
timeit(".to(dev, non_blocking) 64 B", lambda: small.to(dev, non_blocking=True))
pageable = torch.empty(need, dtype=torch.uint8)
timeit(".to(dev, non_blocking) 512K pageable", lambda: pageable.to(dev, non_blocking=True))
torch_pinned = torch.empty(need, dtype=torch.uint8, pin_memory=True)
timeit(".to(dev, non_blocking) 512K torch-pinned", lambda: torch_pinned.to(dev, non_blocking=True))
timeit("torch.empty(need, device)", lambda: torch.empty(need, dtype=torch.uint8, device=dev))
timeit("Event() + record(cs)", lambda: torch.cuda.Event().record(cs))
st = base.to(dev)
spec = specs[0]
timeit("device_leaf", lambda: codec.device_leaf(st, spec))
timeit("host_leaf", lambda: codec.host_leaf(slot, spec, need))
ev = torch.cuda.Event(); ev.record(cs)
cur = torch.cuda.current_stream(dev)
timeit("wait_event + record_stream", lambda: (cur.wait_event(ev), st.record_stream(cur)))
class CAI:
    __slots__ = ("__cuda_array_interface__", "owner")
    def __init__(self, owner, ptr, shape, typestr):
        self.owner = owner
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr, "version": 2}
ptr = st.data_ptr()
timeit("as_tensor(__cuda_array_interface__)", lambda: torch.as_tensor(CAI(st, ptr, (8, 8193), "<i8"), device=dev))
print("is_pinned(frombuffer slot):", base.is_pinned())
