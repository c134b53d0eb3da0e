"""The worker side: collate into a reused shared-memory segment and send a small handle.

Each worker process keeps a small ring of segments (sealed memfds, see
``src/transport/segment.rs``). A batch goes into a segment the main process has finished with;
the handle sent through torch's result queue carries only the marked batch tree, the leaf specs
and the segment's name. The first time a segment is used, the handle also says where the main
process can open it (``/proc/<worker pid>/fd/<fd>``, checked against a random nonce in the
header). Segments too small for a batch are retired: the worker drops its mapping and the next
handle tells the main process to drop its own. :func:`encode_streaming` fills a segment (or a
zero-copy slot) sample by sample (see ``_stream``).
"""

from __future__ import annotations

import copy
import os
import random
import threading
from dataclasses import dataclass, field
from typing import Any

from . import _codec, _registry, _stream
from ._errors import PinPoolError
from ._heap import keep_freed_memory
from ._native import WorkerSegment
from ._stream import LazySamples
from ._zerocopy import SlotHandle, arena_for

#: Headroom when a segment is (re)made, so slowly growing batches do not retire every time.
_GROWTH = 1.25
_GRANULE = 2 << 20


@dataclass
class _Ring:
    """One worker process's segments for one loader."""

    limit: int
    key: int = field(default_factory=lambda: random.getrandbits(63))
    segments: dict[int, WorkerSegment] = field(default_factory=dict)
    announced: set[int] = field(default_factory=set)
    retired: list[int] = field(default_factory=list)
    next_id: int = 0

    def acquire(self, nbytes: int) -> tuple[int, WorkerSegment]:
        """A claimed segment with room for ``nbytes``: a free one, else a new one.

        torch keeps at most ``prefetch_factor`` batches of one worker in flight, so a ring of
        ``prefetch_factor + 2`` segments normally suffices; more are made only while the main
        process holds handles it has not decoded yet (it is shutting down, say). A worker
        never waits here, so it always gets back to torch's loop and its shutdown signals.
        """
        for sid, seg in self.segments.items():
            if seg.capacity >= nbytes and seg.try_claim():
                return sid, seg
        # Free segments that are too small, or beyond the ring's size, are retired.
        idle = [sid for sid, seg in self.segments.items() if not seg.in_flight]
        for sid in idle:
            seg = self.segments[sid]
            if seg.capacity < nbytes or len(self.segments) >= self.limit:
                del self.segments[sid]
                self.retired.append(sid)
        return self._create(nbytes)

    def _create(self, nbytes: int) -> tuple[int, WorkerSegment]:
        capacity = -(-int(max(nbytes, 1) * _GROWTH) // _GRANULE) * _GRANULE
        seg = WorkerSegment(capacity)
        sid = self.next_id
        self.next_id += 1
        self.segments[sid] = seg
        if not seg.try_claim():  # a fresh segment is always free
            raise RuntimeError("a new segment could not be claimed")
        return sid, seg

    def take_retired(self) -> tuple[int, ...]:
        out = tuple(self.retired)
        self.retired.clear()
        return out


_RINGS: dict[tuple[int, str], _Ring] = {}
_RINGS_LOCK = threading.Lock()


def ring_for(token: str, limit: int) -> _Ring:
    """This process's ring for the loader ``token`` (made on first use, per process)."""
    key = (os.getpid(), token)
    with _RINGS_LOCK:
        ring = _RINGS.get(key)
        if ring is None:
            ring = _Ring(limit=limit)
            _RINGS[key] = ring
        return ring


class BatchHandle:
    """What a worker sends instead of a batch: the tree, the leaf specs, the segment's name.

    torch's pin-memory thread calls :meth:`pin_memory`, which copies the batch into a pinned
    slot (in the main process, without the GIL) and returns it.
    """

    __slots__ = (
        "_error",
        "_live",
        "count",
        "first",
        "nbytes",
        "nonce",
        "origin",
        "retired",
        "segment",
        "specs",
        "token",
        "total_len",
        "tree",
        "unused",
        "worker",
    )

    def __init__(
        self,
        token: str,
        worker: int,
        segment: int,
        origin: tuple[int, int] | None,
        total_len: int,
        nonce: int,
        retired: tuple[int, ...],
        p: _codec.Plan,
        unused: tuple[int, int, int] | None = None,
        count: int | None = None,
    ) -> None:
        self.token = token
        self.worker = worker
        self.segment = segment
        self.origin = origin
        self.first = origin is not None
        self.total_len = total_len
        self.nonce = nonce
        self.retired = retired
        self.tree = p.tree
        self.specs = [tuple(s) for s in p.specs]
        self.nbytes = p.nbytes
        self.unused = unused  # (index, generation, nonce) of a zero-copy slot not used
        self.count = count  # samples in the batch, when known
        self._live = False
        self._error: BaseException | None = None

    #: What travels between processes, in order.
    _STATE = (
        "token",
        "worker",
        "segment",
        "origin",
        "total_len",
        "nonce",
        "retired",
        "tree",
        "specs",
        "nbytes",
        "unused",
        "count",
    )

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._STATE)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for name, value in zip(self._STATE, state, strict=True):
            setattr(self, name, value)
        self.first = self.origin is not None
        self._error = None
        self._live = False
        # Unpickled in the main process: take hold of the segment now, while its worker is
        # certainly alive and holding it. pinpool's own errors surface when the batch is
        # decoded, in its turn; any other exception (torch's SIGCHLD handler raising that a
        # worker died, an interrupt) goes on to torch at once, so torch can act on it.
        try:
            decoder = _registry.lookup(self.token)
            decoder.receive(self)
            self._live = True
        except PinPoolError as exc:
            # Without its traceback, which would keep this frame (and torch's iterator above
            # it) alive.
            exc.__traceback__ = exc.__context__ = exc.__cause__ = None
            self._error = exc

    @property
    def key(self) -> tuple[int, int]:
        return (self.worker, self.segment)

    def pin_memory(self) -> Any:
        """torch's pin thread: decode now if a slot is at hand, else leave it for later."""
        return self.decode(ahead=True)

    def decode(self, ahead: bool = False) -> Any:
        if self._error is not None:
            # A copy: the traceback it gets refers to this frame, whose ``self`` must not
            # refer back to it (that cycle would keep torch's iterator, and its workers,
            # alive until the garbage collector runs).
            raise copy.copy(self._error)
        return _registry.lookup(self.token).decode(self, ahead)

    def __del__(self) -> None:
        # (At interpreter exit a module's globals may already be gone.)
        if getattr(self, "_live", False) and _registry is not None:
            decoder = _registry.lookup_or_none(self.token)
            if decoder is not None:
                decoder.discard(self)


def _handle(
    token: str,
    ring: _Ring,
    sid: int,
    seg: WorkerSegment,
    p: _codec.Plan,
    unused: tuple[int, int, int] | None,
    count: int | None,
) -> BatchHandle:
    """The handle of a batch written into segment ``sid`` of ``ring``."""
    origin = None
    if sid not in ring.announced:
        origin = (os.getpid(), seg.fd)
        ring.announced.add(sid)
    retired = ring.take_retired()
    return BatchHandle(
        token, ring.key, sid, origin, seg.total_len, seg.nonce, retired, p, unused, count
    )


def encode_in_worker(
    token: str,
    limit: int,
    batch: Any,
    p: _codec.Plan | None = None,
    unused: tuple[int, int, int] | None = None,
    count: int | None = None,
    threads: int = 1,
) -> BatchHandle:
    """Writes ``batch`` (planned as ``p``, if given) into one of this worker's segments and
    returns its handle; ``unused`` names a zero-copy slot the main process should take back;
    ``count`` is the number of samples, when known (it helps size the slots); big arrays are
    copied with ``threads`` threads."""
    if p is None:
        p = _codec.plan(batch)
    ring = ring_for(token, limit)
    sid, seg = ring.acquire(p.nbytes)
    try:
        _codec.write(p, seg, threads)
    except BaseException:
        seg.unclaim()
        raise
    return _handle(token, ring, sid, seg, p, unused, count)


#: Room a streamed batch's segment gets after its big arrays, for the rest of the batch.
_STREAM_SPARE = 1 << 20


def _release(view: memoryview) -> None:
    try:
        view.release()
    except BufferError:  # a view is still held (by a traceback): it goes when that does
        pass


def encode_streaming(
    token: str, limit: int, samples: LazySamples, threads: int = 1, keep_memory: bool = True
) -> BatchHandle | SlotHandle | list[Any]:
    """Makes the samples and collates them as torch's ``default_collate`` would, streaming
    their big arrays into the batch's place as each sample is made (see ``_stream``): the
    zero-copy slot of ``samples.ticket`` if they fit, else one of this worker's segments.

    Returns the batch's handle, or the samples themselves (made, in order) when the batch
    must be collated the ordinary way (no big arrays, or samples unlike the first)."""
    count = len(samples)
    rest = iter(samples)
    if count == 0:
        return []
    first = next(rest)
    layout = _stream.plan_layout(first, count)
    if layout is None:
        return [first, *rest]
    if keep_memory:
        keep_freed_memory(layout.nbytes)
    ticket = samples.ticket
    unused = None if ticket is None else (ticket.index, ticket.generation, ticket.nonce)
    ring = ring_for(token, limit)
    seg: WorkerSegment | None = None
    sid = -1
    whole: memoryview | None = None
    if ticket is not None and layout.nbytes <= ticket.nbytes:
        whole = memoryview(arena_for(ticket))
        mem = whole[ticket.offset : ticket.offset + ticket.nbytes]
    else:
        sid, seg = ring.acquire(layout.nbytes + _STREAM_SPARE)
        mem = memoryview(seg).cast("B")
    box = [first]
    del first  # the samples are freed as they are streamed
    try:
        batch, made = _stream.collate_streaming(_stream.owned(box, rest), layout, mem, threads)
        if batch is None:
            if seg is not None:
                seg.unclaim()
            assert made is not None
            return made
        p = _codec.plan(batch, start=layout.nbytes)
        if p.nbytes > len(mem):  # the rest of the batch does not fit: move to a bigger segment
            sid2, seg2 = ring.acquire(p.nbytes)
            mem2 = memoryview(seg2).cast("B")
            mem2[: layout.nbytes] = mem[: layout.nbytes]
            if seg is not None:
                seg.unclaim()
            _release(mem)
            sid, seg, mem = sid2, seg2, mem2
        _codec.write(p, mem, threads)
    except BaseException:
        if seg is not None:
            seg.unclaim()
        raise
    finally:
        _release(mem)
        if whole is not None:
            _release(whole)
    if seg is None:
        assert ticket is not None
        return SlotHandle(token, ticket, p)
    return _handle(token, ring, sid, seg, p, unused, count)
