"""A batch handle from a worker, taken in: it becomes "this memory, these leaf specs, from this
source", or it is refused.

Three kinds of handle (``_wire.handle.BatchHandle``): one that carries its batch whole (no
arrays: :meth:`Intake.inline`); a zero-copy one, naming the slot the main process granted
for it (:meth:`Intake.adopt`: the slot is taken from the grants only if it was granted for
that batch); a copy-mode one, naming a worker's segment (:meth:`Intake.receive`:
the first time a segment is seen it is opened through ``/proc/<worker pid>/fd`` and checked
to be real, sealed, as long as told, its header intact, before what it tells sizes the pool;
:meth:`Intake.segment_specs`: its leaf specs, checked against the segment). :meth:`Intake.drop`
ends a handle's life: its segment goes back to its worker, a granted slot it did not use is
taken back.

Invariants: every field of a handle is checked before it is used, and what the rest of its
life uses are the checked values, not what was sent; a handle is taken or dropped at most
once (its ``_state`` goes to 0), and a taken or dropped handle's segment is handed back and
its unused slot taken back, whatever fails on the way; no segment is opened once the loader
is closed (nothing would retire it).
"""

from __future__ import annotations

import os

from ... import _trace
from ..._errors import OutOfBounds, PinPoolError, WorkerLost
from ..._native import SEGMENT_DATA_OFFSET, Slot, check_segment
from ..._wire import codec, leaves, peer
from ..._wire.handle import ARRIVED, HELD, BatchHandle
from .grants import LoaderGrants
from .lazy_pool import LazyPool


class Intake:
    """Checks the handles of one loader and takes hold of the memory they name."""

    def __init__(self, pools: LazyPool, grants: LoaderGrants | None) -> None:
        self.pools = pools
        self.grants = grants
        self.zero_copy_batches = 0
        # Worker key -> pid, for the workers whose segments are mapped here.
        self._worker_pids: dict[int, int] = {}
        # Segment key -> its checked length, for the segments mapped here: a later handle
        # naming the segment must name that length (the size of what it may claim).
        self._segment_lens: dict[tuple[int, int], int] = {}

    def inline(self, handle: BatchHandle) -> None:
        """A batch without arrays, carried whole by its handle: no memory, no pool."""
        handle._state = 0
        if handle.specs:
            raise OutOfBounds("corrupt batch handle: arrays, but no slot nor segment")

    def adopt(self, handle: BatchHandle) -> tuple[Slot | None, list[codec.LeafSpec], int]:
        """Zero-copy: the slot the worker wrote the batch into, checked."""
        if handle.segment is not None or handle.worker is not None:
            raise OutOfBounds("corrupt batch handle: it names both a slot and a segment")
        if self.grants is None:
            raise OutOfBounds("corrupt batch handle: a slot, but the loader grants none")
        slot = self.grants.adopt(handle.slot)
        specs = leaves.checked_specs(handle.specs, slot.nbytes)
        need = codec.extent(specs)
        self.pools.seen(need)
        self.zero_copy_batches += 1
        if need == 0:
            slot.release()
            return None, specs, 0
        return slot, specs, need

    def segment_specs(self, handle: BatchHandle) -> tuple[list[codec.LeafSpec], int]:
        """Copy mode: the leaf specs of a received handle, checked to lie in its segment, and
        the bytes they span."""
        limit = int(handle.total_len) - SEGMENT_DATA_OFFSET
        specs = leaves.checked_specs(handle.specs, limit)
        return specs, codec.extent(specs)

    def receive(self, handle: BatchHandle) -> None:
        """Checks the handle's segment fields and takes hold of its segment (opening and
        mapping it the first time it is seen)."""
        t0 = _trace.on and _trace.now()
        try:
            worker, segment = int(handle.worker), int(handle.segment)
            total_len, nonce = int(handle.total_len), int(handle.nonce)
            nbytes = int(handle.nbytes)
            count = None if handle.count is None else int(handle.count)
            first = handle.origin is not None
            pid, fd = (int(x) for x in handle.origin) if first else (0, 0)
            retired = tuple(int(sid) for sid in handle.retired)
            unused = None if handle.unused is None else tuple(int(x) for x in handle.unused)
        except (TypeError, ValueError, OverflowError) as exc:
            raise OutOfBounds(f"corrupt batch handle: {exc}") from None
        if self.pools.closed:
            raise PinPoolError("the loader was closed: its batches can no longer be taken")
        if not (
            0 <= worker < 1 << 64
            and 0 <= segment < 1 << 32
            and SEGMENT_DATA_OFFSET < total_len
            and 0 <= nonce < 1 << 64
            and 0 <= nbytes <= total_len - SEGMENT_DATA_OFFSET
            and (count is None or count > 0)  # (a dataset's __getitems__ may make more)
            and (not first or (0 < pid < 1 << 31 and 0 <= fd < 1 << 31))
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
        handle.total_len, handle.nbytes, handle.count = total_len, nbytes, count
        key = (worker, segment)
        if not first:
            # A segment mapped before: the pool exists, and copies are checked against the
            # real mapping, whatever the handle says.
            cache = self.pools.cache
            if cache is None or key not in cache:
                raise PinPoolError(f"segment {key} was never received by this process")
            if self._segment_lens.get(key) != total_len:
                raise OutOfBounds(
                    f"corrupt batch handle: segment {key} is not {total_len} bytes long"
                )
            handle._state = HELD
            if t0:
                _trace.span("batch.receive", t0, first=False)
            return
        try:
            own = peer.open_fd_of(pid, fd)
        except OSError as exc:
            if exc.errno in peer.OUT_OF_FDS:  # not a dead worker: say what to raise
                raise peer.out_of_fds(exc, pid) from None
            if not peer.alive(pid):
                raise WorkerLost(
                    f"DataLoader worker (pid {pid}) exited before the main process could "
                    "take its batch"
                ) from None
            raise OutOfBounds(f"corrupt batch handle: cannot open its segment: {exc}") from None
        try:
            # The segment is checked to be real before what it tells sizes the pool.
            check_segment(key, own, total_len, nonce)
            _, cache = self.pools.pool_for(nbytes)
        except BaseException:
            os.close(own)
            raise
        cache.insert(key, own, total_len, nonce)  # owns the fd from here
        self._segment_lens[key] = total_len
        self._worker_pids[worker] = pid
        handle._state = HELD
        if t0:
            _trace.span("batch.receive", t0, first=True)

    def receive_now(self, handle: BatchHandle) -> None:
        """Takes hold of a copy-mode handle's segment as the handle arrives, ahead of taking
        its batch (its worker may exit or die before the consumer reaches it). pinpool's own
        error is left for the take to raise, in turn (the handle stays as it came); any
        other exception (one a signal handler raised here: see ``pinpool._signals``) goes on
        at once."""
        if handle._state == ARRIVED and handle.slot is None and handle.segment is not None:
            try:
                self.receive(handle)
            except PinPoolError:
                pass

    def drop(self, handle: BatchHandle, handed_back: bool = False) -> None:
        """Ends the handle's life here: hands its segment back to its worker (unless a copy
        thread does, ``handed_back``), drops what the worker retired, takes back a zero-copy
        slot the batch did not use."""
        state, handle._state = handle._state, 0
        if not state:
            return
        if handle.slot is not None:
            if self.grants is not None:
                self.grants.take_back(handle.slot)  # (only if not adopted)
            return
        if state == ARRIVED:
            try:
                self.receive(handle)  # a segment first seen here must still go back
            except PinPoolError:
                return  # a corrupt handle, or a worker gone: nothing of it is held here
            handle._state = 0
        cache = self.pools.cache
        if cache is None:
            return
        try:
            if not handed_back:
                cache.hand_back((handle.worker, handle.segment))
        except PinPoolError:
            pass  # already retired with the whole worker
        for sid in handle.retired:
            cache.retire((handle.worker, sid))
            self._segment_lens.pop((handle.worker, sid), None)
        if handle.unused is not None and self.grants is not None:
            # A streamed batch whose rest outgrew its slot came through a segment instead.
            self.grants.outgrown += 1
            self.grants.take_back(handle.unused)

    def retire_segments(self, dead_only: bool = False) -> None:
        """Unmaps (on the reclaimer thread) the segments of workers that have exited (of every
        worker with ``dead_only=False``)."""
        cache = self.pools.cache
        if cache is None:
            return
        if not dead_only:
            cache.retire_all()
            self._worker_pids.clear()
            self._segment_lens.clear()
            return
        # (Also on the ending thread, after an ended epoch's workers exit: the consumer's
        # thread may retire every segment meanwhile, the loader being closed.)
        for worker, pid in list(self._worker_pids.items()):
            if not peer.alive(pid) and self._worker_pids.pop(worker, None) is not None:
                cache.retire_all(worker)
                for key in list(self._segment_lens):  # (a copy: other threads change it)
                    if key[0] == worker:
                        self._segment_lens.pop(key, None)
