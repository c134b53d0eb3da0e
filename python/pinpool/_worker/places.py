"""Where a worker writes a batch: the one choice between its zero-copy slot and a segment.

A batch whose indices came with a ticket (zero-copy mode) goes into that slot of the main
process's arena if it fits; otherwise (no ticket, or too large) into one of this worker's
segments, and the handle tells the main process to take the unused slot back.

Each worker keeps, per loader, a small ring of segments (sealed memfds, see
``src/transport/segment.rs``). A batch goes into a segment the main process has finished
with. The first time a segment is used, its handle says where the main process can open it
(``/proc/<worker pid>/fd/<fd>``, checked against a random nonce in its header). Segments too
small for a batch are retired: the worker drops its mapping and the next handle tells the
main process to drop its own.

Invariants: a worker never waits here (it always gets back to torch's loop and its shutdown
signals); a segment is written only while claimed, and a claimed segment is either sent (its
handle made) or unclaimed; the arena is mapped once per worker process.
"""

from __future__ import annotations

import mmap
import os
import random
import threading
from dataclasses import dataclass, field

from .._native import WorkerSegment
from .._wire import codec, peer
from .._wire.handle import BatchHandle, SlotTicket


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
        process holds handles it has not taken yet (it is shutting down, say)."""
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
        seg = WorkerSegment(codec.room_for(max(nbytes, 1)))
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
_ARENAS: dict[tuple[int, int, int, int], mmap.mmap] = {}
_LOCK = threading.Lock()


def ring_for(token: str, limit: int) -> _Ring:
    """This process's ring for the loader ``token`` (made on first use, per process)."""
    key = (os.getpid(), token)
    with _LOCK:
        ring = _RINGS.get(key)
        if ring is None:
            ring = _RINGS[key] = _Ring(limit=limit)
        return ring


def arena_for(ticket: SlotTicket) -> mmap.mmap:
    """This worker's mapping of the part of the main process's arena holding the ticket's
    slot."""
    key = (os.getpid(), ticket.arena_pid, ticket.arena_fd, ticket.arena_len)
    with _LOCK:
        mapped = _ARENAS.get(key)
        if mapped is None:
            fd = peer.open_fd_of(ticket.arena_pid, ticket.arena_fd)
            try:
                if os.fstat(fd).st_size != ticket.arena_len:
                    raise RuntimeError("the arena behind the ticket has an unexpected size")
                # Populate the page tables now, once, rather than fault on every first write
                # into each slot (costly under a hypervisor).
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mapped = mmap.mmap(fd, ticket.arena_len, flags)
            finally:
                os.close(fd)
            _ARENAS[key] = mapped
        return mapped


def _release(view: memoryview) -> None:
    try:
        view.release()
    except BufferError:  # a view is still held (by a traceback): it goes when that does
        pass


class Place:
    """The memory one batch is written into, and the handle that names it.

    ``memory`` is a writable byte view of the ticket's slot or of a claimed segment. Exactly
    one of :meth:`send` and :meth:`abandon` ends a place's life."""

    def __init__(self, token: str, ring_size: int, ticket: SlotTicket | None, nbytes: int):
        self.token = token
        self.ring = ring_for(token, ring_size)
        self.ticket = ticket
        self._arena: memoryview | None = None
        self.segment: WorkerSegment | None = None
        self.sid = -1
        if ticket is not None and nbytes <= ticket.nbytes:
            self._arena = memoryview(arena_for(ticket))
            self.memory = self._arena[ticket.offset : ticket.offset + ticket.nbytes]
        else:
            self.sid, self.segment = self.ring.acquire(nbytes)
            self.memory = memoryview(self.segment).cast("B")

    def grow(self, nbytes: int, keep: int) -> None:
        """Moves to a segment with room for ``nbytes``, with the first ``keep`` bytes written
        so far (the rest of a streamed batch did not fit)."""
        sid, seg = self.ring.acquire(nbytes)
        memory = memoryview(seg).cast("B")
        memory[:keep] = self.memory[:keep]
        self._let_go()
        self.sid, self.segment, self.memory = sid, seg, memory

    def send(self, p: codec.Plan, count: int | None) -> BatchHandle:
        """The handle of the batch planned as ``p``, now written here."""
        segment, sid, ring = self.segment, self.sid, self.ring
        claim = None if self.ticket is None else self.ticket.claim
        self._drop_views()
        if segment is None:
            assert claim is not None
            return BatchHandle(self.token, p, count, slot=claim)
        origin = None
        if sid not in ring.announced:
            origin = (os.getpid(), segment.fd)
            ring.announced.add(sid)
        return BatchHandle(
            self.token,
            p,
            count,
            worker=ring.key,
            segment=sid,
            origin=origin,
            total_len=segment.total_len,
            nonce=segment.nonce,
            retired=ring.take_retired(),
            unused=claim,
        )

    def abandon(self) -> None:
        """Nothing is sent: the segment goes back to the ring (a zero-copy slot is taken back
        by the main process when the iterator ends)."""
        self._let_go()

    def _let_go(self) -> None:
        if self.segment is not None:
            self.segment.unclaim()
            self.segment = None
        self._drop_views()

    def _drop_views(self) -> None:
        _release(self.memory)
        if self._arena is not None:
            _release(self._arena)
            self._arena = None


def write(
    token: str,
    ring_size: int,
    p: codec.Plan,
    ticket: SlotTicket | None,
    count: int | None,
    threads: int = 1,
) -> BatchHandle:
    """Writes the batch planned as ``p`` into its place (the ticket's slot if it fits, else a
    segment; big arrays copied with ``threads`` threads) and returns its handle. A batch
    without arrays and without a ticket needs no place: its handle carries it whole (and the
    main process makes no pool for it)."""
    if not p.specs and ticket is None:
        return BatchHandle(token, p, count)
    place = Place(token, ring_size, ticket, p.nbytes)
    try:
        codec.write(p, place.memory, threads)
    except BaseException:
        place.abandon()
        raise
    return place.send(p, count)
