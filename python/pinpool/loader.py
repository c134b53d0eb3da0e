"""``pinpool.DataLoader``: torch's DataLoader, with batches landing in pinned arena slots.

How a batch travels (``num_workers > 0``):

1. In the worker, :class:`PinCollate` collates (stacks go straight into shared memory; with
   torch's default collation each sample's big arrays go there as soon as the sample is
   made, see ``_stream``) and writes the batch into a reused segment; torch's result queue
   carries a small :class:`~pinpool._worker.BatchHandle`.
2. In the main process the handle is unpickled by torch's pin-memory thread (or, on a
   machine without an accelerator, by the iterating thread), which calls its
   ``pin_memory()``: Rust checks out a slot (waiting without the GIL), validates and copies
   the bytes with several threads, and hands the segment back to its worker. Nothing is
   unmapped per batch; retired segments are unmapped on the Rust reclaimer thread.
3. The batch is rebuilt as views into the slot. The slot returns to the pool when the last
   of them dies, fenced on torch's current stream at that moment. With ``device=``, the pin
   thread instead copies the slot to the GPU on its own stream, releases the slot behind an
   event on that stream, and the consumer's stream waits on that event.

Everything else (samplers, worker start-up and shutdown, errors, timeouts, ordering,
persistent workers) is torch's own machinery, unchanged.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar

import torch
import torch.utils.data
from torch.utils.data._utils.collate import default_convert

from . import _codec
from ._errors import (
    BatchTooLarge,
    InvalidArgument,
    OutOfBounds,
    PinPoolError,
    PoolExhausted,
    WorkerLost,
)
from ._heap import keep_freed_memory
from ._native import (
    SEGMENT_DATA_OFFSET,
    PinPool,
    SegmentCache,
    Slot,
    available_memory,
    check_segment,
    cuda_available,
)
from ._registry import lookup, register
from ._stream import LazySamples, StreamingDataset
from ._worker import BatchHandle, encode_in_worker, encode_streaming
from ._zerocopy import (
    SlotHandle,
    SlotTicket,
    TaggedBatch,
    TaggedSamples,
    TicketSampler,
    write_into_slot,
)

__all__ = ["DataLoader", "PinCollate"]

_T_co = TypeVar("_T_co", covariant=True)

#: What ``_Decoder._checkout`` returns to the pin thread for a batch to decode in its turn.
_LATER = object()

#: Slots get this much room over the first batch, rounded up to this granule.
_HEADROOM = 1.25
_GRANULE = 2 << 20
#: An arena sized automatically may take at most this share of the memory available.
_MEMORY_SHARE = 0.5


class _OnDevice:
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


class _Local:
    """A batch collated in the main process (``num_workers=0``), already in a slot."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def pin_memory(self) -> Any:
        return self.batch


def _finish(item: Any) -> Any:
    if isinstance(item, BatchHandle):
        item = item.decode()  # on the consumer's thread, in order
    elif isinstance(item, (SlotHandle, _Local)):
        item = item.pin_memory()
    if isinstance(item, _OnDevice):
        item = item.wait()
    return item


class _Decoder:
    """The main process's side of one loader: the pool, the segment cache, the copy stream."""

    def __init__(
        self,
        token: str,
        *,
        pool: PinPool | None,
        slot_bytes: int | None,
        num_slots: int,
        pool_device: int | None,
        device: torch.device | None,
        copy_threads: int | None,
        slot_timeout: float | None,
        overflow: str,
        oversize: str,
        zero_copy: bool,
        batch_size: int | None,
    ) -> None:
        self.token = token
        self.pid = os.getpid()  # finalizers run in a forked child do nothing
        self._batch_size = batch_size
        self._overflow = overflow
        self._oversize = oversize
        self.overflow_batches = 0
        self.zero_copy = zero_copy
        self.zero_copy_batches = 0
        self.zero_copy_fallbacks = 0
        # Slots handed to workers with batch indices: (index, generation) -> (slot, nonce,
        # the sampler that handed it out).
        self._assigned: dict[tuple[int, int], tuple[Slot, int, int]] = {}
        # Worker key -> pid, for the workers whose segments are mapped here.
        self._worker_pids: dict[int, int] = {}
        self.iterator: weakref.ref[Any] | None = None
        self._lock = threading.Lock()
        self._own_pool = pool is None
        self.pool = pool
        self.cache: SegmentCache | None = None
        self._slot_bytes = slot_bytes
        self._num_slots = num_slots
        self._pool_device = pool_device
        self.device = device
        self._copy_threads = copy_threads
        self._slot_timeout = slot_timeout
        self.copy_stream = torch.cuda.Stream(device) if device is not None else None
        self.batches = 0
        self.bytes = 0

    # -- set-up -------------------------------------------------------------------------

    def _ensure(self, nbytes: int, count: int | None = None) -> tuple[PinPool, SegmentCache]:
        """The pool and segment cache, made on first use. Without ``slot_bytes=``, slots hold
        this batch plus headroom, scaled up to a full batch when this one has fewer samples
        (the last batch of an epoch may well arrive first)."""
        pool, cache = self.pool, self.cache
        if pool is not None and cache is not None:
            return pool, cache  # made already: no lock needed
        with self._lock:
            if self.pool is None:
                full = self._batch_size
                if count and full and 0 < count < full:
                    nbytes = nbytes * full // count
                slot = self._slot_bytes or self._automatic_slot_bytes(nbytes)
                self.pool = PinPool(
                    slot,
                    self._num_slots,
                    device=self._pool_device,
                    copy_threads=self._copy_threads,
                    background=_background_arena(self._pool_device),
                )
                logging.getLogger("pinpool").info(
                    "made the loader's pool at its first batch (%d bytes): %d slots of %d "
                    "bytes, %s memory (%s), %d copy threads",
                    nbytes,
                    self.pool.num_slots,
                    self.pool.slot_bytes,
                    self.pool.memory,
                    self.pool.backend,
                    self.pool.copy_threads,
                )
            if self.cache is None:
                self.cache = SegmentCache(self.pool)
            return self.pool, self.cache

    def _automatic_slot_bytes(self, nbytes: int) -> int:
        """Slots for batches of ``nbytes``: that plus headroom, rounded up; refused (rather
        than faulted in until the kernel kills the process) when the arena would take more
        than :data:`_MEMORY_SHARE` of the memory available."""
        slot = max(_GRANULE, -(-int(nbytes * _HEADROOM) // _GRANULE) * _GRANULE)
        arena = slot * self._num_slots
        available = available_memory()
        if available is not None and arena > available * _MEMORY_SHARE:
            raise BatchTooLarge(
                f"batches of {nbytes} bytes need an arena of {self._num_slots} slots of {slot} "
                f"bytes ({arena / 2**30:.2f} GiB), more than {_MEMORY_SHARE:.0%} of the "
                f"{available / 2**30:.2f} GiB of memory available; pass smaller num_slots= "
                "or slot_bytes= (with oversize='copy') to pinpool.DataLoader",
                nbytes,
                slot,
            )
        return slot

    # -- segments from workers ----------------------------------------------------------

    def receive(self, handle: BatchHandle) -> None:
        """Takes hold of the handle's segment (mapping it the first time it is seen)."""
        try:
            worker, segment = int(handle.worker), int(handle.segment)
            total_len, nonce = int(handle.total_len), int(handle.nonce)
            nbytes = int(handle.nbytes)
            count = None if handle.count is None else int(handle.count)
            pid, fd = (int(x) for x in handle.origin) if handle.first else (0, 0)
            retired = tuple(int(sid) for sid in handle.retired)
            unused = None if handle.unused is None else tuple(int(x) for x in handle.unused)
        except (TypeError, ValueError, OverflowError) as exc:
            raise OutOfBounds(f"corrupt batch handle: {exc}") from None
        if not (
            0 <= worker < 1 << 64
            and 0 <= segment < 1 << 32
            and SEGMENT_DATA_OFFSET < total_len
            and 0 <= nonce < 1 << 64
            and 0 <= nbytes <= total_len - SEGMENT_DATA_OFFSET
            and (count is None or count > 0)  # (a dataset's __getitems__ may make more)
            and (not handle.first or (0 < pid < 1 << 31 and 0 <= fd < 1 << 31))
            and all(0 <= sid < 1 << 32 for sid in retired)
            and (unused is None or (len(unused) == 3 and all(0 <= x < 1 << 64 for x in unused)))
        ):
            raise OutOfBounds("corrupt batch handle: a field is out of range")
        # What the rest of the handle's life uses: checked values, not what was sent.
        handle.worker, handle.segment, handle.retired, handle.unused = (
            worker,
            segment,
            retired,
            unused,
        )
        key = (worker, segment)
        if not handle.first:
            # A segment mapped before: the pool exists, and copies are checked against the
            # real mapping, whatever the handle claims.
            if self.cache is None or key not in self.cache:
                raise PinPoolError(f"segment {key} was never received by this process")
            return
        try:
            own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            if not _alive(pid):
                raise WorkerLost(
                    f"DataLoader worker (pid {pid}) exited before the main process could "
                    "take its batch"
                ) from None
            raise OutOfBounds(f"corrupt batch handle: cannot open its segment: {exc}") from None
        try:
            # The segment is checked to be real (sealed, as long as claimed, its header intact)
            # before its claims size the pool.
            check_segment(key, own, total_len, nonce)
            _, cache = self._ensure(nbytes, count)
        except BaseException:
            os.close(own)
            raise
        cache.insert(key, own, total_len, nonce)  # owns the fd from here
        self._worker_pids[worker] = pid

    def discard(self, handle: BatchHandle) -> None:
        """Hands the segment back to its worker and drops what the worker retired."""
        if not handle._live:
            return
        handle._live = False
        cache = self.cache
        if cache is None:
            return
        try:
            cache.release(handle.key)
        except PinPoolError:
            pass  # already retired with the whole worker
        for sid in handle.retired:
            cache.retire((handle.worker, int(sid)))
        if handle.unused is not None:
            index, generation, nonce = handle.unused
            self.unassign((int(index), int(generation)), int(nonce))

    def decode(self, handle: BatchHandle, ahead: bool = False) -> Any:
        """Copies the handle's batch into a slot and returns it rebuilt (or on the device).

        ``ahead``: called by torch's pin thread, which decodes batches as they arrive, ahead
        of the consumer and in any order. It never waits for a slot that only the consumer can
        give back, nor decides on overflow: when every slot is held by a batch, the handle
        itself is returned, and the consumer's thread decodes it when it reaches that batch,
        in order (the same rules as on a machine without an accelerator)."""
        try:
            pool, cache = self._ensure(int(handle.nbytes))
            limit = int(handle.total_len) - SEGMENT_DATA_OFFSET
            specs = _codec.checked_specs(handle.specs, limit)
            need = _codec.extent(specs)
            slot = self._checkout(pool, need, ahead) if need else None
            if slot is _LATER:
                return handle
            if isinstance(slot, Slot):
                cache.copy_to_slot(handle.key, slot, [(0, 0, need)])
            elif slot is not None:
                cache.copy_to_buffer(handle.key, slot.numpy(), [(0, 0, need)])
        except BaseException:
            self.discard(handle)
            raise
        self.discard(handle)
        return self._deliver(handle.tree, specs, slot, need)

    # -- zero-copy: slots handed out with the indices -----------------------------------

    def assign(self, owner: int) -> SlotTicket | None:
        """Checks out a slot for a batch about to be dispatched by sampler ``owner`` (never
        waits: this runs on the consumer's thread). None sends the batch through copy mode."""
        pool = self.pool
        # Keep one slot free for batches that come through copy mode (the first ones, and any
        # too large for their slot): they need a slot when they arrive, and tickets must not
        # starve them.
        slot = pool.try_checkout(reserve=1) if pool is not None else None
        where = pool.slot_memfd(slot.index) if pool is not None and slot is not None else None
        if slot is None or pool is None or where is None:
            self.zero_copy_fallbacks += 1
            return None  # (a slot checked out above returns to the pool as it dies here)
        fd, offset, part_len = where
        nonce = random.getrandbits(63)
        with self._lock:
            self._assigned[(slot.index, slot.generation)] = (slot, nonce, owner)
        return SlotTicket(
            slot.index, slot.generation, nonce, offset, pool.slot_bytes, os.getpid(), fd, part_len
        )

    def unassign(self, key: tuple[int, int], nonce: int) -> None:
        """Takes back a slot handed out for a batch that will not arrive in it."""
        if not isinstance(key, tuple) or not all(type(x) is int for x in key):
            return  # (a corrupt handle's key: never handed out)
        with self._lock:
            entry = self._assigned.get(key)
            if entry is not None and entry[1] == nonce:
                del self._assigned[key]

    def drop_assignments(self, owner: int | None = None) -> None:
        """Takes back the slots handed out by sampler ``owner`` (all with None), once no
        worker that got them can write any more."""
        with self._lock:
            for key in [k for k, v in self._assigned.items() if owner in (None, v[2])]:
                del self._assigned[key]

    def decode_slot(self, handle: SlotHandle) -> Any:
        """A batch a worker wrote into the slot it was given: check it, view it."""
        handle._live = False
        try:
            key, nonce = (int(handle.index), int(handle.generation)), int(handle.nonce)
        except (TypeError, ValueError, OverflowError) as exc:
            raise OutOfBounds(f"corrupt batch handle: {exc}") from None
        with self._lock:
            entry = self._assigned.get(key)
            if entry is None or entry[1] != nonce:
                raise PinPoolError(f"a batch claims slot {key}, which was not handed out for it")
            del self._assigned[key]
        slot = entry[0]
        specs = _codec.checked_specs(handle.specs, slot.nbytes)
        need = _codec.extent(specs)
        self.zero_copy_batches += 1
        if need == 0:
            slot.release()
            return self._deliver(handle.tree, specs, None, 0)
        return self._deliver(handle.tree, specs, slot, need)

    # -- num_workers=0 ------------------------------------------------------------------

    def encode_local(self, batch: Any, count: int | None) -> _Local:
        """Writes a batch collated in this process straight into a slot."""
        plan = _codec.plan(batch)
        pool, _ = self._ensure(plan.nbytes, count)
        slot = self._checkout(pool, plan.nbytes) if plan.nbytes else None
        if slot is not None:
            _codec.write(plan, slot)
        return _Local(self._deliver(plan.tree, plan.specs, slot, plan.nbytes))

    # -- shared -------------------------------------------------------------------------

    def _checkout(self, pool: PinPool, need: int, ahead: bool = False) -> Any:
        """A slot for ``need`` bytes, or (by the overflow rules) an ordinary buffer. The rules
        are applied in Rust (``PinPool.claim``), which waits without the GIL.

        With ``ahead`` (torch's pin thread, decoding a batch the consumer may not want yet),
        the slot must not be the last one free (that one is kept for the batch the consumer
        waits for, which may still be on its way), and nothing waits for the consumer: it
        returns :data:`_LATER` instead of waiting, overflowing or raising."""
        if need > pool.slot_bytes:
            if ahead:
                return _LATER  # the error or the ordinary buffer belongs to this batch's turn
            if self._oversize == "copy":
                return self._overflow_buffer(need)
            raise BatchTooLarge(
                f"a batch needs {need} bytes but the pool's slots hold {pool.slot_bytes}; "
                f"pass slot_bytes= (at least {need}) to pinpool.DataLoader, or "
                f"oversize='copy' to put such batches in ordinary memory",
                need,
                pool.slot_bytes,
            )
        try:
            got = pool.claim(
                reserve=1 if ahead else 0,
                timeout=self._slot_timeout,
                overflow=self._overflow == "copy" and not ahead,
                defer=ahead,
            )
        except PoolExhausted:
            raise PoolExhausted(
                f"no free slot after {self._slot_timeout} s: all {pool.num_slots} slots "
                "are held by batches that are still alive; keep fewer batches, or pass "
                "num_slots= to pinpool.DataLoader"
            ) from None
        if got == "later":
            return _LATER
        if got == "overflow":
            # Every slot is held by a batch the consumer keeps alive: waiting could wait
            # forever (list(loader) does this). Use ordinary memory for this one.
            return self._overflow_buffer(need)
        return got

    def _overflow_buffer(self, need: int) -> torch.Tensor:
        self.overflow_batches += 1
        if self.overflow_batches == 1:
            logging.getLogger("pinpool").warning(
                "a batch did not get a pinned slot and went into ordinary memory; see "
                "DataLoader(overflow=..., oversize=..., num_slots=..., slot_bytes=...)"
            )
        return torch.empty(need, dtype=torch.uint8)

    def _deliver(
        self, tree: Any, specs: list[_codec.LeafSpec], slot: Slot | torch.Tensor | None, need: int
    ) -> Any:
        self.batches += 1
        self.bytes += need
        if slot is None:
            base = torch.empty(0, dtype=torch.uint8)
            return _codec.rebuild(tree, _codec.views_for(specs, base))
        if isinstance(slot, Slot):
            base = torch.frombuffer(slot, dtype=torch.uint8, count=need)
        else:
            base, slot = slot, None
        if self.device is None:
            # The views hold the slot; it returns to the pool when the last of them dies.
            del slot
            return _codec.rebuild(tree, _codec.views_for(specs, base))
        assert self.copy_stream is not None
        with torch.cuda.stream(self.copy_stream):
            storage = base.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        views = []
        for s in specs:
            if s.kind == "numpy":  # numpy cannot live on the GPU: keep a host copy
                views.append(_codec.leaf_from_bytes(base, s).copy())
            else:
                views.append(_codec.leaf_from_bytes(storage, s))
        if slot is not None:
            slot.release(self.copy_stream)
        return _OnDevice(_codec.rebuild(tree, views), storage, event, self.device)

    def retire_segments(self, dead_only: bool = False) -> None:
        """Unmaps (on the reclaimer thread) the segments of workers that have exited (of every
        worker with ``dead_only=False``)."""
        if self.cache is None:
            return
        if not dead_only:
            self.cache.retire_all()
            self._worker_pids.clear()
            return
        for worker, pid in list(self._worker_pids.items()):
            if not _alive(pid):
                self.cache.retire_all(worker)
                del self._worker_pids[worker]

    def close(self) -> None:
        if self.pid != os.getpid():
            return
        inner = self.iterator() if self.iterator is not None else None
        shutdown = getattr(inner, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()  # no worker may write into a slot we take back below
            _drop_undelivered(inner)
        self.drop_assignments()
        self.retire_segments()
        if self.pool is not None and self._own_pool:
            # Returns at once: segments are unmapped, and the arena is freed, on background
            # threads (see wait_for_releases).
            self.pool.close()


class PinCollate:
    """The ``collate_fn`` pinpool gives torch: collates, then writes the batch into shared
    memory (in a worker) or straight into a slot (in the main process)."""

    def __init__(
        self,
        token: str,
        collate_fn: Callable[[Any], Any] | None,
        auto_collation: bool,
        ring_size: int,
        keep_worker_memory: bool = True,
        worker_copy_threads: int = 1,
        stream_samples: bool = True,
    ) -> None:
        self.token = token
        self.stream_samples = stream_samples
        self.collate_fn = collate_fn
        self.auto_collation = auto_collation
        self.ring_size = ring_size
        self.keep_worker_memory = keep_worker_memory
        self.worker_copy_threads = worker_copy_threads

    def __call__(self, data: Any) -> Any:
        # Only pinpool's own carriers have a ticket (a user's batch may have such an attribute).
        ticket = (
            data.ticket if isinstance(data, (LazySamples, TaggedSamples, TaggedBatch)) else None
        )
        in_worker = torch.utils.data.get_worker_info() is not None
        if isinstance(data, LazySamples):
            if self.stream_samples and self.collate_fn is None and in_worker:
                made = encode_streaming(
                    self.token,
                    self.ring_size,
                    data,
                    self.worker_copy_threads,
                    self.keep_worker_memory,
                )
                if not isinstance(made, list):
                    return made
                data = made
            else:
                data = list(data)
        elif isinstance(data, TaggedSamples):
            data = list(data)  # collate functions get what torch would give them
        elif isinstance(data, TaggedBatch):
            data = data.made
        # Samples in the batch, when the data is a list of them (a dataset's own __getitems__
        # may return a whole batch instead).
        count = len(data) if self.auto_collation and isinstance(data, (list, tuple)) else None
        if self.collate_fn is not None:
            batch = self.collate_fn(data)
        elif self.auto_collation:
            batch = _codec.default_collate_deferred(data)
        else:
            batch = default_convert(data)
        if not in_worker:
            return lookup(self.token).encode_local(batch, count)
        plan = _codec.plan(batch)
        if self.keep_worker_memory:
            keep_freed_memory(plan.nbytes)
        if ticket is None:
            return encode_in_worker(
                self.token,
                self.ring_size,
                batch,
                plan,
                count=count,
                threads=self.worker_copy_threads,
            )
        if plan.nbytes <= ticket.nbytes:
            return write_into_slot(self.token, ticket, plan, self.worker_copy_threads)
        unused = (ticket.index, ticket.generation, ticket.nonce)
        return encode_in_worker(
            self.token, self.ring_size, batch, plan, unused, count, self.worker_copy_threads
        )


class _PinnedIter:
    """Wraps torch's iterator: finishes each batch and cleans up at the end."""

    def __init__(self, loader: DataLoader, inner: Iterator[Any]) -> None:
        self._loader = loader
        self._inner = inner
        self._ended = False
        loader._pin_decoder.iterator = weakref.ref(inner)

    def __iter__(self) -> _PinnedIter:
        return self

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __next__(self) -> Any:
        try:
            item = next(self._inner)
        except StopIteration:
            self._end()
            raise
        return _finish(item)

    def _end(self) -> None:
        if self._ended or self._loader._pin_decoder.pid != os.getpid():
            return
        self._ended = True
        if not self._loader.persistent_workers:
            shutdown = getattr(self._inner, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
                _drop_undelivered(self._inner)
            # Only what this iterator's (now exited) workers had: another iterator of the
            # same loader may still be running.
            decoder = self._loader._pin_decoder
            sampler = getattr(self._inner, "_index_sampler", None)
            if isinstance(sampler, TicketSampler):
                decoder.drop_assignments(sampler.owner)
            decoder.retire_segments(dead_only=True)

    def __del__(self) -> None:
        try:
            self._end()
        except Exception:
            pass


def _drop_undelivered(inner: Any) -> None:
    """Drops the batches a shut-down torch iterator still holds (its pin thread decoded them
    ahead, or they arrived out of order): each holds a slot."""
    data = getattr(inner, "_data_queue", None)
    if isinstance(data, queue.Queue):  # the pin thread's output (in-process, not a pipe)
        while True:
            try:
                data.get_nowait()
            except queue.Empty:
                break
    task_info = getattr(inner, "_task_info", None)
    if isinstance(task_info, dict):
        task_info.clear()


def _background_arena(device: int | None) -> bool:
    """Whether the loader's arena is made ready in the background (the first 64 MiB at once,
    the rest while the first batches flow) or whole before the first batch is delivered.

    Whole, wherever the arena is pinned through the CUDA driver: on the H200, registering the
    rest while batches flowed stalled the main thread for 4 to 7 ms at a time (timed steps,
    268 MB batches) and cut throughput from 15.5 to 10.3 GB/s, while the whole arena was ready
    by the first batch anyway, in 0.83x torch's time to its first batch
    (``benchmarks/results/h200-no-gil-stall``). In the background where there is no driver to
    contend with (host memory): there it halves the time to the first batch."""
    return device is None or not cuda_available()


def _worker_copy_threads(asked: int | None, num_workers: int) -> int:
    """Copy threads per worker: as asked, else ``$PINPOOL_WORKER_COPY_THREADS``, else the
    cores this process may use per worker, from 2 to 4 (a worker copies for only part of
    its time: on the H200, 2 per worker with 8 and with 14 workers on 16 cores was the best
    or near the best of 1 to 4, see ``benchmarks/results/h200-worker-threads``)."""
    if asked is None:
        env = os.environ.get("PINPOOL_WORKER_COPY_THREADS")
        if env:
            try:
                asked = int(env)
            except ValueError:
                raise InvalidArgument(
                    f"PINPOOL_WORKER_COPY_THREADS must be an integer, not {env!r}"
                ) from None
        else:
            # Under torchrun (or Lightning, accelerate), LOCAL_WORLD_SIZE ranks share the
            # host's cores, each with its own workers.
            ranks = local_world_size()
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
            floor = 2 if ranks == 1 else 1
            asked = min(4, max(floor, cores // ranks // max(1, num_workers)))
    _check_int("worker_copy_threads", asked, 1, _MAX_COPY_THREADS)
    return asked


def local_world_size() -> int:
    """How many data-parallel ranks share this host: ``$LOCAL_WORLD_SIZE`` (set by torchrun,
    and by Lightning and accelerate on top of it), else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


#: The most copy threads a pool or a worker may have (the Rust core's limit).
_MAX_COPY_THREADS = 64


def _check_int(name: str, value: Any, low: int, high: int, none_ok: bool = False) -> None:
    """Raises InvalidArgument unless ``value`` is an int from ``low`` to ``high`` (or None)."""
    if value is None and none_ok:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidArgument(f"{name} must be an integer from {low} to {high}, not {value!r}")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cuda_device(device: Any) -> torch.device | None:
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise InvalidArgument(f"device must be None, 'cpu' or a CUDA device, not {device!r}")
    if not torch.cuda.is_available():
        raise InvalidArgument(f"device={device!r} was asked for, but torch sees no CUDA device")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


class DataLoader(torch.utils.data.DataLoader[_T_co]):
    """A drop-in ``torch.utils.data.DataLoader`` whose batches land in pinned arena slots.

    Takes torch's arguments (``pin_memory`` is implied and ignored), plus:

    - ``device``: None (default) yields pinned CPU batches, views into slots; a CUDA device
      yields batches already on it, safe to use on the consumer's current stream.
    - ``pool``: an existing :class:`~pinpool.PinPool` to use (default: one made at the first
      batch, with ``slot_bytes`` (default: the first batch's size plus 25%, rounded up to
      2 MiB) and ``num_slots`` (default: batches in flight plus 4)).
    - ``copy_threads``: threads copying batches into slots (default: up to 8).
    - ``overflow``: what happens to a batch when every slot is held by a batch the consumer
      keeps alive (``list(loader)`` does that): ``"copy"`` (default) puts it in ordinary,
      unpinned memory, counted in ``stats()["overflow_batches"]``; ``"wait"`` waits up to
      ``slot_timeout`` seconds (None: forever) for one to die, then raises
      :class:`~pinpool.PoolExhausted`. Slots still fenced by GPU work are always waited for.
    - ``oversize``: a batch larger than a slot raises :class:`~pinpool.BatchTooLarge` naming
      both sizes (``"error"``, default), or goes into ordinary memory (``"copy"``).
    - ``zero_copy``: workers write batches straight into arena slots handed out with the
      indices (map-style datasets with batching and ``num_workers > 0``; the pool must be a
      memfd: ``cuda-register`` or ``host``). The first batch, batches that find no free slot
      when dispatched and batches too large for a slot go through copy mode, counted in
      ``stats()["zero_copy_fallbacks"]``.
    - ``keep_worker_memory``: workers keep memory their items were made in (up to twice the
      largest batch, at most 1 GiB each) for the next batch's items, rather than give it
      back to the kernel and fault fresh pages in for every batch (glibc's trim and mmap
      thresholds; see ``pinpool._heap``). False leaves the workers' allocator alone.
    - ``worker_copy_threads``: threads each worker copies a batch's big arrays with (its
      stacks, into its segment or its zero-copy slot), without the GIL. Default:
      ``$PINPOOL_WORKER_COPY_THREADS``, else the cores per worker, from 2 to 4.
    - ``stream_samples``: with torch's default collation, workers copy each sample's big
      arrays into the batch's shared memory as soon as the sample is made, while they are
      still in the CPU's cache, instead of making every sample first and stacking them after
      (see ``pinpool._stream``; the batch is the same, bit for bit). Map-style datasets with
      ``num_workers > 0``. In the workers, ``get_worker_info().dataset`` is then a thin
      wrapper (attributes read or set on it are the dataset's); ``loader.dataset`` is yours.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = True,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        pool: PinPool | None = None,
        slot_bytes: int | None = None,
        num_slots: int | None = None,
        device: Any = None,
        copy_threads: int | None = None,
        slot_timeout: float | None = 60.0,
        overflow: Literal["copy", "wait"] = "copy",
        oversize: Literal["error", "copy"] = "error",
        zero_copy: bool = False,
        keep_worker_memory: bool = True,
        worker_copy_threads: int | None = None,
        stream_samples: bool = True,
    ) -> None:
        del pin_memory, pin_memory_device  # always pinned, on the pool's device
        if overflow not in ("copy", "wait"):
            raise InvalidArgument(f"overflow must be 'copy' or 'wait', not {overflow!r}")
        if oversize not in ("copy", "error"):
            raise InvalidArgument(f"oversize must be 'copy' or 'error', not {oversize!r}")
        # Checked now, not when the pool is made at the first batch: an error there would
        # come out of the middle of an epoch.
        _check_int("num_slots", num_slots, 1, 1 << 20, none_ok=True)
        _check_int("slot_bytes", slot_bytes, 1, 1 << 50, none_ok=True)
        _check_int("copy_threads", copy_threads, 1, _MAX_COPY_THREADS, none_ok=True)
        if slot_timeout is not None and not (
            isinstance(slot_timeout, (int, float))
            and not isinstance(slot_timeout, bool)
            and 0 <= slot_timeout < float("inf")
        ):
            raise InvalidArgument(
                f"slot_timeout must be None or a non-negative number, not {slot_timeout!r}"
            )
        out_device = _cuda_device(device)
        if pool is not None:
            pool_device = pool.device
        elif out_device is not None:
            pool_device = out_device.index
        elif torch.cuda.is_available():
            pool_device = torch.cuda.current_device()
        else:
            pool_device = None
        in_flight = (prefetch_factor or 2) * num_workers if num_workers > 0 else 1
        token = uuid.uuid4().hex
        decoder = _Decoder(
            token,
            pool=pool,
            slot_bytes=slot_bytes,
            num_slots=num_slots if num_slots is not None else in_flight + 4,
            pool_device=pool_device,
            device=out_device,
            copy_threads=copy_threads,
            slot_timeout=slot_timeout,
            overflow=overflow,
            oversize=oversize,
            zero_copy=zero_copy,
            batch_size=batch_size if batch_sampler is None else None,
        )
        auto_collation = batch_size is not None or batch_sampler is not None
        batched_map_style = (
            auto_collation
            and num_workers > 0
            and not isinstance(dataset, torch.utils.data.IterableDataset)
        )
        self._pin_tickets = zero_copy and batched_map_style
        streams = stream_samples and collate_fn is None
        # What torch's workers are given (loader.dataset stays the caller's own).
        self._pin_worker_dataset = (
            StreamingDataset(dataset) if batched_map_style and (streams or zero_copy) else None
        )
        collate = PinCollate(
            token,
            collate_fn,
            auto_collation=auto_collation,
            ring_size=(prefetch_factor or 2) + 2,
            keep_worker_memory=keep_worker_memory,
            worker_copy_threads=_worker_copy_threads(worker_copy_threads, num_workers),
            stream_samples=stream_samples,
        )
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate,
            pin_memory=torch.accelerator.is_available(),
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            in_order=in_order,
        )
        self._pin_decoder = decoder
        register(token, decoder)
        if slot_bytes is not None or pool is not None:
            decoder._ensure(0)  # sizes known: make the pool now, so batch 1 has a slot too
        weakref.finalize(self, decoder.close)

    def __iter__(self) -> _PinnedIter:  # type: ignore[override]
        return _PinnedIter(self, super().__iter__())

    def _get_iterator(self) -> Any:
        # torch's iterator reads loader.dataset once, as it starts, and hands it to the
        # workers: for that moment only, it is the wrapper the workers need.
        inner = getattr(self, "_pin_worker_dataset", None)
        if inner is None:
            return super()._get_iterator()
        own = self.dataset
        object.__setattr__(self, "dataset", inner)
        try:
            return super()._get_iterator()
        finally:
            object.__setattr__(self, "dataset", own)

    @property
    def _index_sampler(self) -> Any:
        # torch reads this when it starts an epoch; in zero-copy mode every index list it
        # hands a worker carries a slot.
        base = super()._index_sampler
        if getattr(self, "_pin_tickets", False):
            return TicketSampler(base, self._pin_decoder.assign)  # one per iterator
        return base

    @property
    def pool(self) -> PinPool | None:
        """The pool batches land in (None until the first batch when it is made lazily)."""
        return self._pin_decoder.pool

    def stats(self) -> dict[str, Any]:
        """The pool's counters plus the loader's own (``batches``, ``bytes``,
        ``overflow_batches``, ``segments_cached``)."""
        decoder = self._pin_decoder
        out: dict[str, Any] = decoder.pool.stats() if decoder.pool is not None else {}
        out["batches"] = decoder.batches
        out["bytes"] = decoder.bytes
        out["overflow_batches"] = decoder.overflow_batches
        out["zero_copy_batches"] = decoder.zero_copy_batches
        out["zero_copy_fallbacks"] = decoder.zero_copy_fallbacks
        out["segments_cached"] = len(decoder.cache) if decoder.cache is not None else 0
        return out
