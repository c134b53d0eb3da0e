"""Runs a module or script with one delivery variant patched in:
python scratch/ab.py VARIANT (-m module | script.py) args...
VARIANT: new (the library as is), old (views by as_strided), perleaf (device: one copy per leaf)."""
import runpy, sys
import numpy as np, torch
from pinpool._main import delivery
from pinpool._wire import codec
from pinpool._native import Slot


def _raw(base, spec):
    return base.as_strided((spec.nbytes,), (1,), base.storage_offset() + spec.offset)


def leaf_from_bytes(base, spec):
    if spec.kind == "numpy":
        ndt = np.dtype(spec.dtype)
        if spec.nbytes == 0:
            return np.empty(spec.shape, dtype=ndt)
        return _raw(base, spec).numpy().view(ndt).reshape(spec.shape)
    dtype = codec.TORCH_DTYPES[spec.dtype]
    if spec.nbytes == 0:
        out = torch.empty(spec.shape, dtype=dtype, device=base.device)
    else:
        out = _raw(base, spec).view(dtype).view(spec.shape)
    return out if spec.subclass is None else out.as_subclass(spec.subclass)


def old_call(self, tree, specs, memory, need):
    self.batches += 1
    self.bytes += need
    if memory is None:
        empty = torch.empty(0, dtype=torch.uint8)
        return codec.rebuild(tree, [leaf_from_bytes(empty, s) for s in specs], self.kept)
    if isinstance(memory, Slot):
        slot = memory
        base = torch.frombuffer(memory, dtype=torch.uint8, count=need)
    else:
        slot, base = None, memory
    if self.device is None:
        del slot, memory
        return codec.rebuild(tree, [leaf_from_bytes(base, s) for s in specs], self.kept)
    with torch.cuda.stream(self.copy_stream):
        storage = base.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.copy_stream)
    views = []
    for s in specs:
        if s.kind == "numpy":
            views.append(leaf_from_bytes(base, s).copy())
        else:
            views.append(leaf_from_bytes(storage, s))
    if slot is not None:
        slot.release(self.copy_stream)
    return delivery.OnDevice(codec.rebuild(tree, views, self.kept), storage, event, self.device)


class OnDeviceLeaves(delivery.OnDevice):
    __slots__ = ()

    def wait(self):
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.event)
        for t in self.storage:
            t.record_stream(stream)
        return self.batch


new_call = delivery.Delivery.__call__


def perleaf_call(self, tree, specs, memory, need):
    if self.device is None or memory is None:
        return new_call(self, tree, specs, memory, need)
    self.batches += 1
    self.bytes += need
    host = memory if isinstance(memory, Slot) else memory.numpy()
    views, stored = [], []
    with torch.cuda.stream(self.copy_stream):
        for s in specs:
            leaf = codec.host_leaf(host, s, need)
            if s.kind == "numpy":
                views.append(leaf.copy())
            else:
                leaf = leaf.to(self.device, non_blocking=True)
                views.append(leaf)
                stored.append(leaf)
        event = torch.cuda.Event()
        event.record(self.copy_stream)
    del host
    if isinstance(memory, Slot):
        memory.release(self.copy_stream)
    return OnDeviceLeaves(codec.rebuild(tree, views, self.kept), stored, event, self.device)


variant = sys.argv[1]
if variant == "old":
    delivery.Delivery.__call__ = old_call
elif variant == "perleaf":
    delivery.Delivery.__call__ = perleaf_call
else:
    assert variant == "new", variant
print(f"[delivery variant: {variant}]", flush=True)
if sys.argv[2] == "-m":
    sys.argv = [sys.argv[3]] + sys.argv[4:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
