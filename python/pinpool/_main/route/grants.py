"""Zero-copy mode, the main process's half: each batch's indices carry its task, and the worker
that collates the batch asks for a slot of exactly its size.

The arena is shared memory: a few memfds back to back (``cuda-register`` or ``host`` backend).
:class:`TaskTagger` wraps torch's batch sampler and tags each index list with a
:class:`~pinpool._wire.handle.ZeroCopyTask` (the iterator's owner number and the task's number
in it, torch's order of dispatch). The worker, once it knows its batch's size (collated, or
from its first streamed sample), asks the process's grant desk (``pinpool._native.Grants``, a
Rust thread, no GIL) and gets a slot of that size, where its last slots were if one is free, or
none (the batch then comes through its segment, copy mode). Its handle names the slot, and
:meth:`LoaderGrants.adopt` gives the slot to the receiver only if it was granted for that batch
(index, generation and nonce).

Why the batch the consumer waits for never waits on room held for batches behind it: room is
granted only to batches that exist, at their size, and never waited for; every grant but the
head's (the task the consumer waits for, :meth:`LoaderGrants.set_head`, told as each batch is
yielded) leaves a range of 1.5 times the largest batch so far free, which the head may take.

Invariants: a granted slot stays checked out until its batch adopts it, its worker gives it
back, or the iterator it was granted for ends (:meth:`LoaderGrants.close`, once no worker that got
it can write any more); only an open iterator's workers get grants (a task tagger opens its
iterator as torch starts it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from ..._errors import OutOfBounds, PinPoolError
from ..._native import Grants, PinPool, Slot
from ..._wire.handle import (
    WINDOW_BYTES_KEPT,
    WINDOWS_KEPT,
    SlotGrant,
    TaggedIndices,
    ZeroCopyTask,
    grant_from_words,
)

#: Batches of at least this many bytes are big: a fresh worker's first big grant names where
#: its next slots will likely be, for it to pre-map them, and a worker's last big slots are
#: offered first to the worker of the same id of the next iterator (a small window costs a
#: fresh worker little to fault in).
BIG_FROM = 8 << 20


class LoaderGrants:
    """A loader's zero-copy grants: its table at the process's grant desk, and its counts."""

    def __init__(self) -> None:
        self._grants = Grants(WINDOWS_KEPT, WINDOW_BYTES_KEPT, BIG_FROM)
        #: Streamed batches whose rest outgrew their slot and moved to a segment.
        self.outgrown = 0

    @property
    def desk(self) -> tuple[bytes, int] | None:
        """Where the workers ask: the desk's address and this loader's table there."""
        return self._grants.desk

    @property
    def told_likely(self) -> int:
        """Grants that named where the worker's next slots will likely be."""
        return self._grants.told_likely

    @property
    def outstanding(self) -> int:
        """Slots granted to workers and not yet adopted, given back or dropped."""
        return int(self._grants.outstanding)

    @property
    def no_grant(self) -> int:
        """Requests that got no slot (their batches came through copy mode)."""
        return self._grants.fallbacks

    def use_pool(self, pool: PinPool, largest: int) -> None:
        """Slots are granted from ``pool`` (the loader's, once made) from now on, for batches
        of up to ``largest`` bytes."""
        self._grants.use_pool(pool, largest)

    def pool_coming(self, coming: bool) -> None:
        """Whether the loader's pool is being made (a worker told its first batch's size): the
        workers' first requests wait for it rather than go without."""
        self._grants.pool_coming(coming)

    def issue(self, task: ZeroCopyTask, worker: int, nbytes: int) -> SlotGrant | None:
        """What the desk answers a worker's request now, without waiting for room on its way
        (tests: a worker's request goes through ``_worker.desk``)."""
        words = self._grants.issue(task.owner, worker, task.task, nbytes)
        return None if words is None else grant_from_words(tuple(words))

    def open(self, owner: int) -> None:
        """Iterator ``owner``'s workers may be granted slots; the consumer waits for task 0."""
        self._grants.open(owner)

    def set_head(self, owner: int, task: int) -> None:
        """Iterator ``owner``'s consumer waits for task ``task`` next."""
        self._grants.set_head(owner, task)

    def adopt(self, key: Any) -> Slot:
        """The slot a worker wrote a batch into, if ``key`` (index, generation, nonce) is one
        granted for it; it leaves the table."""
        try:
            index, generation, nonce = (int(x) for x in key)
        except (TypeError, ValueError, OverflowError) as exc:
            raise OutOfBounds(f"corrupt batch handle: slot {key!r}: {exc}") from None
        slot = self._grants.adopt(index, generation, nonce)
        if slot is None:
            raise PinPoolError(
                f"a batch names slot {(index, generation)}, which was not granted for it"
            )
        return slot

    def take_back(self, key: Any) -> None:
        """Takes back a slot granted for a batch that will not arrive in it."""
        if isinstance(key, tuple) and len(key) == 3 and all(type(x) is int for x in key):
            self._grants.give_back(*key)

    def stop(self, owner: int | None = None) -> None:
        """Stops iterator ``owner`` (every one, with None): no more grants for it, and its
        workers' requests waiting for room are answered at once (none of them is waited
        for); what was granted stays out until :meth:`close`."""
        self._grants.stop(owner)

    def close(self, owner: int | None = None) -> None:
        """Closes iterator ``owner`` (every one, and the loader's place at the desk, with
        None): its slots not adopted come back, once no worker that got them can write."""
        self._grants.close(owner)


class TaskTagger:
    """Wraps torch's batch sampler: tags each index list with its zero-copy task.

    torch keeps one per iterator, and a persistent iterator calls ``iter()`` on it each epoch;
    ``owner`` names the current epoch's grants, so that an epoch's end stops its own requests
    and the iterator's end takes back its own grants and no other's (``owners``: each epoch's)."""

    _next_owner = itertools.count(1)

    def __init__(self, base: Any, grants: LoaderGrants) -> None:
        self.base = base
        self.grants = grants
        self.owner = next(TaskTagger._next_owner)
        #: Every epoch's owner, the current one last.
        self.owners = [self.owner]
        self._started = False

    def __iter__(self) -> Iterator[TaggedIndices]:
        if self._started:
            # A persistent iterator's next epoch: the last one's requests still waiting for
            # room are answered now (its workers must hear the new epoch), with new tasks.
            self.grants.stop(self.owner)
            self.owner = next(TaskTagger._next_owner)
            self.owners.append(self.owner)
        self._started = True
        self.grants.open(self.owner)
        return self._tagged(iter(self.base))  # iter() now, when torch calls it, as torch would

    def _tagged(self, it: Iterator[Any]) -> Iterator[TaggedIndices]:
        # (not ``for indices in it``: that calls iter() on it again, which restarts a sampler
        # whose iter() returns itself)
        owner = self.owner
        for task in itertools.count():
            indices = next(it, _END)
            if indices is _END:
                return
            yield TaggedIndices(indices, ZeroCopyTask(owner, task))

    def set_head(self, task: int) -> None:
        """The consumer waits for task ``task`` next."""
        self.grants.set_head(self.owner, task)

    def __len__(self) -> int:
        return len(self.base)


_END = object()
