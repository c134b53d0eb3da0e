"""The last step of a batch's trip: its bytes become the batch, as CPU views or on the device.

:class:`Delivery` rebuilds a batch from its marked tree and checked leaf specs over the memory
it landed in (a slot, or an ordinary buffer when it overflowed). Without a device the batch is
views into that memory: a slot returns to its pool when the last view dies, fenced on torch's
current stream then. With a CUDA device, the memory is copied to it on the loader's own copy
stream, from a slot in one call without the GIL (:meth:`Delivery.send`: a worker's segment
goes into the slot and on to the device; a zero-copy batch is in its slot already), and the
slot is released behind that copy (fenced on the copy stream). The device memory is one
allocation per batch: in its leaves' dtype where they share one, so that they come out of it
with no torch call per leaf (``leaves.DeviceLayout``), else bytes viewed leaf by leaf.

Every batch delivered comes out as one type, :class:`Pending`, with one ``wait()``, called on
the consumer's thread by :func:`hand_to_consumer` as the batch is yielded: it waits for a copy into
the slot still running on a copy thread (the pin thread took the batch ahead), and makes the
consumer's current stream wait for a copy to the device. Nothing here calls back into the
receiver: where a batch's bytes still are (a worker's segment) is passed in as data.

Objects the tree walk cannot look into travel whole (``opaque``: pinned by their own
``pin_memory()`` where torch would call it, warned about once).

Invariants: a slot is referenced only by the views made here (CPU) or by nothing once released
behind the copy (device); numpy leaves cannot live on a GPU, so they are host copies there;
every batch delivered leaves here as a :class:`Pending`, and is yielded only through its
``wait()`` (:func:`hand_to_consumer`).
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _trace
from ..._native import Copying, SegmentCache, Sent, Slot
from ..._torch_contract import cuda_raw_stream
from ..._wire import codec, leaves
from ..._wire.handle import BatchHandle
from ..settings.delivery_mode import DeliveryMode
from . import notices
from .opaque import OpaqueObjects
from .split_batch import SplitBatch

#: Where a slot's bytes still are, when a batch is sent to the device: in a worker's segment
#: (the segment cache and the segment's key), or None: in the slot already.
Source = tuple[SegmentCache, tuple[int, int]] | None
#: A small batch in a slot the driver pinned, left to be sent in its turn
#: (:meth:`Delivery.send_in_turn`): its tree, leaf specs, slot and size in bytes.
SendLater = tuple[Any, list[codec.LeafSpec], Slot, int]
#: A batch a copy thread is sending (:meth:`Delivery.start_sending`): the copy under way, the
#: device memory it goes to, and the leaves' views of that memory.
Started = tuple[Copying, torch.Tensor, list[Any]]


class Pending:
    """A delivered batch on its way to the consumer: :meth:`wait`, on the consumer's thread,
    does what is left and returns the batch.

    What may be left: a copy into the batch's slot still running on a copy thread
    (``copying``: torch's pin thread took the batch and went on to the next), or, for a batch
    copied to the device on the loader's copy stream (``sent``: that copy, or its CUDA event;
    ``sending``: a copy thread still copying it into its slot, which queues that copy next),
    handing it over to the consumer's current stream. The device memory was allocated on the
    copy stream, so the caching allocator must be told it is used on the consumer's stream
    too (``record_stream``), or it could reuse it before that work is done. The pin thread
    does that ahead, for the stream the consumer used last (``recorded``: its raw handle);
    ``wait()`` only does it again when the consumer's current stream is another one."""

    __slots__ = (
        "batch",
        "copying",
        "counts",
        "delivery",
        "later",
        "nbytes",
        "recorded",
        "sending",
        "sent",
        "storage",
    )

    def __init__(
        self,
        batch: Any,
        *,
        copying: Copying | None = None,
        storage: torch.Tensor | None = None,
        sent: Sent | torch.cuda.Event | None = None,
        delivery: Delivery | None = None,
        recorded: int | None = None,
        later: SendLater | None = None,
        sending: Copying | None = None,
        counts: Delivery | None = None,
        nbytes: int = 0,
    ) -> None:
        self.batch = batch
        #: Where the batch, once handed over, is counted (``Delivery.handed``), and its bytes.
        self.counts = counts
        self.nbytes = nbytes
        self.copying = copying
        self.storage = storage
        self.sent = sent
        self.delivery = delivery
        self.recorded = recorded
        self.later = later
        self.sending = sending

    def wait(self) -> Any:
        t0 = _trace.on and _trace.now()
        what = "device" if self.sent is not None or self.sending is not None else "landing"
        if self.copying is not None:
            self.copying.wait()
        if self.sending is not None:
            sending, self.sending = self.sending, None
            self.sent = sending.sent()  # (waits for the copy thread; raises what it met)
        if self.later is not None:
            what = "send"
            later, self.later = self.later, None
            assert self.delivery is not None
            self.batch = self.delivery.send_in_turn(*later)
        elif self.sent is not None:
            self._hand_to_current_stream()
        if t0 and (self.copying is not None or self.sent is not None or what == "send"):
            _trace.span("batch.wait", t0, what=what)
        counts, self.counts = self.counts, None
        if counts is not None:  # (handed over: once)
            counts.handed += 1
            counts.handed_bytes += self.nbytes
        return self.batch

    def _hand_to_current_stream(self) -> None:
        """A batch on the device: the consumer's current stream waits for its copy, and the
        caching allocator is told the storage is used there."""
        delivery = self.delivery
        assert delivery is not None and self.storage is not None
        raw = delivery.current_raw_stream()
        if isinstance(self.sent, Sent):
            self.sent.make_wait(raw)  # (in Rust: keeps the GIL)
            if raw == self.recorded:
                return
            stream = torch.cuda.current_stream(delivery.device)
        else:
            stream = torch.cuda.current_stream(delivery.device)
            stream.wait_event(self.sent)
        self.storage.record_stream(stream)
        delivery.consumer = (stream, raw)  # the batches sent from now on are recorded on it

    def pin_memory(self) -> Pending:
        """torch's pin-memory step (a batch made in the main process, ``num_workers=0``)
        leaves it as it is: :func:`hand_to_consumer` waits for it in its turn."""
        return self


class Delivery:
    """Rebuilds batches over their memory, on the CPU or on the mode's device; counts them."""

    def __init__(self, mode: DeliveryMode) -> None:
        self.mode = mode
        self.device = device = mode.device
        self.copy_stream = torch.cuda.Stream(device) if device is not None else None
        # The consumer's stream as last seen by Pending.wait (first: the default stream) and
        # its raw handle: batches are recorded on it ahead, on the pin thread.
        self.consumer: tuple[torch.cuda.Stream, int] | None = None
        if device is not None:
            default = torch.cuda.default_stream(device)
            self.consumer = (default, int(default.cuda_stream))
        #: Batches taken (into the arena, or onto the device), and their bytes: handed over to
        #: the consumer, or ahead of it.
        self.batches = 0
        self.bytes = 0
        #: Batches handed over to the consumer (``Pending.wait``), and their bytes.
        self.handed = 0
        self.handed_bytes = 0
        #: What becomes of objects the tree walk cannot look into (``opaque``).
        self.opaque = OpaqueObjects(device is not None)
        self.pin_opaque = self.opaque.pin

    def taken_ahead(self) -> int:
        """Batches taken ahead of the consumer and not yet handed over."""
        return self.batches - self.handed

    def __call__(
        self,
        tree: Any,
        specs: list[codec.LeafSpec],
        memory: Slot | SplitBatch | torch.Tensor | None,
        need: int,
        copying: Copying | None = None,
    ) -> Pending:
        """The batch of ``tree`` over the first ``need`` bytes of ``memory`` (None when every
        leaf is empty): CPU views, or, on the device, a copy by torch from memory the driver
        did not pin (one it pinned goes by :meth:`send`: the receiver's route decides);
        ``copying``: the copy into ``memory`` still running, which the consumer waits for."""
        if isinstance(memory, SplitBatch):
            return self._in_pieces(tree, specs, memory, need)
        self.batches += 1
        self.bytes += need
        if memory is None:
            arrays = leaves.host_leaves(specs, b"", 0)
            return Pending(leaves.rebuild(tree, arrays, self.pin_opaque), counts=self)
        # The leaves' buffer: a slot, or the numpy array of an ordinary buffer (no torch op:
        # see leaves.host_leaf).
        host = memory if isinstance(memory, Slot) else memory.numpy()
        if not self.mode.on_device:
            # The views hold the slot; it returns to the pool when the last of them dies.
            arrays = leaves.host_leaves(specs, host, need)
            del host, memory
            batch = leaves.rebuild(tree, arrays, self.pin_opaque)
            return Pending(batch, copying=copying, counts=self, nbytes=need)
        assert self.copy_stream is not None
        base = torch.frombuffer(host, dtype=torch.uint8, count=need)
        with torch.cuda.stream(self.copy_stream):
            storage = base.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        del base
        views = _device_leaves(specs, host, storage, need)
        del host
        if isinstance(memory, Slot):
            memory.release(self.copy_stream)
        batch = leaves.rebuild(tree, views, self.pin_opaque)
        return Pending(batch, storage=storage, sent=event, delivery=self, counts=self, nbytes=need)

    def _in_pieces(
        self, tree: Any, specs: list[codec.LeafSpec], pieces: SplitBatch, need: int
    ) -> Pending:
        """A batch copied into several slots (CPU batches only: see ``Receiver._copy_in``):
        its leaves view the pieces they lie in, which return to the pool as they die."""
        self.batches += 1
        self.bytes += need
        arrays = [pieces.host_leaf(s) for s in specs]
        del pieces
        batch = leaves.rebuild(tree, arrays, self.pin_opaque)
        return Pending(batch, counts=self, nbytes=need)

    def send(
        self,
        tree: Any,
        specs: list[codec.LeafSpec],
        slot: Slot,
        need: int,
        source: Source,
    ) -> Pending:
        """The batch of ``tree`` on the device: the first ``need`` bytes of ``slot`` are
        copied to the device on the loader's copy stream, in one call without the GIL,
        put into the slot first from a worker's segment when ``source`` names one."""
        self.batches += 1
        self.bytes += need
        assert self.copy_stream is not None and self.consumer is not None
        layout = leaves.device_layout(specs, need)
        with torch.cuda.stream(self.copy_stream):
            storage = self._allocate(layout, need)
        t0 = _trace.on and _trace.now()
        if source is None:
            sent = slot.send(storage, need, self.copy_stream)
        else:
            cache, key = source
            sent = cache.copy(key, slot, [(0, 0, need)], send=(storage, need, self.copy_stream))
        if t0:
            _trace.span("batch.send", t0, nbytes=need)
        views = self._views(layout, specs, slot, storage, need)
        return self._sent_batch(tree, views, slot, storage, need, sent, None)

    def start_sending(
        self, specs: list[codec.LeafSpec], slot: Slot, need: int, source: Source
    ) -> Started | None:
        """Starts a segment's batch on its way to the device on a copy thread: into ``slot``,
        then onto the device on the loader's copy stream, its segment handed back to its
        worker there (torch's pin thread goes on to the next batch meanwhile). None, with
        nothing started, for a batch whose leaves are not views of one allocation (numpy
        leaves, mixed dtypes: ``leaves.DeviceLayout``; :meth:`send` takes it). Once this
        returns, the segment is the copy thread's: :meth:`finish_sending` makes the batch."""
        layout = leaves.device_layout(specs, need)
        if layout is None or source is None:
            return None
        assert self.copy_stream is not None
        with torch.cuda.stream(self.copy_stream):
            storage = layout.allocate(self.device)  # type: ignore[arg-type]
        views = layout.views(storage)
        cache, key = source
        t0 = _trace.on and _trace.now()
        sending = cache.copy(
            key, slot, [(0, 0, need)], then_hand_back=True, send=(storage, need, self.copy_stream)
        )
        if t0:
            _trace.span("batch.send", t0, nbytes=need, background=True)
        return sending, storage, views

    def finish_sending(self, tree: Any, slot: Slot, need: int, started: Started) -> Pending:
        """The batch :meth:`start_sending` started: its slot released fenced on the copy
        stream (carried out by the copy thread after the send), its storage recorded on the
        consumer's stream; the consumer's ``wait()`` takes the send's event."""
        sending, storage, views = started
        self.batches += 1
        self.bytes += need
        # (The release is carried out once the copy thread lets go: after the send.)
        return self._sent_batch(tree, views, slot, storage, need, None, sending)

    def _sent_batch(
        self,
        tree: Any,
        views: list[Any],
        slot: Slot,
        storage: torch.Tensor,
        need: int,
        sent: Sent | None,
        sending: Copying | None,
    ) -> Pending:
        """The batch whose copy to the device is queued (``sent``) or on its way from a copy
        thread (``sending``): its slot released fenced on the copy stream (reused only after
        the copy to the device), its storage recorded on the consumer's stream, whose
        ``wait()`` takes the copy's event."""
        assert self.copy_stream is not None and self.consumer is not None
        slot.release(self.copy_stream)
        consumer, raw = self.consumer
        storage.record_stream(consumer)
        batch = leaves.rebuild(tree, views, self.pin_opaque)
        return Pending(
            batch,
            storage=storage,
            sent=sent,
            sending=sending,
            delivery=self,
            recorded=raw,
            counts=self,
            nbytes=need,
        )

    def send_in_turn(self, tree: Any, specs: list[codec.LeafSpec], slot: Slot, need: int) -> Any:
        """The batch of ``tree`` on the device, sent on the consumer's thread as it is
        yielded, on torch's current stream (as ``tensor.to(device, non_blocking=True)``
        would): the device memory is allocated there and the slot released fenced there,
        in one native call (which keeps the GIL: giving it up there would hand it to torch's
        pin thread for its whole step), so no event, no stream switch and no
        ``record_stream`` are needed. For small batches, whose copy is too short to gain from
        running beside the consumer's work on a stream of its own."""
        self.batches += 1
        self.bytes += need
        assert self.device is not None
        raw = self.current_raw_stream()
        layout = leaves.device_layout(specs, need)
        storage = self._allocate(layout, need)
        views = self._views(layout, specs, slot, storage, need)
        t0 = _trace.on and _trace.now()
        slot.send(storage, need, raw, then_release=True)
        if t0:
            _trace.span("batch.send", t0, nbytes=need)
        return leaves.rebuild(tree, views, self.pin_opaque)

    def _allocate(self, layout: leaves.DeviceLayout | None, need: int) -> torch.Tensor:
        """The device memory a batch of ``need`` bytes is copied into, on the current stream:
        shaped as ``layout`` says (its only leaf, or its leaves' one dtype), else bytes."""
        if layout is not None:
            return layout.allocate(self.device)  # type: ignore[arg-type]
        return torch.empty(need, dtype=torch.uint8, device=self.device)

    @staticmethod
    def _views(
        layout: leaves.DeviceLayout | None,
        specs: list[codec.LeafSpec],
        host: Any,
        storage: torch.Tensor,
        need: int,
    ) -> list[Any]:
        """The leaves over ``storage``: in one native call where ``layout`` says how, else one
        view (or, numpy, host copy) per leaf."""
        if layout is not None:
            return layout.views(storage)
        return _device_leaves(specs, host, storage, need)

    def current_raw_stream(self) -> int:
        """The raw handle of torch's current stream on the loader's device."""
        assert self.device is not None
        if _raw_stream is not None:
            return int(_raw_stream(self.device.index))
        return int(torch.cuda.current_stream(self.device).cuda_stream)


#: torch's current stream on a device as a raw handle, without making a Stream object.
_raw_stream = cuda_raw_stream


def _device_leaves(
    specs: list[codec.LeafSpec], host: Any, storage: torch.Tensor, need: int
) -> list[Any]:
    """The leaves of a batch copied to the device: views of ``storage``, except numpy leaves
    (numpy cannot live on a GPU), which are copies of their bytes in ``host``."""
    return [
        leaves.host_leaf(host, s, need).copy()
        if s.kind == "numpy"
        else leaves.device_leaf(storage, s)
        for s in specs
    ]


def hand_to_consumer(item: Any) -> Any:
    """What the iterator yields for ``item``, which torch's machinery produced: a handle is
    taken in its turn, a pending batch waited for (its copy into its slot, or its hand-over
    to the consumer's stream)."""
    t0 = _trace.on and _trace.now()
    if isinstance(item, BatchHandle):
        item = item.take()  # on the consumer's thread, in order
    if isinstance(item, Pending):
        item = item.wait()
    notices.give_due()
    if t0:
        _trace.span("batch.finish", t0)
    return item
