"""Zero-copy mode: workers collate straight into the pinned arena.

The arena is shared memory: a few memfds back to back (``cuda-register`` or ``host``
backend). When torch asks the sampler for the next batch's indices, :class:`TicketSampler`
checks a slot out (without waiting: the asking thread is the consumer) and tags the index
list with a :class:`SlotTicket`: the slot's place in shared memory and a random nonce.
:class:`~pinpool._stream.StreamingDataset` carries the ticket from the indices to the
samples, so the worker's collate sees it; the worker maps the memfd holding that slot
(opening the main process's fd through ``/proc``, once), writes the batch into that slot,
and sends a :class:`SlotHandle`: the marked tree, the leaf specs, and the ticket. The main
process checks that the ticket is one it handed out (index, generation and nonce) and that
every leaf lies inside that slot, then builds views: no copy, no segment, nothing to unmap.

A batch with no ticket (no free slot at dispatch, or the pool not made yet) or too large for
its slot goes through copy mode instead; the unused ticket's slot is returned.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from typing import Any, NamedTuple

from . import _codec, _registry


class SlotTicket(NamedTuple):
    """A slot handed to the worker that will collate one batch."""

    index: int
    generation: int
    nonce: int
    offset: int  # of the slot in its memfd, bytes
    nbytes: int  # slot size
    arena_pid: int  # the process whose fd this is
    arena_fd: int  # the memfd (one part of the arena) holding the slot
    arena_len: int  # that memfd's length


class TaggedIndices(list):  # type: ignore[type-arg]
    """A batch's indices, with the slot its batch should land in (or None)."""

    ticket: SlotTicket | None

    def __init__(self, indices: Any, ticket: SlotTicket | None) -> None:
        super().__init__(indices)
        self.ticket = ticket


class TaggedSamples(list):  # type: ignore[type-arg]
    """A batch's samples, as a dataset's own ``__getitems__`` made them, with the slot from
    their indices."""

    ticket: SlotTicket | None

    def __init__(self, samples: Any, ticket: SlotTicket | None) -> None:
        super().__init__(samples)
        self.ticket = ticket


class TaggedBatch:
    """Whatever else a dataset's own ``__getitems__`` returned (a whole batch: a dict, a
    tensor; torch hands it to collate unchanged), with the slot from its indices."""

    __slots__ = ("made", "ticket")

    def __init__(self, made: Any, ticket: SlotTicket | None) -> None:
        self.made = made
        self.ticket = ticket


class TicketSampler:
    """Wraps torch's batch sampler: tags each index list with a freshly checked-out slot.

    torch keeps one per iterator; ``owner`` names the slots it handed out, so that iterator's
    end takes back its own and no other's.
    """

    _next_owner = itertools.count(1)

    def __init__(self, base: Any, assign: Any) -> None:
        self.base = base
        self.assign = assign
        self.owner = next(TicketSampler._next_owner)

    def __iter__(self) -> Any:
        for indices in self.base:
            yield TaggedIndices(indices, self.assign(self.owner))

    def __len__(self) -> int:
        return len(self.base)


# -- worker side -----------------------------------------------------------------------------

_ARENAS: dict[tuple[int, int, int, int], mmap.mmap] = {}
_ARENAS_LOCK = threading.Lock()


def arena_for(ticket: SlotTicket) -> mmap.mmap:
    """This worker's mapping of the main process's arena."""
    key = (os.getpid(), ticket.arena_pid, ticket.arena_fd, ticket.arena_len)
    with _ARENAS_LOCK:
        mapped = _ARENAS.get(key)
        if mapped is None:
            fd = os.open(f"/proc/{ticket.arena_pid}/fd/{ticket.arena_fd}", os.O_RDWR | os.O_CLOEXEC)
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


class SlotHandle:
    """What a worker sends after writing a batch into its slot."""

    __slots__ = ("_live", "generation", "index", "nbytes", "nonce", "specs", "token", "tree")

    def __init__(self, token: str, ticket: SlotTicket, p: _codec.Plan) -> None:
        self.token = token
        self.index = ticket.index
        self.generation = ticket.generation
        self.nonce = ticket.nonce
        self.tree = p.tree
        self.specs = [tuple(s) for s in p.specs]
        self.nbytes = p.nbytes
        self._live = False

    #: What travels between processes, in order.
    _STATE = ("token", "index", "generation", "nonce", "tree", "specs", "nbytes")

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._STATE)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for name, value in zip(self._STATE, state, strict=True):
            setattr(self, name, value)
        self._live = True  # unpickled in the main process: it names an assigned slot

    @property
    def key(self) -> tuple[int, int]:
        return (self.index, self.generation)

    def pin_memory(self) -> Any:
        return _registry.lookup(self.token).decode_slot(self)

    def __del__(self) -> None:
        # (At interpreter exit a module's globals may already be gone.)
        if getattr(self, "_live", False) and _registry is not None:
            decoder = _registry.lookup_or_none(self.token)
            if decoder is not None:
                decoder.unassign(self.key, self.nonce)


def write_into_slot(token: str, ticket: SlotTicket, p: _codec.Plan, threads: int = 1) -> SlotHandle:
    """Writes the planned batch into the ticket's slot of the shared arena (big arrays with
    ``threads`` copy threads)."""
    arena = arena_for(ticket)
    whole = memoryview(arena)
    try:
        region = whole[ticket.offset : ticket.offset + ticket.nbytes]
        _codec.write(p, region, threads)
        region.release()
    finally:
        whole.release()
    return SlotHandle(token, ticket, p)
