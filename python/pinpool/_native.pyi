"""Type stubs for the Rust extension ``pinpool._native`` (checked with ``mypy.stubtest``)."""

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Literal, SupportsIndex, final, overload

import numpy as np
import numpy.typing as npt
import torch

from pinpool._stats import PoolStats

__all__ = [
    "SEGMENT_DATA_OFFSET",
    "ArenaWindow",
    "Copying",
    "Grants",
    "Handoff",
    "PinPool",
    "PipeWriter",
    "SegmentCache",
    "Sent",
    "Slot",
    "WorkerSegment",
    "_gather",
    "_set_stream_hook",
    "available_memory",
    "check_segment",
    "cuda_available",
    "page_size",
    "read_message",
    "recently_freed_pools",
    "room_kept",
    "wait_for_freed_pools",
]
SEGMENT_DATA_OFFSET: int
"""Bytes of a segment's header page: where its data area starts in the memfd."""

def _gather(target: Any, items: Sequence[tuple[int, int, int]], threads: int) -> int: ...
def _set_stream_hook(hook: Callable[[int], int | None]) -> bool: ...
def available_memory() -> int | None: ...
def check_segment(key: tuple[int, int], fd: int, total_len: int, nonce: int) -> int:
    """Checks, without mapping it, that ``fd`` is a real worker segment: a memfd sealed against
    shrinking, exactly ``total_len`` bytes long, whose header carries ``nonce`` and the capacity
    ``total_len - SEGMENT_DATA_OFFSET``; returns that capacity.

    ``fd`` is only borrowed (the caller closes it); ``key`` only names the segment in errors.
    ``SegmentCache.insert`` checks all of this again. Raises ``InvalidArgument`` (not sealed,
    bad header or nonce, ``fd < 0``) or ``OutOfBounds`` (wrong length, argument out of range).
    """

def cuda_available() -> bool: ...
def page_size() -> int: ...
def room_kept(largest_seen: int, arena: int, part: int) -> int:
    """Bytes a claim made ahead of the consumer leaves free in one range: 1.5 times the largest
    batch seen, in whole pages, at most all of the arena but one such batch, never less than one
    such batch, and at most one of its parts."""

def read_message(fd: int, timeout: float | None = None) -> bytes | None:
    """One whole message from the pipe ``fd`` (framed as ``Connection.send_bytes`` frames it),
    or None when none came within ``timeout`` seconds; signal handlers run while it waits,
    never in the middle of a message."""

def recently_freed_pools() -> list[dict[str, Any]]: ...
def wait_for_freed_pools(timeout: float | None = None) -> bool: ...

@final
class PinPool:
    """A fixed arena of (pinned) host memory, handed out as slots of any size.

    ``slot_bytes``: the largest slot (and the size of a checkout that does not say); the
    arena's parts are whole multiples of it. ``num_slots``: the most slots out or fenced at
    once. ``arena_bytes``: the arena's size, rounded up to whole ``slot_bytes`` (default:
    ``slot_bytes * num_slots``, equal slots). ``background=True``: only the first
    ``ready_first`` bytes (default: 16 MiB, and at least one largest slot) are made ready
    before the pool is returned, the rest as checkouts need it, on the pool's prepare thread
    (a checkout that finds no room asks for more; one that waits gets it once it is ready).

    ``device``: an ordinal, ``"cuda:N"`` or a ``torch.device`` binds that GPU; ``"cpu"`` means
    no CUDA (host memory); ``None`` (the default) or ``"cuda"`` the rank's own GPU: the device
    of the CUDA context current on this thread (``torch.cuda.set_device``), else
    ``$LOCAL_RANK`` modulo the device count, else device 0. Where CUDA cannot be used,
    ``None`` gives host memory (with a note); a device or CUDA backend asked for by name
    raises ``InvalidArgument`` saying why.
    """

    def __new__(
        cls,
        slot_bytes: int,
        num_slots: int,
        device: int | str | Any | None = None,
        backend: Literal["auto", "cuda-register", "cuda-hostalloc", "host"] = "auto",
        copy_threads: int | None = None,
        background: bool = False,
        arena_bytes: int | None = None,
        ready_first: int | None = None,
    ) -> PinPool: ...
    def checkout(self, timeout: float | None = None, nbytes: int | None = None) -> Slot: ...
    def try_checkout(
        self,
        nbytes: int | None = None,
        reserve: int = 0,
        prefer: Sequence[int] | None = None,
        prefer_only: bool = False,
    ) -> Slot | None:
        """Takes a slot of ``nbytes`` (default: ``slot_bytes``), or returns None at once if
        there is no room for it, or (with ``reserve``) none that leaves ``reserve`` bytes free
        in one range for other callers. ``prefer``: arena offsets (``Slot.offset`` values, at
        most 64) where the slot should start, in order of preference: the first where it can
        start now (free, a whole number of pages, in one part, ``reserve`` honoured) is taken,
        else it goes wherever first fit puts it; with ``prefer_only``, nowhere else (None). A
        negative offset, or more than 64, raises ``InvalidArgument``; a value that is not an
        int, ``TypeError``."""
    def claim(
        self,
        nbytes: int | None = None,
        reserve: int = 0,
        timeout: float | None = None,
        overflow: bool = False,
        defer: bool = False,
    ) -> Slot | Literal["later", "overflow"]: ...
    def claim_split(self, cuts: Sequence[int]) -> list[tuple[int, Slot]] | None: ...
    def stats(self) -> PoolStats: ...
    def flush(self) -> None: ...
    def close(self, wait: bool = False) -> None: ...
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> PinPool: ...
    def __exit__(
        self,
        *_args: type[BaseException] | BaseException | TracebackType | None,
    ) -> bool: ...
    @property
    def backend(self) -> str: ...
    @property
    def memory(self) -> str: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def num_slots(self) -> int: ...
    @property
    def arena_bytes(self) -> int: ...
    @property
    def largest_slot(self) -> int: ...
    @property
    def address(self) -> int: ...
    def slot_memfd(self, slot: Slot) -> tuple[int, int, int] | None: ...
    def slot_location(self, slot: Slot) -> tuple[int, int, int, int] | None: ...
    def memfd_parts(self) -> list[tuple[int, int, int]]: ...
    @property
    def device(self) -> int | None: ...
    @property
    def copy_threads(self) -> int: ...
    @property
    def notes(self) -> list[str]: ...
    @property
    def startup(self) -> dict[str, float]: ...

@final
class Slot:
    # The buffer protocol (memoryview(slot), numpy.frombuffer, torch.frombuffer): declared so
    # that type checkers accept a Slot where a Buffer is expected.
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...
    @property
    def index(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def released(self) -> bool: ...
    @property
    def device(self) -> int | None: ...
    # A view is a torch tensor wherever torch is installed, a numpy array where it is not
    # (``pinpool._views.slot_view``): a torch dtype says it is a tensor; any other dtype (a
    # numpy dtype or scalar type, a name like "float32") leaves both open. For an array
    # whatever is installed: ``numpy.frombuffer(slot, dtype)``.
    @overload
    def view(
        self,
        dtype: torch.dtype,
        shape: SupportsIndex | Sequence[SupportsIndex],
        offset: SupportsIndex = 0,
    ) -> torch.Tensor: ...
    @overload
    def view(
        self,
        dtype: str | np.dtype[Any] | type[Any],
        shape: SupportsIndex | Sequence[SupportsIndex],
        offset: SupportsIndex = 0,
    ) -> torch.Tensor | npt.NDArray[Any]: ...
    @overload
    def send(
        self, target: Any, nbytes: int, stream: Any, *, then_release: Literal[False] = False
    ) -> Sent: ...
    @overload
    def send(self, target: Any, nbytes: int, stream: Any, *, then_release: Literal[True]) -> None:
        """Queues a copy of the slot's first ``nbytes`` bytes to ``target`` (a contiguous CUDA
        tensor on the pool's device with at least ``nbytes`` bytes) on ``stream`` (a
        ``torch.cuda.Stream`` or a raw ``CUstream`` int); keep ``target`` alive until it has
        run. Returns the ``Sent`` (an event after the copy; release the slot fenced on
        ``stream``), or, with ``then_release=True``, releases the slot fenced on ``stream``
        itself, keeping the GIL while the driver queues the copy (microseconds): the training
        thread's call, which would otherwise hand the GIL to another thread."""
    def release(self, stream: Any = None) -> None: ...
    def __enter__(self) -> Slot: ...
    def __exit__(
        self,
        *_args: type[BaseException] | BaseException | TracebackType | None,
    ) -> bool: ...

@final
class ArenaWindow:
    """A lasting mapping of ``length`` bytes of an arena memfd from file offset ``offset``,
    kept by a zero-copy worker between batches, inaccessible (``PROT_NONE``) except for the one
    range ``open()`` makes readable and writable while a batch is written into it.

    ``ArenaWindow(fd, offset, length, fault_in=True)``: ``fd`` is only borrowed (neither kept
    nor closed); it must be a memfd sealed against shrinking at least ``offset + length`` bytes
    long; ``offset`` is page-aligned and ``length`` a whole number of pages. The pages are
    faulted in (without the GIL) and then made inaccessible: their page-table entries stay, so
    opening them later is cheap. With ``fault_in=False`` nothing is faulted in yet:
    ``fault_in_privately()`` on another thread, or the first ``open()``, does it. The mapping
    is not inherited by forked children. Raises ``InvalidArgument`` or ``OutOfBounds`` (both
    ``ValueError``) for bad arguments.

    The buffer protocol exports the whole window (``memoryview(window)[a:b]``, where byte 0 is
    file offset ``offset``), writable, closed or not: touching a byte outside the open range
    faults, by design. Each view keeps the window alive, and ``close()`` refuses while one is.
    """

    def __new__(cls, fd: int, offset: int, length: int, fault_in: bool = True) -> ArenaWindow: ...
    # The buffer protocol (memoryview(window)): declared for type checkers.
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...
    @property
    def offset(self) -> int:
        """The file offset of the window's first byte."""
    @property
    def length(self) -> int:
        """The window's length in bytes (whole pages)."""
    @property
    def open_range(self) -> tuple[int, int] | None:
        """The file offsets ``[start, end)`` of the pages open (readable and writable), or
        None while the window is closed."""
    @property
    def has_key(self) -> bool:
        """Whether the window has a memory protection key of its own (where the processor and
        the kernel have them, and one was left): then ``open(..., keyed=True)`` keeps the
        range's pages writable between batches, and only a thread that calls ``allow()``
        reaches them."""
    @property
    def faulted(self) -> bool:
        """Whether every page has been faulted in."""
    def fault_in_privately(self) -> bool:
        """Faults every page in on the calling thread, without the GIL, where the window has a
        key: the pages are writable meanwhile under the key alone, with only this thread's
        access on, so no other thread can reach them. True once faulted in (now or before);
        False, doing nothing, on a window without a key (the first ``open()`` faults it in
        then)."""
    @property
    def armed_range(self) -> tuple[int, int] | None:
        """The file offsets ``[start, end)`` of the pages kept readable and writable under the
        window's key between batches (the last range opened keyed), or None."""
    def contains(self, offset: int, nbytes: int) -> bool:
        """Whether the file's bytes ``[offset, offset + nbytes)`` lie inside the window."""
    def open(self, offset: int, nbytes: int, keyed: bool = False) -> None:
        """Makes the pages holding the file's bytes ``[offset, offset + nbytes)`` readable and
        writable (the range must lie inside the window and hold at least one byte), without
        the GIL. One range at a time: raises ``InvalidArgument`` while one is open.

        With ``keyed=True`` on a window with a key, the pages are made so under the key (at
        once, if they are the range opened keyed last), and only a thread that calls
        ``allow()`` may touch them, until it calls ``deny()`` or ``close()``; otherwise any
        thread may, until ``close()``."""
    def allow(self) -> None:
        """Switches the calling thread's access to the range opened keyed on (nothing to do
        for a range opened otherwise). Raises ``InvalidArgument`` while another thread's is
        on."""
    def deny(self) -> None:
        """Switches the calling thread's access to the window's key off."""
    def close(self) -> None:
        """Makes the whole window inaccessible again (nothing to do if nothing is open),
        without the GIL: the open range's pages, or, for a range opened keyed, the calling
        thread's access (the pages stay so under the key for the next batch). Raises
        ``BufferError``, changing nothing, while a view of the window is alive."""

@final
class WorkerSegment:
    """The producer's side of the segment transport: a reusable shared-memory buffer that one
    process writes batches into and another copies them out of.

    ``WorkerSegment(capacity)`` creates a memfd sealed against shrinking and growing: a header
    page (``SEGMENT_DATA_OFFSET`` bytes: magic, state word, capacity, a random ``nonce``), then
    ``capacity`` data bytes rounded up to whole pages (at least one). The data area is exposed
    through the buffer protocol (writable, ``capacity`` bytes; a view keeps the object alive).

    Per batch: ``try_begin()`` (False while the consumer still holds the last batch), write the
    data, send ``(fd, total_len, nonce)`` to the consumer, which copies and then calls
    ``SegmentCache.hand_back``; ``abandon()`` sets free a batch begun and not sent. The consumer
    needs its own
    descriptor: ``os.dup(seg.fd)`` in the same process, ``/proc/<pid>/fd/<fd>`` from another.
    The producer validates nothing; the consumer checks seals, length and nonce. Collecting the
    object unmaps the segment and closes ``fd``.
    """

    def __new__(cls, capacity: int) -> WorkerSegment: ...
    # The buffer protocol (memoryview(seg), numpy.frombuffer): declared for type checkers.
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...
    @property
    def capacity(self) -> int:
        """Data bytes available (the buffer's length), a whole number of pages."""
    @property
    def total_len(self) -> int:
        """Length of the memfd, header included: ``capacity + SEGMENT_DATA_OFFSET``."""
    @property
    def nonce(self) -> int:
        """The random number in the header, sent with the fd for the consumer to check."""
    @property
    def fd(self) -> int:
        """The memfd, owned by this object: never close it; hand the consumer a duplicate."""
    @property
    def address(self) -> int:
        """Address of the first data byte (page-aligned), in this process."""
    @property
    def in_flight(self) -> bool:
        """Whether a batch is in flight: being written, or sent and not yet handed back."""
    def try_begin(self) -> bool:
        """Begins a new batch in the segment (atomically); False while the consumer still
        holds the last one, when the data must not be written. Never blocks."""
    def abandon(self) -> None:
        """Sets the segment free without sending it (a batch begun and abandoned)."""

@final
class Copying:
    """A copy into a slot running on a copy thread (``SegmentCache.copy`` with
    ``then_hand_back=True``)."""

    @property
    def done(self) -> bool:
        """Whether the copy has finished."""
    def wait(self) -> None:
        """Returns once the copy has finished (waiting without the GIL)."""
    def sent(self) -> Sent:
        """Waits for the copy, then returns the copy to the device queued after it
        (``SegmentCache.copy``'s ``send=``), or raises what queuing it raised.
        Once."""

@final
class Sent:
    """A copy to the device queued by ``SegmentCache.copy`` (``send=``) or ``Slot.send``."""

    @property
    def done(self) -> bool:
        """Whether the copy has run."""
    def make_wait(self, stream: Any = None) -> None:
        """Makes the work queued on ``stream`` from now on (default: torch's current stream)
        wait for the copy; the calling thread does not wait."""

@final
class Handoff:
    """A job one thread hands to another and waits for. The wait releases the GIL and only the
    job's end (or the time given to take it back) ends it: a signal's Python handler runs once
    the wait has returned, not inside it (``threading.Event.wait`` runs it inside, where its
    exception cuts the wait short)."""

    def __new__(cls) -> Handoff:
        """A hand-off nobody has begun."""
    def take(self) -> bool:
        """For the runner: whether it is the one to run the job (nobody had taken it, not even
        a waiter taking it back)."""
    def finish(self) -> None:
        """The job is done: every waiter is woken."""
    @property
    def stage(self) -> Literal["waiting", "taken", "done"]:
        """Where the hand-off stands."""
    def wait(self, take_back_after: float | None = None) -> bool:
        """Waits until the job is done: True. With ``take_back_after`` seconds, a job nobody
        has begun by then is taken back: False, and the caller runs it (and says
        ``finish``). Raises ``InvalidArgument`` for a negative or NaN time."""

@final
class PipeWriter:
    """Writes messages to a pipe on a thread of its own, framed as
    ``multiprocessing.Connection.send_bytes`` frames them, in the order they were sent. It
    must be the pipe's only writer. Its thread waits while the pipe is full; once closed, it
    still writes what was sent, giving the rest up if the pipe stays full for 0.2 s."""

    def __new__(cls, fd: int) -> PipeWriter:
        """A writer of the pipe whose write end is ``fd`` (only borrowed: the writer writes to
        a duplicate, closed when its thread ends). Raises ``InvalidArgument`` for a descriptor
        that is not a pipe."""
    def send(self, data: bytes) -> None:
        """Queues ``data`` as one message; returns at once. Raises ``PoolClosed`` once closed."""
    def close(self, timeout: float = 1.0) -> bool:
        """Closes the writer and waits, without the GIL, at most ``timeout`` seconds for its
        thread to end; returns whether it ended."""
    @property
    def written(self) -> int:
        """Messages written whole so far."""
    @property
    def error(self) -> str | None:
        """The write error the thread ended on (no reader left, say), or None."""

@final
class Grants:
    """A loader's zero-copy grants: slots of exactly a batch's size, checked out for the worker
    that collated the batch when it asks at the process's grant desk (a thread of its own, no
    GIL), and adopted by the batch's handle. Every grant but the one for the task the consumer
    waits for leaves ``room_kept`` bytes free in one range."""

    def __new__(cls, windows: int, window_bytes: int, big_from: int = ...) -> Grants:
        """A table whose workers keep at most ``windows`` windows and ``window_bytes`` bytes of
        them, and whose batches of ``big_from`` bytes (8 MiB) and more are big (a fresh worker's
        first is told where its next will likely be; the last are offered to the next
        iterator's worker of the same id), answered at the process's grant desk (started if
        need be) until ``close()``."""
    @property
    def desk(self) -> tuple[bytes, int] | None:
        """``(address, table)``: the desk's abstract socket name (without its leading NUL) and
        the number requests name this table by; None once closed."""
    def use_pool(self, pool: PinPool, largest: int) -> None:
        """Grants come from ``pool`` from now on, for batches of up to ``largest`` bytes."""
    def pool_coming(self, coming: bool) -> None:
        """Whether the loader's pool is being made: until ``use_pool``, requests wait for it
        (at most 5 s) rather than go without."""
    def issue(self, owner: int, worker: int, task: int, nbytes: int) -> list[int] | None:
        """What the desk answers that request now, without waiting for room on its way: the
        grant's words (``_wire.handle.grant_from_words`` reads them), or None (counted)."""
    def open(self, owner: int) -> None:
        """Iterator ``owner``'s workers may be granted slots from now on (its head: task 0)."""
    def set_head(self, owner: int, task: int) -> None:
        """The consumer of iterator ``owner`` waits for task ``task`` next."""
    def adopt(self, index: object, generation: object, nonce: object) -> Slot | None:
        """The slot granted as (index, generation) with ``nonce``, once; None otherwise."""
    def give_back(self, index: object, generation: object, nonce: object) -> bool:
        """Releases the slot granted so, whose batch will not arrive in it."""
    def stop(self, owner: int | None = None) -> None:
        """Stops iterator ``owner`` (every one, with None): no more grants for it; its requests
        waiting at the desk are answered at once."""
    def close(self, owner: int | None = None) -> None:
        """Closes iterator ``owner`` (every one, and the table's place at the desk, with None):
        its slots not adopted are released."""
    @property
    def fallbacks(self) -> int:
        """Requests that got no grant (their batches went through copy mode)."""
    @property
    def told_likely(self) -> int:
        """Grants that named where the worker's next slots will likely be."""
    @property
    def outstanding(self) -> int:
        """Grants made and not yet adopted, given back or closed."""

@final
class SegmentCache:
    """The consumer's side of the segment transport: producers' segments mapped in this
    process, keyed by ``(producer, segment)`` (64- and 32-bit unsigned ints), and copies from
    them into ``pool``'s slots or any writable buffer.

    Use it in the process that owns ``pool``. Per batch: ``insert`` a segment the first time it
    arrives, ``copy`` from it, then ``hand_back`` it to its producer;
    ``retire``/``retire_all`` forget segments. Any thread may call any method; copies of 1 MiB
    and more run without the GIL. Retired, replaced or collected segments are unmapped on the
    pool's reclaimer thread (``pool.flush()`` waits for it). Raises ``PoolClosed`` if ``pool``
    is closed.
    """

    def __new__(cls, pool: PinPool) -> SegmentCache: ...
    def insert(self, key: tuple[int, int], fd: int, total_len: int, nonce: int) -> None:
        """Maps the segment behind ``fd`` under ``key`` after checking it: a memfd sealed against
        shrinking, at least ``total_len`` bytes, the header ``nonce`` names, capacity
        ``total_len - SEGMENT_DATA_OFFSET``. Takes ownership of ``fd``: it is closed before this
        returns, accepted or refused (pass ``os.dup(...)`` or a ``/proc/<pid>/fd/<fd>`` open).
        A segment already under ``key`` is replaced and retired. Runs without the GIL."""
    def __contains__(self, key: tuple[int, int], /) -> bool:
        """Whether a segment is mapped under ``key``."""
    def __len__(self) -> int:
        """Segments mapped."""
    @overload
    def copy(
        self,
        key: tuple[int, int],
        into: Slot | Any,
        ranges: Sequence[tuple[int, int, int]],
        *,
        then_hand_back: Literal[False] = False,
        send: None = None,
    ) -> int: ...
    @overload
    def copy(
        self,
        key: tuple[int, int],
        into: Slot,
        ranges: Sequence[tuple[int, int, int]],
        *,
        then_hand_back: Literal[False] = False,
        send: tuple[Any, int, Any],
    ) -> Sent: ...
    @overload
    def copy(
        self,
        key: tuple[int, int],
        into: Slot,
        ranges: Sequence[tuple[int, int, int]],
        *,
        then_hand_back: Literal[True],
        send: tuple[Any, int, Any] | None = None,
    ) -> Copying:
        """Copies ``(src_offset, dst_offset, nbytes)`` ranges from the data area of ``key``
        into ``into``: a slot of this pool, or any writable C-contiguous buffer. All ranges
        are checked first: sources within the capacity (``OutOfBounds``), destinations within
        ``into`` (``BatchTooLarge``) and disjoint (``InvalidArgument``); a slot must be this
        pool's and unreleased, and is held for the copy.

        - No option: the copy, here; returns the bytes copied. The segment stays in flight
          until ``hand_back(key)``.
        - ``send=(target, nbytes, stream)`` (a slot of a pool the driver pinned): then a copy
          of the slot's first ``nbytes`` bytes into ``target`` (a contiguous CUDA tensor on
          the pool's device, kept alive until the copy has run) queued on ``stream``; returns
          the ``Sent``. Release the slot fenced on ``stream`` after the call.
        - ``then_hand_back=True`` (a slot): the copy (and the send) runs on a copy thread,
          which then hands the segment back (do not ``hand_back(key)`` too); returns a
          ``Copying`` at once (``Copying.sent()`` gives the ``Sent``). Until then the slot
          stays out of the pool. Read the slot only after ``Copying.wait()``."""
    def hand_back(self, key: tuple[int, int]) -> None:
        """Marks segment ``key`` free for its producer's next ``try_begin()``; only once the
        last copy of the batch has returned. It stays mapped. Unknown keys raise."""
    def retire(self, key: tuple[int, int]) -> bool:
        """Forgets ``key`` (unmapped on the reclaimer thread); False if unknown."""
    def retire_all(self, worker: int | None = None) -> int:
        """Retires every segment of producer ``worker`` (of all with None); returns how many."""
