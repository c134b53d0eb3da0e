"""Where a worker writes a batch (its :class:`Destination`): the one choice between a slot
granted to it (zero-copy) and one of its segments.

A batch whose indices came with a zero-copy task asks the main process for a slot of exactly
its size once that is known (``desk``) and goes into the slot granted; otherwise (no task, or
no grant) into one of this worker's segments. A streamed batch whose rest outgrows its slot
moves to a segment, and its handle tells the main process to take the unused slot back.

Each worker keeps, per loader, a small ring of segments (sealed memfds, see
``src/transport/segment/``). A batch goes into a segment the main process has finished
with. The first time a segment is used, its handle says where the main process can open it
(``/proc/<worker pid>/fd/<fd>``, checked against a random nonce in its header). Segments too
small for a batch are retired: the worker drops its mapping and the next handle tells the
main process to drop its own.

A granted slot is written through a window onto the main process's arena, which the worker
keeps for its next batches (``windows``): open while the batch is written, made
inaccessible again before its handle is made (or the batch abandoned).

Invariants: a worker never waits here (it always gets back to torch's loop and its shutdown
signals); a segment is written only while a batch is in flight there, and that batch is
either sent (its handle made) or abandoned; a window is inaccessible again before the handle
of the batch written in it is made (``windows``); a slot opened keyed is touched only between
:meth:`Destination.allow` and :meth:`Destination.deny` (or the handle's making) on the writing
thread, and no code of the user's runs in between.
"""

from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass, field

import torch.utils.data

from .. import _trace
from .._native import ArenaWindow, WorkerSegment
from .._wire import codec
from .._wire.handle import BatchHandle, SlotGrant, ZeroCopyTask
from . import desk, windows


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
        """A segment with room for ``nbytes``, a batch begun in it: a free one, else a new one.

        torch keeps at most ``prefetch_factor`` batches of one worker in flight, so a ring of
        ``prefetch_factor + 2`` segments normally suffices; more are made only while the main
        process holds handles it has not taken yet (it is shutting down, say)."""
        for sid, seg in self.segments.items():
            if seg.capacity >= nbytes and seg.try_begin():
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
        if not seg.try_begin():  # a fresh segment is always free
            raise RuntimeError("no batch could begin in a new segment")
        return sid, seg

    def take_retired(self) -> tuple[int, ...]:
        out = tuple(self.retired)
        self.retired.clear()
        return out


_RINGS: dict[tuple[int, str], _Ring] = {}
_LOCK = threading.Lock()


def ring_for(token: str, limit: int) -> _Ring:
    """This process's ring for the loader ``token`` (made on first use, per process)."""
    key = (os.getpid(), token)
    with _LOCK:
        ring = _RINGS.get(key)
        if ring is None:
            ring = _RINGS[key] = _Ring(limit=limit)
        return ring


def _release(view: memoryview) -> None:
    try:
        view.release()
    except BufferError:  # a view is still held (by a traceback): it goes when that does
        pass


class Destination:
    """The memory one batch is written into, and the handle that names it.

    ``memory`` is a writable byte view of a granted slot (``nbytes``, for ``task``'s batch, from
    the grant desk ``desk_at``) or of a segment of its own (``segment_bytes``, if given, else
    ``nbytes``). Exactly one of :meth:`send` and :meth:`abandon` ends a destination's life."""

    def __init__(
        self,
        token: str,
        ring_size: int,
        nbytes: int,
        task: ZeroCopyTask | None = None,
        desk_at: tuple[bytes, int] | None = None,
        segment_bytes: int | None = None,
    ):
        t0 = _trace.on and _trace.now()
        self.token = token
        self.ring = ring_for(token, ring_size)
        self.desk_at = desk_at
        self.grant: SlotGrant | None = None
        self._window: ArenaWindow | None = None
        self._arena: memoryview | None = None
        self.segment: WorkerSegment | None = None
        self.sid = -1
        mapped = False
        if task is not None and desk_at is not None and nbytes > 0:
            t1 = _trace.on and _trace.now()
            self.grant = desk.ask(desk_at, task, _worker_id(), nbytes)
            if t1:
                _trace.span("worker.grant", t1, nbytes=nbytes, got=self.grant is not None)
        if self.grant is not None:
            try:
                self._window, at, mapped = windows.open_for(self.grant)
            except BaseException:
                desk.give_back(desk_at, self.grant)  # type: ignore[arg-type]
                raise
            self._arena = memoryview(self._window)
            self.memory = self._arena[at : at + self.grant.nbytes]
        else:
            self.sid, self.segment = self.ring.acquire(segment_bytes or nbytes)
            self.memory = memoryview(self.segment).cast("B")
        if t0:
            _trace.span(
                "worker.destination", t0, nbytes=nbytes, slot=self.segment is None, mapped=mapped
            )

    def allow(self) -> None:
        """From now on the calling thread may write (and read) the destination: a no-op but for a
        slot opened keyed (``windows``), whose access is this thread's switch."""
        if self._window is not None:
            self._window.allow()

    def deny(self) -> None:
        """The calling thread's access to a slot opened keyed is off again (while code of the
        caller's runs: a streamed batch's next sample being made)."""
        if self._window is not None:
            self._window.deny()

    def grow(self, nbytes: int, keep: int) -> None:
        """Moves to a segment with room for ``nbytes``, with the first ``keep`` bytes written
        so far (the rest of a streamed batch did not fit)."""
        sid, seg = self.ring.acquire(nbytes)
        memory = memoryview(seg).cast("B")
        memory[:keep] = self.memory[:keep]
        self._let_go()
        self.sid, self.segment, self.memory = sid, seg, memory

    def send(self, p: codec.LayoutPlan, count: int | None) -> BatchHandle:
        """The handle of the batch planned as ``p``, now written here."""
        segment, sid, ring = self.segment, self.sid, self.ring
        key = None if self.grant is None else self.grant.key
        self._drop_views()
        if segment is None:
            assert key is not None
            return BatchHandle(self.token, p, count, slot=key)
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
            unused=key,
        )

    def abandon(self) -> None:
        """Nothing is sent: the segment goes back to the ring, a granted slot to the main
        process."""
        grant, self.grant = self.grant, None
        self._let_go()
        if grant is not None and self.desk_at is not None:
            desk.give_back(self.desk_at, grant)

    def _let_go(self) -> None:
        if self.segment is not None:
            self.segment.abandon()
            self.segment = None
        self._drop_views()

    def _drop_views(self) -> None:
        _release(self.memory)
        if self._arena is not None:
            _release(self._arena)
            self._arena = None
        if self._window is not None:
            window, self._window = self._window, None
            windows.close(window)


def write(
    token: str,
    ring_size: int,
    p: codec.LayoutPlan,
    task: ZeroCopyTask | None,
    desk_at: tuple[bytes, int] | None,
    count: int | None,
    threads: int = 1,
) -> BatchHandle:
    """Writes the batch planned as ``p`` into its destination (a slot granted for ``task``'s batch,
    else a segment; big arrays copied with ``threads`` threads) and returns its handle. A batch
    without arrays needs no destination: its handle carries it whole (and the main process makes no
    pool for it)."""
    if not p.specs:
        return BatchHandle(token, p, count)
    dest = Destination(token, ring_size, p.nbytes, task, desk_at)
    try:
        dest.allow()
        t0 = _trace.on and _trace.now()
        codec.write(p, dest.memory, threads)
        if t0:
            _trace.span("worker.write", t0, nbytes=p.nbytes)
    except BaseException:
        dest.abandon()
        raise
    return dest.send(p, count)


def _worker_id() -> int:
    """torch's id of this worker (0 outside a worker)."""
    info = torch.utils.data.get_worker_info()
    return info.id if info is not None else 0
