"""Zero-copy mode, the main process's half: slots handed out with the indices.

The arena is shared memory: a few memfds back to back (``cuda-register`` or ``host``
backend). As torch puts the next batch's indices on the chosen worker's queue
(``index_queue.DirectQueue``; where the queues are not those, when torch asks the sampler for
them), :class:`ReservingSampler` checks a slot out (without waiting: the asking thread is the
consumer), sized before the batch exists from the recent batches' sizes
(``sizing.reservation_bytes``), preferably where that worker's last slots were (it keeps
windows on them: ``_worker.windows``; a fresh worker is told with its first slot where its next
ones will likely be, to map them ahead: its predecessor's slots, or its share of the arena's
slot places, :func:`planned`), and tags the index list with a
:class:`~pinpool._wire.handle.SlotReservation`: the slot's place in shared memory and a random
nonce. A batch that turns out larger goes through its worker's segment (counted).
The worker writes the batch into that slot (``pinpool._worker.places``) and
its handle names the slot; :meth:`Reservations.adopt` gives the slot back to the receiver only if
it was handed out for that batch (index, generation and nonce).

Batches under ``ONLY_KEPT_FROM`` whose indices go through a ``DirectQueue`` get their slot off
the consumer's thread: the task is tagged with a :class:`~pinpool._wire.handle.PendingTicket`
(:meth:`Reservations.ticket_for`) and the queue's writer thread, in Rust and without the GIL,
checks the slot out (preferring that worker's last slots) and writes its ticket into the
message (``pinpool._native.Tickets``); those slots are in the pool's table of tickets, which
``adopt``, ``take_back`` and ``drop`` consult as they do the slots handed out here.

Invariants: a slot is in the table from the moment it is handed out until its batch adopts
it, its batch turns out not to use it (:meth:`Reservations.take_back`), or the iterator that handed
it out ends (:meth:`Reservations.drop`, once no worker that got it can write any more); the table
holds the slot object, so the pool cannot hand it out again meanwhile.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .._errors import OutOfBounds, PinPoolError
from .._native import PinPool, Slot, Tickets, page_size
from .._wire.handle import (
    WINDOW_BYTES_KEPT,
    WINDOWS_KEPT,
    PendingTicket,
    SlotReservation,
    TaggedIndices,
    WindowHint,
    windows_kept,
)

#: What the index queue needs to have a task's slot checked out by its writer thread: the
#: pool's tickets, the request ``(owner, worker, nbytes, keep)`` and the task's placeholder.
TicketOrder = tuple[Tickets, tuple[int, int, int, int], PendingTicket]

#: Reservations of at least this many bytes go only where the worker has a window already,
#: once it keeps as many as it may (see :meth:`Reservations.reserve`); smaller ones may go
#: anywhere (a new window of a few MiB costs the worker well under a millisecond).
ONLY_KEPT_FROM = 8 << 20


class Reservations:
    """The slots handed out with batch indices: (index, generation) -> (slot, nonce, owner)."""

    def __init__(self) -> None:
        self._reserved: dict[tuple[int, int], tuple[Slot, int, int]] = {}
        self._lock = threading.Lock()
        self.fallbacks = 0  # batches sent through copy mode for want of a slot
        self.too_small = 0  # batches larger than their reservation, sent through copy mode
        #: Per (sampler, worker), the arena offsets of the worker's last slots (as many as
        #: ``handle.windows_kept`` of their size: those it keeps mapped, ``_worker.windows``),
        #: the latest first. Per sampler: each iterator has its own, and a new iterator's
        #: workers are new processes, which have mapped nothing yet (persistent workers keep
        #: their iterator).
        self._recent: dict[tuple[int, int], list[int]] = {}
        #: Per worker id, across iterators, where that worker's last slots were: (arena
        #: offset, hint), the latest first, in the pool of id ``_last_pool``. A new
        #: iterator's worker of the same id is offered those slots first, and told of them
        #: with its first reservation (``SlotReservation.ahead``), so that it maps them ahead
        #: while it collates: with big batches and few workers, each fresh worker's first
        #: windows cost it more than the copy mode's whole batch (``docs/performance.md``).
        self._last: dict[int, list[tuple[int, WindowHint]]] = {}
        self._last_pool: int | None = None  # (an id: the table must not keep a pool alive)
        #: Per (sampler, worker), the hinted offsets (``_last``'s, sent with its first
        #: reservation), offered after those in ``_recent``.
        self._hinted: dict[tuple[int, int], list[int]] = {}
        #: The current pool's table of tickets (the pool, the table, its placeholder), and
        #: those of earlier pools, whose tickets may still be out.
        self._tickets: tuple[PinPool, Tickets, PendingTicket] | None = None
        self._old_tickets: list[Tickets] = []

    @property
    def no_ticket(self) -> int:
        """Batches sent through copy mode for want of a slot, here and by the tickets."""
        return self.fallbacks + sum(t.fallbacks for t in self._ticket_tables())

    def _ticket_tables(self) -> list[Tickets]:
        current = self._tickets
        return ([current[1]] if current is not None else []) + self._old_tickets

    def ticket_for(
        self, pool: PinPool, owner: int, nbytes: int, reserve: int, worker: int
    ) -> TicketOrder | None:
        """The order for a slot of ``nbytes`` that the index queue's writer thread is to
        check out for worker ``worker`` of sampler ``owner`` (leaving ``reserve`` bytes free);
        None where the slot is to be reserved here (big batches: their windows follow the
        rules of :meth:`reserve`) or the pool is closed."""
        if nbytes >= ONLY_KEPT_FROM:
            return None
        current = self._tickets
        if current is None or current[0] is not pool:
            try:
                tickets = pool.tickets(WINDOWS_KEPT, WINDOW_BYTES_KEPT)
            except PinPoolError:
                return None  # (closed)
            current = (pool, tickets, PendingTicket(tickets.placeholder))
            with self._lock:
                if self._tickets is not None:
                    self._old_tickets.append(self._tickets[1])
                self._tickets = current
        return (current[1], (owner, worker, nbytes, reserve), current[2])

    def _remember(self, key: tuple[int, int], offset: int, kept: int) -> None:  # (locked)
        recent = self._recent.get(key)
        if recent is None:
            recent = self._recent[key] = []
        elif offset in recent:
            recent.remove(offset)
        recent.insert(0, offset)
        del recent[kept:]

    def reserve(
        self,
        pool: PinPool | None,
        owner: int,
        nbytes: int,
        reserve: int,
        worker: int | None = None,
    ) -> SlotReservation | None:
        """Checks out a slot of ``nbytes`` for a batch about to be dispatched by sampler
        ``owner`` (never waits: this runs on the consumer's thread, once a batch: kept lean);
        for worker ``worker``, preferably where that worker's last few slots were (memory it
        has mapped already). None sends the batch through copy mode."""
        if pool is None:
            self.fallbacks += 1
            return None
        key = (owner, worker) if worker is not None else None
        big = nbytes >= ONLY_KEPT_FROM
        seeds: list[tuple[int, WindowHint]] = []
        prefer: list[int] | None = None
        recent: list[int] | None = None
        kept = -1  # (how many windows the worker keeps, as far as is known: -1 for none)
        with self._lock:  # (an ended iterator's are dropped on the ending thread)
            if key is not None:
                recent = self._recent.get(key)
                kept = len(recent) if recent else 0
                prefer = list(recent) if recent else None
                if big and not recent and self._last_pool == id(pool):
                    # (Big batches only: a small window costs a fresh worker little to fault in.)
                    seeds = list(self._last.get(worker, ()))
                hinted = self._hinted.get(key) if self._hinted else None
                if hinted:
                    prefer = (prefer or []) + [at for at in hinted if at not in (recent or ())]
        if worker is not None and not recent and not seeds:
            seeds = planned(pool, worker, nbytes)  # (no predecessor: the loader's first epoch)
        if seeds and not prefer:
            prefer = [at for at, _ in seeds]
        # A worker that keeps as many windows as it may gets a big batch's slot only where one
        # of them is: mapping (and faulting in) a new one, and dropping an old one, costs it
        # more than the main process's copy of the batch out of its segment.
        only = big and kept >= windows_kept(nbytes)
        # ``reserve`` leaves room for a batch that comes through copy mode (the first ones, and
        # any too large for its reservation): it needs a slot when it arrives, and
        # reservations must not starve it.
        slot = pool.try_checkout(nbytes, reserve=reserve, prefer=prefer, prefer_only=only)
        where = pool.slot_place(slot) if slot is not None else None
        if slot is None or where is None:
            self.fallbacks += 1
            return None  # (a slot checked out above returns to the pool as it dies here)
        fd, offset, part_len, ino = where
        if seeds and worker is not None and slot.nbytes != seeds[0][1].nbytes:
            seeds = planned(pool, worker, slot.nbytes)  # (the slot was rounded up)
        nonce = random.getrandbits(63)
        at = slot.offset
        reservation = SlotReservation(
            slot.index, slot.generation, nonce, offset, slot.nbytes, os.getpid(), fd, part_len, ino
        )
        with self._lock:
            if key is not None and worker is not None:
                if seeds:
                    # Offered next, after the slots this worker has had; not counted as its
                    # windows (``only`` above) until it has had them: a busy one would send
                    # a fresh worker's batch through copy mode, and a new segment of its own.
                    self._hinted[key] = [o for o, _ in seeds if o != at]
                self._remember(key, at, windows_kept(slot.nbytes))
                if big:  # (the only ones a later worker is told of)
                    self._note_last(pool, worker, at, reservation.hint)
            self._reserved[(slot.index, slot.generation)] = (slot, nonce, owner)
        if not seeds:
            return reservation
        ahead = tuple(hint for o, hint in seeds if o != at)
        return reservation._replace(ahead=ahead) if ahead else reservation

    def _note_last(self, pool: PinPool, worker: int, at: int, hint: WindowHint) -> None:  # (locked)
        if self._last_pool != id(pool):
            self._last.clear()  # (another pool's offsets name other memory)
            self._last_pool = id(pool)
        last = [(o, h) for o, h in self._last.get(worker, ()) if o != at]
        last.insert(0, (at, hint))
        self._last[worker] = last[: windows_kept(hint.nbytes)]

    def adopt(self, claim: Any) -> Slot:
        """The slot a worker wrote a batch into, if ``claim`` (index, generation, nonce) is
        one handed out for it; it leaves the table."""
        try:
            index, generation, nonce = (int(x) for x in claim)
        except (TypeError, ValueError, OverflowError) as exc:
            raise OutOfBounds(f"corrupt batch handle: slot {claim!r}: {exc}") from None
        with self._lock:
            entry = self._reserved.get((index, generation))
            if entry is not None and entry[1] == nonce:
                del self._reserved[(index, generation)]
                return entry[0]
            tables = self._ticket_tables()
        for tickets in tables:
            slot = tickets.adopt(index, generation, nonce)
            if slot is not None:
                return slot
        raise PinPoolError(
            f"a batch claims slot {(index, generation)}, which was not handed out for it"
        )

    def take_back(self, claim: Any) -> None:
        """Takes back a slot handed out (or issued by a writer thread) for a batch that will not
        arrive in it."""
        if not (isinstance(claim, tuple) and len(claim) == 3):
            return  # (a corrupt handle's claim: never handed out)
        if not all(type(x) is int for x in claim):
            return
        index, generation, nonce = claim
        with self._lock:
            entry = self._reserved.get((index, generation))
            if entry is not None and entry[1] == nonce:
                del self._reserved[(index, generation)]
                return
            tables = self._ticket_tables()
        for tickets in tables:
            if tickets.take_back(index, generation, nonce):
                return

    def drop(self, owner: int | None = None) -> None:
        """Takes back the slots handed out by sampler ``owner`` (all with None), once no
        worker that got them can write any more."""
        with self._lock:
            for key in [k for k, v in self._reserved.items() if owner in (None, v[2])]:
                del self._reserved[key]
            for recent in [k for k in self._recent if owner in (None, k[0])]:
                del self._recent[recent]
            for hinted in [k for k in self._hinted if owner in (None, k[0])]:
                del self._hinted[hinted]
            tables = self._ticket_tables()
            if owner is None:
                self._last.clear()
                self._last_pool = None
                self._tickets = None
                self._old_tickets = []
                self.fallbacks += sum(t.fallbacks for t in tables)  # (still counted after)
        for tickets in tables:
            tickets.drop(owner)


#: How many slots a fresh worker with no predecessor is told of ahead as its own (its first
#: included): its share of the arena's slot places.
PLANNED_SLOTS = 4
#: And how many more, after those: the last places of the next worker's share, where its
#: batch goes when all of its own are busy (in flight, held by the consumer, or fenced behind
#: the consumer's stream), so that it finds that window mapped ahead too instead of faulting a
#: new one in on its own path (43 and 53 ms at 268 MB on the H200, ``docs/performance.md``).
SPARE_SLOTS = 1


def planned(pool: PinPool, worker: int, nbytes: int) -> list[tuple[int, WindowHint]]:
    """Where a fresh worker's first big slots will be, when no worker of its id came before
    it, as (arena offset, hint): worker ``worker``'s share of the arena's slot-sized places
    (``PLANNED_SLOTS`` of them, the ``worker``-th ones) then ``SPARE_SLOTS`` of the next
    worker's, its last; at most as many in all as the worker keeps windows of, and none for
    batches under ``ONLY_KEPT_FROM`` (a new small window costs the worker little) or without
    memfd parts."""
    if nbytes < ONLY_KEPT_FROM:
        return []
    step = nbytes + -nbytes % page_size()
    places: list[tuple[int, WindowHint]] = []
    for fd, start, length in pool.memfd_parts():
        ino = os.fstat(fd).st_ino
        for at in range(0, length - step + 1, step):
            places.append((start + at, WindowHint(at, step, os.getpid(), fd, length, ino)))
    n = len(places)
    told = min(PLANNED_SLOTS + SPARE_SLOTS, windows_kept(step), n)
    own = min(PLANNED_SLOTS, told)
    first = worker * PLANNED_SLOTS
    picks = [first + i for i in range(own)]
    picks += [first + 2 * PLANNED_SLOTS - 1 - i for i in range(told - own)]
    chosen: list[int] = []
    for i in picks:  # (with few places, the spare may be one of its own)
        if i % n not in chosen:
            chosen.append(i % n)
    return [places[i] for i in chosen]


_END = object()


class ReservingSampler:
    """Wraps torch's batch sampler: tags each index list with a freshly checked-out slot.

    torch keeps one per iterator; ``owner`` names the slots it handed out, so that iterator's
    end takes back its own and no other's.

    The slot is checked out as torch asks for the indices, before it picks the worker; or,
    with ``at_put`` (set by the workers' iterator when every index queue is a
    ``index_queue.DirectQueue``), as the indices are put on the chosen worker's queue
    (:meth:`reserve_at_put`), so that the worker can be handed memory it has mapped before.
    """

    _next_owner = itertools.count(1)

    def __init__(
        self,
        base: Any,
        reserve: Callable[[int, int | None], SlotReservation | None],
        order: Callable[[int, int], TicketOrder | None] | None = None,
    ) -> None:
        self.base = base
        self.reserve = reserve
        self.order = order
        self.owner = next(ReservingSampler._next_owner)
        self.at_put = False

    def __iter__(self) -> Iterator[TaggedIndices]:
        return self._tagged(iter(self.base))  # iter() now, when torch calls it, as torch would

    def _tagged(self, it: Iterator[Any]) -> Iterator[TaggedIndices]:
        # (not ``for indices in it``: that calls iter() on it again, which restarts a sampler
        # whose iter() returns itself)
        while (indices := next(it, _END)) is not _END:
            if self.at_put:
                yield TaggedIndices(indices, None)  # (reserve_at_put tags it)
            else:
                yield TaggedIndices(indices, self.reserve(self.owner, None))

    def reserve_at_put(self, task: TaggedIndices, worker: int) -> TicketOrder | None:
        """Tags ``task`` (this sampler's, about to be put on worker ``worker``'s queue) with a
        slot, preferably one that worker had before; or, with ``order``, with a pending
        ticket, and returns the order the queue's writer thread carries out."""
        if self.at_put and task.reservation is None:
            if self.order is not None:
                order = self.order(self.owner, worker)
                if order is not None:
                    task.reservation = order[2]
                    return order
            task.reservation = self.reserve(self.owner, worker)
        return None

    def __len__(self) -> int:
        return len(self.base)
