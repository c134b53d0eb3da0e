"""What travels from a worker to the main process for one batch, and what tags its indices.

A batch has one destination, chosen in the worker (``pinpool._worker.destination``): a zero-copy
slot the main process granted the worker for it (a :class:`SlotGrant`), or one of the worker's
own shared-memory segments. Either way the worker sends one :class:`BatchHandle`:
the marked batch tree, the leaf specs (``codec.LeafSpec``) and that destination; the arrays
stay in shared memory.

Invariants:

- unpickling a handle only sets its fields: nothing is opened, mapped or looked up until the
  main process takes the batch (torch's pin thread calls :meth:`BatchHandle.pin_memory`, or
  the iterator reaches it) or drops it (its ``__del__``), and then its receiver checks every
  field before it trusts any;
- a handle is acted on at most once: taken (its batch delivered) or dropped (its segment
  handed back, its unused slot taken back), in the process that made its loader;
- exactly one of ``slot`` and ``segment`` is set on a handle a worker sends.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .. import _signals, _trace
from .._errors import PinPoolError
from . import codec, registry

#: How many slots' memory a worker keeps mapped between batches at most (``_worker.windows``),
#: and how many of a worker's last slots the main process offers it again first
#: (``pinpool._native.Grants``): a worker has at most ``prefetch_factor`` (2 by default)
#: batches in flight, and the consumer, and torch's pin thread ahead of it, hold several more of
#: its batches (each of those slots is busy when the worker asks for its next one).
WINDOWS_KEPT = 16
#: How many bytes of windows a worker keeps mapped at most: big slots get fewer windows (four of
#: 335 MB), small ones the full number. A window costs its page tables, not memory.
WINDOW_BYTES_KEPT = 3 << 29


class LikelySlot(NamedTuple):
    """Where a worker's next slots will likely be (zero-copy mode): an extent of the arena the
    worker may pre-map, inaccessible until a grant there opens it
    (``_worker.windows.premap``). It hands the worker nothing to write."""

    offset: int  # of the extent in its memfd, bytes
    nbytes: int
    arena_pid: int
    arena_fd: int
    arena_len: int
    arena_ino: int


class SlotGrant(NamedTuple):
    """A slot of the main process's arena granted to the worker that collated one batch, of
    that batch's size (zero-copy mode: ``pinpool._native.Grants``)."""

    index: int  # type: ignore[assignment]  # (shadows tuple.index)
    generation: int
    nonce: int
    offset: int  # of the slot in its memfd, bytes
    nbytes: int  # slot size
    arena_pid: int  # the process whose fd this is
    arena_fd: int  # the memfd (one part of the arena) holding the slot
    arena_len: int  # that memfd's length
    arena_ino: int  # that memfd's inode number: the fd still names the same file
    #: Where this worker's next slots will likely be (the slots its predecessor, the same
    #: worker id of the iterator before, kept windows on, or its share of the arena): set on a
    #: worker's first big grant only, for it to map them on a thread of its own.
    likely: tuple[LikelySlot, ...] = ()

    @property
    def key(self) -> tuple[int, int, int]:
        """What a handle sends back about this slot: (index, generation, nonce)."""
        return (self.index, self.generation, self.nonce)

    @property
    def as_likely(self) -> LikelySlot:
        """This slot's extent as a likely slot."""
        return LikelySlot(
            self.offset, self.nbytes, self.arena_pid, self.arena_fd, self.arena_len, self.arena_ino
        )


#: A grant's words (``pinpool._native.Grants``): the slot's nine fields after the leading 1,
#: then the number of likely slots; each is five words (offset, bytes, fd, memfd length, inode).
GRANT_WORDS = 11
LIKELY_WORDS = 5


def grant_from_words(words: tuple[int, ...]) -> SlotGrant | None:
    """The grant an answer of the main process's grant desk names (after its sequence number);
    None for no grant, or anything malformed."""
    if len(words) < GRANT_WORDS or words[0] != 1:
        return None
    fields = words[1:10]
    likely_words = words[GRANT_WORDS:]
    if len(likely_words) != words[10] * LIKELY_WORDS:
        return None
    pid = fields[5]
    likely = tuple(
        LikelySlot(h[0], h[1], pid, h[2], h[3], h[4])
        for h in (
            likely_words[i : i + LIKELY_WORDS] for i in range(0, len(likely_words), LIKELY_WORDS)
        )
    )
    return SlotGrant(*fields, likely=likely)


class ZeroCopyTask(NamedTuple):
    """What a batch's indices carry in zero-copy mode: the iterator (its sampler's owner
    number) and the batch's task number in it, for the worker to name when it asks for room."""

    owner: int
    task: int


class TaggedIndices(list):  # type: ignore[type-arg]
    """A batch's indices, with its zero-copy task (or None)."""

    task: ZeroCopyTask | None

    def __init__(self, indices: Any, task: ZeroCopyTask | None) -> None:
        super().__init__(indices)
        self.task = task

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled once a batch on the consumer's thread (the index queue's put): the task as
        # a plain tuple of ints.
        t = self.task
        return (_tagged, (list(self), None if t is None else (t[0], t[1])))


def _tagged(indices: list[Any], task: tuple[int, int] | None) -> TaggedIndices:
    """A :class:`TaggedIndices` from what its ``__reduce__`` made."""
    return TaggedIndices(indices, None if task is None else ZeroCopyTask(*task))


class TaskedItems:
    """What a dataset's own ``__getitems__`` made of tagged indices (a list of samples, or a
    whole batch that torch hands to collate unchanged), with the indices' zero-copy task."""

    __slots__ = ("items", "task")

    def __init__(self, items: Any, task: ZeroCopyTask | None) -> None:
        self.items = items
        self.task = task


#: A handle's state, unpickled, awaiting its receiver.
ARRIVED = 1
#: Its segment has been opened and mapped by the receiver (copy mode).
HELD = 2


class BatchHandle:
    """What a worker sends instead of a batch.

    Fields: ``token`` (the loader's), ``tree`` (the batch with ``codec.Leaf`` markers),
    ``specs`` (one leaf spec per marker), ``nbytes`` (the extent of the leaves), ``count``
    (samples in the batch, when known: it sizes the pool), and the destination:

    - ``slot``: (index, generation, nonce) of the zero-copy slot the batch was written into;
    - or the segment: ``worker`` (its ring's key), ``segment`` (its number in the ring),
      ``origin`` ((pid, fd) to open it through ``/proc``, on its first use only),
      ``total_len`` and ``nonce`` (its header's), ``retired`` (segments of the ring the worker
      dropped) and ``unused`` (the key of a granted slot the batch outgrew);
    - or neither: a batch without arrays, carried whole in ``tree`` (``specs`` empty).
    """

    __slots__ = (
        "_cut",
        "_state",
        "count",
        "nbytes",
        "nonce",
        "origin",
        "retired",
        "segment",
        "slot",
        "specs",
        "token",
        "total_len",
        "tree",
        "unused",
        "worker",
    )

    # Set from what another process sent: nothing is trusted until the receiver checks it.
    token: Any
    tree: Any
    specs: Any
    nbytes: Any
    count: Any
    slot: Any
    worker: Any
    segment: Any
    origin: Any
    total_len: Any
    nonce: Any
    retired: Any
    unused: Any
    _state: int

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
        "slot",
    )

    def __init__(
        self,
        token: str,
        p: codec.LayoutPlan,
        count: int | None = None,
        *,
        slot: tuple[int, int, int] | None = None,
        worker: int | None = None,
        segment: int | None = None,
        origin: tuple[int, int] | None = None,
        total_len: int | None = None,
        nonce: int | None = None,
        retired: tuple[int, ...] = (),
        unused: tuple[int, int, int] | None = None,
    ) -> None:
        self.token = token
        self.tree = p.tree
        self.specs = [tuple(s) for s in p.specs]
        self.nbytes = p.nbytes
        self.count = count
        self.slot = slot
        self.worker = worker
        self.segment = segment
        self.origin = origin
        self.total_len = total_len
        self.nonce = nonce
        self.retired = retired
        self.unused = unused
        self._state = 0  # made here: nothing to take or drop in this process

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._STATE)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for name, value in zip(self._STATE, state, strict=True):
            setattr(self, name, value)
        self._state = ARRIVED
        #: Set when an interrupt (``KeyboardInterrupt``, ``SystemExit``) cut its taking short:
        #: its batch is lost, and taking it again raises that interrupt's kind.
        self._cut: type[BaseException] | None = None

    def pin_memory(self) -> Any:
        """torch's pin thread: the batch in pinned memory (or on the device), pending (the
        consumer's thread waits for it), if a slot is at hand now; else this handle, for the
        consumer's thread to take in its turn."""
        t0 = _trace.on and _trace.now()
        batch = self._receiver().take(self, ahead=True)
        if t0:
            _trace.span("batch.take", t0, ahead=True)
        return batch

    def take(self) -> Any:
        """The consumer's thread, in order: the batch, waiting for a slot if need be, handed
        over to the consumer."""
        t0 = _trace.on and _trace.now()
        batch = self._receiver().take_in_turn(self)
        if t0:
            _trace.span("batch.take", t0, ahead=False)
        return batch

    def _receiver(self) -> Any:
        # A pickle may make the object and stop before its state (``__setstate__`` never ran).
        if getattr(self, "_state", None) is None:
            raise PinPoolError(
                "a damaged batch handle reached this process: it carries none of its fields"
            )
        return registry.lookup(self.token)

    def __del__(self) -> None:
        # Dropped undelivered (torch shutting its workers down, an out-of-order batch left
        # behind): its segment and its unused slot go back. (At interpreter exit a module's
        # globals may already be gone.)
        if getattr(self, "_state", 0) and registry is not None:
            receiver = registry.lookup_or_none(self.token)
            if receiver is not None:
                try:
                    receiver.drop(self)
                except BaseException as exc:
                    if not _signals.hand_back(exc):
                        raise


class WorkerProgress:
    """A worker's batch of an ``IterableDataset`` that can resume (``DataLoader.state_dict``),
    with ``state``: the worker's copy of the dataset's ``state_dict()`` right after the
    batch's samples were drawn, and ``worker``: torch's worker id. The main process keeps the
    state of each worker's latest delivered batch; a resumed loader loads it back into that
    worker's dataset before its iterator is made.

    torch's pin thread calls :meth:`pin_memory`, which pins the batch (``batch`` is a
    :class:`BatchHandle`, or what its ``pin_memory()`` gave) and keeps the state with it."""

    __slots__ = ("batch", "state", "worker")

    def __init__(self, batch: Any, worker: int, state: Any) -> None:
        self.batch = batch
        self.worker = worker
        self.state = state

    def fields(self, num_workers: int) -> tuple[Any, int, Any]:
        """``(batch, worker, state)``, checked: a pickle may make the object and stop before
        its fields, and ``worker`` must name one of the loader's ``num_workers``."""
        try:
            batch, worker, state = self.batch, self.worker, self.state
        except AttributeError:
            raise PinPoolError(
                "a damaged worker batch reached this process: it carries none of its fields"
            ) from None
        if type(worker) is not int or not 0 <= worker < num_workers:
            raise PinPoolError(
                f"a damaged worker batch reached this process: it names worker {worker!r} "
                f"of {num_workers}"
            )
        return batch, worker, state

    def pin_memory(self) -> WorkerProgress:
        try:
            batch, worker, state = self.batch, self.worker, self.state
        except AttributeError:
            return self  # (damaged: refused in its turn, by fields())
        if not isinstance(batch, BatchHandle):
            return self
        return WorkerProgress(batch.pin_memory(), worker, state)
