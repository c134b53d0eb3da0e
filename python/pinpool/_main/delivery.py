"""The last step of a batch's trip: its bytes become the batch, as CPU views or on the device.

:class:`Delivery` rebuilds a batch from its marked tree and checked leaf specs over the memory
it landed in (a slot, or an ordinary buffer when it overflowed). Without a device the batch is
views into that memory: a slot returns to its pool when the last view dies, fenced on torch's
current stream then. With a CUDA device, the memory is copied to it on the loader's own copy
stream, the slot is released behind that copy (fenced on the copy stream), and the batch is
wrapped in :class:`OnDevice`, whose ``wait()`` (on the consumer's thread) makes the
consumer's current stream wait for the copy.

Invariant: a slot is referenced only by the views made here (CPU) or by nothing once released
behind the copy (device); numpy leaves cannot live on a GPU, so they are host copies there.
"""

from __future__ import annotations

from typing import Any

import torch

from .._native import Slot
from .._wire import codec
from .._wire.handle import BatchHandle


class OnDevice:
    """A batch already copied to the GPU on the copy stream; ``wait()`` hands it over to the
    consumer's current stream."""

    __slots__ = ("batch", "device", "event", "storage")

    def __init__(self, batch: Any, storage: torch.Tensor, event: Any, device: torch.device):
        self.batch = batch
        self.storage = storage
        self.event = event
        self.device = device

    def wait(self) -> Any:
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.event)
        # The device memory was allocated on the copy stream: tell the caching allocator it is
        # used on the consumer's stream too, so it is not reused before that work is done.
        self.storage.record_stream(stream)
        return self.batch


class Local:
    """A batch collated in the main process (``num_workers=0``), already delivered."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def pin_memory(self) -> Any:
        return self.batch


class Delivery:
    """Rebuilds batches over their memory, on the CPU or on ``device``; counts them."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device) if device is not None else None
        self.batches = 0
        self.bytes = 0

    def __call__(
        self,
        tree: Any,
        specs: list[codec.LeafSpec],
        memory: Slot | torch.Tensor | None,
        need: int,
    ) -> Any:
        """The batch of ``tree`` over the first ``need`` bytes of ``memory`` (None when every
        leaf is empty)."""
        self.batches += 1
        self.bytes += need
        if memory is None:
            empty = torch.empty(0, dtype=torch.uint8)
            return codec.rebuild(tree, codec.views_for(specs, empty))
        if isinstance(memory, Slot):
            slot: Slot | None = memory
            base = torch.frombuffer(memory, dtype=torch.uint8, count=need)
        else:
            slot, base = None, memory
        if self.device is None:
            # The views hold the slot; it returns to the pool when the last of them dies.
            del slot, memory
            return codec.rebuild(tree, codec.views_for(specs, base))
        assert self.copy_stream is not None
        with torch.cuda.stream(self.copy_stream):
            storage = base.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        views = []
        for s in specs:
            if s.kind == "numpy":  # numpy cannot live on the GPU: keep a host copy
                views.append(codec.leaf_from_bytes(base, s).copy())
            else:
                views.append(codec.leaf_from_bytes(storage, s))
        if slot is not None:
            slot.release(self.copy_stream)
        return OnDevice(codec.rebuild(tree, views), storage, event, self.device)


def finish(item: Any) -> Any:
    """What the iterator yields for ``item``, which torch's machinery produced: a handle is
    taken in its turn, a batch on the device handed to the consumer's stream."""
    if isinstance(item, BatchHandle):
        item = item.take()  # on the consumer's thread, in order
    elif isinstance(item, Local):
        item = item.batch
    if isinstance(item, OnDevice):
        item = item.wait()
    return item
