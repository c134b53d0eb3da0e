"""Fuzzing what crosses the process boundary into the main process: the handles workers send
(``BatchHandle``, naming a segment or, in zero-copy mode, a slot), as state tuples and as raw pickle
bytes, and the 64-byte header of the shared-memory segments they name; and the resume states
``DataLoader.load_state_dict`` takes (from a checkpoint file: clear errors at load, or a state
that runs, never a late error or a hang); and the pool hints a worker sends before its first
batch (a warning at most, a pool no larger than the batches it announces justify).

No input may crash the process, hang, read outside the segment it names, or allocate more
than that segment justifies. Every handle goes to a real loader side (a ``pinpool.DataLoader``
made in this process, its pool made at the first batch, as by default), over a real worker
segment written here with a real batch, the way ``pinpool._worker`` writes it. What may
come out: the batch, when the handle happens to be valid, or a :class:`~pinpool.PinPoolError`.
Any other exception propagates, so that hypothesis reports each kind (and place) separately;
a Rust panic (``PanicException``, not an ``Exception``) fails the test; so does an exception in a
handle's ``__del__``, a slot or an fd not given back, or a hang (see :func:`no_hang`).

The loader allocates memory for a handle in two places: the pool it sizes at the first batch
(``PinPool`` in ``pinpool._main.route.lazy_pool``) and the ordinary buffer of a batch larger than a
slot (``LazyPool.overflow_buffer``). :func:`watch_allocations` wraps both: a request beyond what
the real segment justifies is recorded and refused before anything is allocated, so that the
fuzzer finds such a bug without taking the machine's memory with it.

``make test`` runs a bounded fuzz (``max_examples`` below per test; about two minutes in all on two
cores). The longer run, with more examples per test:

    PINPOOL_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest -q tests/faults/test_fuzz.py

hypothesis keeps the failures it finds in ``.hypothesis/`` and tries them first next time.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import fcntl
import gc
import math
import mmap
import os
import pickle
import resource
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from conftest import open_fd_count
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st
from loader_datasets import Indexed, Pair, assert_same

import pinpool
import pinpool._main.route.lazy_pool
from pinpool import PinPoolError
from pinpool._main.route.delivery import hand_to_consumer
from pinpool._main.route.lazy_pool import LazyPool
from pinpool._main.settings import sizing
from pinpool._native import SEGMENT_DATA_OFFSET, SegmentCache, WorkerSegment
from pinpool._wire import codec as _codec
from pinpool._wire.codec import ALIGN, Leaf
from pinpool._wire.handle import BatchHandle, WorkerProgress, ZeroCopyTask
from pinpool._wire.tree import KEEP, map_leaves
from pinpool._worker import desk, destination

PAGE = pinpool.page_size()

# The bounded run stops at the first failure of each test (shrinking every distinct failure
# can take minutes); the long run looks for, and reports, every distinct one.
settings.register_profile(
    "pinpool-fuzz",
    max_examples=100,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.large_base_example,
    ],
)
_EXAMPLES = os.environ.get("PINPOOL_FUZZ_EXAMPLES")
if _EXAMPLES:
    settings.register_profile(
        "pinpool-fuzz-long",
        parent=settings.get_profile("pinpool-fuzz"),
        max_examples=int(_EXAMPLES),
        report_multiple_bugs=True,
    )
FUZZ = settings.get_profile("pinpool-fuzz-long" if _EXAMPLES else "pinpool-fuzz")

#: Seconds one example may take before the run is stopped with every thread's stack.
EXAMPLE_TIMEOUT = 120

#: The loader side: batches of this many samples, a pool of this many slots.
BATCH = 2
NUM_SLOTS = 2
#: The real segment every BatchHandle names (its data area, bytes).
CAPACITY = 1 << 16


class Feature(torch.Tensor):
    """A tensor subclass a spec may name."""


# --------------------------------------------------------------------------- values to corrupt with

#: Integers a corrupt handle may carry: small ones, the edges of every width, beyond 64 bits.
EDGES = [
    *(2**k + d for k in (31, 32, 63, 64) for d in (-1, 0)),
    *(-(2**k) for k in (31, 63, 64)),
    2**100,
]
INTS = st.one_of(st.integers(-8, 8), st.sampled_from(EDGES), st.integers(-(2**70), 2**70))
U64 = st.integers(0, 2**64 - 1)

#: Anything else a pickle can carry where a number, a string or a tuple belongs.
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(),  # nan and the infinities too
    st.text(max_size=6),
    st.binary(max_size=6),
    st.integers(-(2**70), 2**70).map(str),
    st.lists(INTS, max_size=3),  # unhashable
    st.lists(INTS, max_size=3).map(tuple),
    st.dictionaries(st.text(max_size=2), INTS, max_size=2),
    U64.map(np.uint64),
    st.floats().map(np.float64),
    st.integers(-(2**63), 2**63 - 1).map(torch.tensor),
    st.complex_numbers(),
)
ANY = st.one_of(INTS, JUNK)


def near(value: int) -> st.SearchStrategy[int]:
    """``value`` a little off, or with one bit flipped."""
    return st.one_of(
        st.integers(-2 * ALIGN, 2 * ALIGN).map(lambda d: value + d),
        st.integers(0, 70).map(lambda bit: value ^ (1 << bit)),
    )


with open("/proc/sys/kernel/pid_max") as _f:
    DEAD_PID = int(_f.read())  # pids are below this: no process has it

TORCH_NAMES = sorted(_codec.TORCH_DTYPES)
NUMPY_NAMES = ["|b1", "|u1", "|i1", ">i2", "<i4", "<u8", "<f2", "<f4", ">f8", "<f16", "<c8"]
NUMPY_NAMES += ["<c32", "<M8[D]", "<m8[as]", "<M8"]
BAD_DTYPES = ["O", "<U4", "|S4", "|V8", "V0", "i4,i4", "(2,)i4", "a", "float128", "", "M8[Y/3]"]
SUBCLASSES = [None, None, Feature, torch.nn.Parameter, torch.nn.Buffer, int, np.ndarray, "Tensor"]

SHAPES = st.one_of(
    st.lists(st.integers(0, 6), max_size=4).map(tuple),
    st.lists(st.integers(-2, 2**40), max_size=3).map(tuple),
    # Nothing to read, but a dimension no allocator takes.
    st.tuples(st.just(0), st.sampled_from([2**31, 2**62, 2**63, 2**64, 2**100])),
    # More dimensions than numpy has.
    st.integers(60, 80).map(lambda n: (1,) * n),
)


@st.composite
def consistent_specs(draw: Any) -> tuple[Any, ...]:
    """A leaf spec whose ``nbytes`` matches its dtype and shape, at an aligned offset: it
    passes the field checks and tests the bounds and what is built from it."""
    kind = draw(st.sampled_from(["torch", "numpy"]))
    dtype = draw(st.sampled_from(TORCH_NAMES if kind == "torch" else NUMPY_NAMES))
    itemsize = _codec.TORCH_DTYPES[dtype].itemsize if kind == "torch" else np.dtype(dtype).itemsize
    shape = draw(SHAPES)
    if draw(st.integers(0, 3)):
        offset = draw(st.integers(0, 2**11)) * ALIGN
    else:
        offset = draw(U64.map(lambda v: v - v % ALIGN))
    return (
        offset,
        math.prod(shape) * itemsize,
        kind,
        dtype,
        shape,
        draw(st.sampled_from(SUBCLASSES)),
    )


RAW_SPECS = st.tuples(
    st.one_of(st.integers(0, 64).map(lambda k: k * ALIGN), ANY),
    st.one_of(st.integers(0, 1 << 17), ANY),
    st.one_of(st.sampled_from(["torch", "numpy"]), ANY),
    st.one_of(st.sampled_from(TORCH_NAMES + NUMPY_NAMES + BAD_DTYPES), st.text(max_size=6), ANY),
    st.one_of(SHAPES, ANY),
    st.one_of(st.sampled_from(SUBCLASSES), ANY),
)


def spec_lists(valid: list[tuple[Any, ...]]) -> st.SearchStrategy[Any]:
    """A leaf list: the valid one with one leaf or one field of a leaf replaced, or one more
    leaf; made up; or not a list at all."""
    one = st.one_of(consistent_specs(), RAW_SPECS, st.lists(ANY, max_size=7).map(tuple), ANY)

    def replace_leaf(where: tuple[int, Any]) -> list[tuple[Any, ...]]:
        leaf, spec = where
        out = list(valid)
        out[leaf % len(out)] = spec
        return out

    def replace_field(where: tuple[int, int, Any]) -> list[tuple[Any, ...]]:
        leaf, index, value = where
        spec = list(valid[leaf % len(valid)])
        spec[index] = value
        return replace_leaf((leaf, tuple(spec)))

    return st.one_of(
        st.tuples(st.integers(0, 7), consistent_specs()).map(replace_leaf),
        st.tuples(st.integers(0, 7), st.integers(0, 5), ANY).map(replace_field),
        st.tuples(st.integers(0, 7), one).map(replace_leaf),
        one.map(lambda spec: [*valid, spec]),
        st.lists(consistent_specs(), min_size=1, max_size=3),
        st.lists(one, max_size=3),
        ANY,
    )


def nested(depth: int) -> Any:
    tree: Any = Leaf(0)
    for _ in range(depth):
        tree = [tree]
    return tree


def trees() -> st.SearchStrategy[Any]:
    """Marked batch trees: markers that name no leaf (or are not even numbers), containers,
    junk, and nesting deeper than Python's recursion limit."""
    markers = st.one_of(
        st.builds(Leaf, st.one_of(st.integers(-2, 4), INTS, JUNK)),
        st.builds(object.__new__, st.just(Leaf)),  # no index at all (a pickle can make it)
    )
    return st.one_of(
        st.recursive(
            st.one_of(markers, JUNK),
            lambda ch: st.one_of(
                st.lists(ch, max_size=3),
                st.lists(ch, max_size=3).map(tuple),
                st.dictionaries(st.text(max_size=2), ch, max_size=3),
                st.tuples(ch, ch).map(lambda v: Pair(*v)),
            ),
            max_leaves=6,
        ),
        # Far deeper than the recursion limit (no depth near it: failing there would be flaky).
        st.sampled_from([10**4, 10**5]).map(nested),
    )


#: A file a first handle may name instead of its segment: sealed like one, far larger, with no
#: header (sparse: none of it is allocated, unless something sizes memory from it).
DECOY_SIZE = 256 << 20
#: Sizes to claim: a segment's, the decoy's, and around them.
SIZES = [CAPACITY, CAPACITY + 1, SEGMENT_DATA_OFFSET, SEGMENT_DATA_OFFSET + 1, 1 << 24]
SIZES += [DECOY_SIZE - SEGMENT_DATA_OFFSET, DECOY_SIZE, 1 << 40]


def corrupt_batch_field(name: str, valid: Any, fds: list[int]) -> st.SearchStrategy[Any]:
    """What field ``name`` (of ``BatchHandle._STATE``, valid value ``valid``) may become;
    ``fds``: files of this process a handle might name."""
    if name == "token":
        return st.one_of(st.text(max_size=33), st.just(valid[:-1] + "x"), ANY)
    if name in ("worker", "segment", "nonce", "nbytes", "total_len"):
        return st.one_of(
            near(valid),
            st.integers(0, 2**48),
            st.sampled_from(SIZES),
            st.just(float(valid)),
            st.just(str(valid)),
            ANY,
        )
    if name == "origin":
        pids = st.one_of(st.just(os.getpid()), st.sampled_from([0, -1, DEAD_PID, 2**64 + 1]), ANY)
        fds = st.one_of(st.sampled_from(fds), st.integers(-2, 64), ANY)
        return st.one_of(st.none(), st.tuples(pids, fds), st.lists(ANY, max_size=3).map(tuple), ANY)
    if name == "retired":
        return st.one_of(st.lists(st.one_of(st.integers(0, 3), ANY), max_size=3).map(tuple), ANY)
    if name == "tree":
        return trees()
    if name == "specs":
        return spec_lists(valid)
    if name == "unused":
        return st.one_of(
            st.none(), st.tuples(ANY, ANY, ANY), st.lists(ANY, max_size=4).map(tuple), ANY
        )
    if name == "count":
        return st.one_of(st.none(), st.integers(-2, 4), ANY)
    if name == "slot":  # a handle naming a segment names no slot
        return st.one_of(st.tuples(U64, U64, U64), st.lists(ANY, max_size=4).map(tuple), ANY)
    raise AssertionError(name)


#: The fields of a handle naming a zero-copy slot that the slot fuzz corrupts.
SLOT_FIELDS = ("token", "tree", "specs", "slot", "worker")


def corrupt_slot_field(name: str, valid: Any) -> st.SearchStrategy[Any]:
    """What field ``name`` (of ``SLOT_FIELDS``) of a handle naming a slot may become."""
    if name == "token":
        return st.one_of(st.text(max_size=33), st.just(valid[:-1] + "x"), ANY)
    if name == "tree":
        return trees()
    if name == "specs":
        return spec_lists(valid)
    if name == "slot":  # (index, generation, nonce)
        each = [st.one_of(near(v), st.just(float(v)), st.just(str(v)), ANY) for v in valid]
        return st.one_of(st.tuples(*each), st.lists(ANY, max_size=4).map(tuple), st.none(), ANY)
    if name == "worker":  # a slot handle names no segment
        return st.one_of(st.integers(0, 2**48), ANY)
    raise AssertionError(name)


def corrupted(
    data: Any, state: tuple[Any, ...], names: tuple[str, ...], fuzz: Callable[..., Any]
) -> tuple[tuple[Any, ...], bool]:
    """``state`` (a ``BatchHandle``'s) with up to three of the fields ``names`` replaced by
    what ``fuzz(name, valid)`` draws; and whether any field was."""
    chosen = data.draw(st.sets(st.sampled_from(names), max_size=3), label="fields corrupted")
    out = list(state)
    for name in names:  # in a stable order, for the shrinker
        if name in chosen:
            i = BatchHandle._STATE.index(name)
            out[i] = data.draw(fuzz(name, state[i]), label=name)
    return tuple(out), bool(chosen)


# --------------------------------------------------------------------------- the loader side


@dataclass
class Worker:
    """One worker's segment with a real batch in it, written here as a worker writes it."""

    segment: WorkerSegment = field(default_factory=lambda: WorkerSegment(CAPACITY))
    batch: Any = field(
        default_factory=lambda: {
            "x": torch.arange(12.0).reshape(3, 4),
            "y": [np.arange(5, dtype="<i2"), "label", 7],
            "z": Pair(torch.ones(2, 2, dtype=torch.uint8), None),
        }
    )
    key: int = 0x5EED  # this worker's ring key
    plan: _codec.LayoutPlan = field(init=False)

    def __post_init__(self) -> None:
        self.plan = _codec.plan(self.batch)

    def refill(self) -> None:
        """Claims the segment again and writes the batch (the last handle may have left it
        in flight)."""
        self.segment.abandon()
        assert self.segment.try_begin()
        _codec.write(self.plan, self.segment)

    def handle(self, token: str, first: bool) -> BatchHandle:
        """The handle a worker sends for the batch (``first``: the segment's first use, so
        the handle says where to open it)."""
        seg = self.segment
        return BatchHandle(
            token,
            self.plan,
            BATCH,
            worker=self.key,
            segment=0,
            origin=(os.getpid(), seg.fd) if first else None,
            total_len=seg.total_len,
            nonce=seg.nonce,
        )


@contextlib.contextmanager
def loader_side(**kwargs: Any) -> Iterator[pinpool.DataLoader]:
    """A loader whose main-process side receives the handles made here (its pool is made at
    the first batch unless ``slot_bytes`` is given); closed at the end."""
    kwargs.setdefault("num_slots", NUM_SLOTS)
    loader = pinpool.DataLoader(Indexed(4), batch_size=BATCH, copy_threads=1, **kwargs)
    # A pool made now has its first batches' room ready, the rest made ready as claims need
    # it: have every slot made ready, so that every example starts from the same, whole pool.
    if loader.pool is not None:
        held = [loader.pool.checkout(timeout=30) for _ in range(loader.pool.num_slots)]
        for slot in held:
            slot.release()
        assert loader.pool.stats()["slots_preparing"] == 0
    try:
        yield loader
    finally:
        loader._pinpool_receiver.close()


def received(state: tuple[Any, ...], cls: type = BatchHandle) -> Any:
    """A handle as the main process gets it: ``__setstate__`` on a blank object."""
    handle = cls.__new__(cls)
    handle.__setstate__(state)
    return handle


def decoded(handle: Any, ahead: bool) -> Any:
    """What torch's loop and ``hand_to_consumer`` do with a handle: the pin thread's
    ``pin_memory()`` first when ``ahead`` (it may hand the handle back, for the consumer),
    then the consumer's ``take()``. None for anything that is not a handle."""
    if not isinstance(handle, BatchHandle):
        return None
    try:
        return hand_to_consumer(handle.pin_memory() if ahead else handle.take())
    except PinPoolError:
        raise
    except BaseException:
        # This failure is reported as it is: the handle's finalizer, which runs when the
        # traceback goes (in a later test, say), must not add to it.
        handle._state = 0
        raise


def accepted(run: Callable[[], Any]) -> Any:
    """``run()``'s result, or None when it raised a PinPoolError. Any other ``Exception``
    propagates as it is; any other ``BaseException`` (a Rust panic) fails the test."""
    try:
        out = run()
    except PinPoolError as exc:
        if currently_in_test_context():
            event("refused", type(exc).__name__)
        return None
    except Exception:
        raise
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise AssertionError(f"{type(exc).__module__}.{type(exc).__name__} escaped") from exc
    if currently_in_test_context():
        event("accepted", "nothing" if out is None else type(out).__name__)
    return out


class Overallocation(Exception):
    """Raised by :func:`watch_allocations` instead of allocating what a handle asked for."""


@dataclass
class Allocations:
    pool_limit: int
    buffer_limit: int
    refused: list[str] = field(default_factory=list)


@contextlib.contextmanager
def watch_allocations(capacity: int, batch: int = BATCH) -> Iterator[Allocations]:
    """While active, the loader may make a pool no larger than a segment of ``capacity``
    bytes justifies (the arena it would make for batches of that size, never scaled by
    what a handle says of its sample count: at most the smallest arena, or ``NUM_SLOTS``
    batches of that size with headroom), and an overflow buffer no larger than the segment.
    Anything larger is recorded and refused (:class:`Overallocation`)."""
    del batch  # (a sample count no longer scales anything)
    room = -(-int(capacity * sizing.HEADROOM) // mmap.PAGESIZE) * mmap.PAGESIZE
    limit = max(sizing.MIN_ARENA, room * NUM_SLOTS)
    seen = Allocations(pool_limit=limit, buffer_limit=capacity)
    real_pool = pinpool._main.route.lazy_pool.PinPool
    real_buffer = LazyPool.overflow_buffer

    def make_pool(slot_bytes: int, num_slots: int, **kwargs: Any) -> Any:
        arena = kwargs.get("arena_bytes") or slot_bytes * num_slots
        if arena > seen.pool_limit:
            seen.refused.append(
                f"an arena of {arena} bytes, for a segment of {capacity} bytes (at most "
                f"{seen.pool_limit} bytes)"
            )
            raise Overallocation(seen.refused[-1])
        return real_pool(slot_bytes, num_slots, **kwargs)

    def overflow_buffer(self: Any, need: int) -> Any:
        if need > seen.buffer_limit:
            seen.refused.append(f"an overflow buffer of {need} bytes, for {capacity} bytes")
            raise Overallocation(seen.refused[-1])
        return real_buffer(self, need)

    pinpool._main.route.lazy_pool.PinPool = make_pool  # type: ignore[assignment]
    LazyPool.overflow_buffer = overflow_buffer  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        pinpool._main.route.lazy_pool.PinPool = real_pool  # type: ignore[misc]
        LazyPool.overflow_buffer = real_buffer  # type: ignore[method-assign]


@contextlib.contextmanager
def late_errors() -> Iterator[None]:
    """Fails with the first exception raised where Python cannot raise it (a handle's
    ``__del__``), once the block is done."""
    caught: list[Any] = []
    previous = sys.unraisablehook
    sys.unraisablehook = caught.append
    try:
        yield
    finally:
        sys.unraisablehook = previous
    if caught:
        exc = caught[0].exc_value
        exc.add_note(f"raised in {caught[0].object!r} ({caught[0].err_msg})")
        raise exc


@contextlib.contextmanager
def no_fd_left(flush: Callable[[], None] = lambda: None, note: bool = False) -> Iterator[None]:
    """Fails if the block leaves more fds open than it found (after ``flush()``, and after the
    freeing thread has freed every pool dropped in the block, with its memfds). With
    ``note``, an exception escaping the block says if it left one too (without: what the
    exception's traceback still holds, a loader's pool say, may hold fds)."""
    before = open_fd_count()
    try:
        yield
    except Exception as exc:
        flush()
        pinpool.wait_for_freed_pools(timeout=60)
        if note and open_fd_count() > before:
            exc.add_note(f"and {open_fd_count() - before} fd(s) were left open")
        raise
    flush()
    pinpool.wait_for_freed_pools(timeout=60)
    # (Fewer is fine: the garbage of an earlier example, collected meanwhile, held them. A
    # dropped loader's segments are closed by a background thread: on a busy machine, later.)
    deadline = time.monotonic() + 10
    while open_fd_count() > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert open_fd_count() <= before, f"{open_fd_count() - before} fd(s) were left open"


@contextlib.contextmanager
def no_hang() -> Iterator[None]:
    """A hang stops the whole run, with every thread's stack, after EXAMPLE_TIMEOUT s."""
    faulthandler.dump_traceback_later(EXAMPLE_TIMEOUT, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def address_space_cap(headroom: int) -> Iterator[None]:
    """Caps this process's address space at its size now plus ``headroom`` bytes. The C
    unpickler sizes (and zeroes) its memo from an index in the data: a corrupt one must get
    a MemoryError, not the machine's memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * PAGE
    cap = size + headroom if hard == resource.RLIM_INFINITY else min(size + headroom, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def arrays_in(batch: Any) -> list[Any]:
    found: list[Any] = []

    def leaf(obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            found.append(obj)
            return obj
        return KEEP

    map_leaves(batch, leaf)
    return found


def assert_inside(batch: Any, limit: int) -> None:
    """Every array of a decoded batch views at most ``limit`` bytes."""
    for x in arrays_in(batch):
        assert x.nbytes <= limit, f"a leaf of {x.nbytes} bytes from a source of {limit}"
        if isinstance(x, torch.Tensor):
            held = x.untyped_storage().nbytes()
            assert held <= limit, f"a view of {held} bytes from a source of {limit}"


def assert_slots_back(loader: pinpool.DataLoader) -> None:
    """Every slot of the loader's pool is free again (once nothing refers to a batch); the
    bytes of the arena not made ready yet (no claim needed them) count as free."""
    pool = loader.pool
    if pool is None:
        return

    def back(stats: dict[str, Any]) -> bool:
        return (
            stats["bytes_free"] + stats["bytes_preparing"] == pool.arena_bytes
            and stats["slots_checked_out"] == stats["slots_fenced"] == 0
        )

    # (A batch taken ahead, as by torch's pin thread, may still be landing in its slot on a
    # copy thread, which lets the slot go once done: its release can come a moment later.)
    deadline = time.monotonic() + 10
    while not back(stats := pool.stats()) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert back(stats), stats


def check_batch_handle(
    loader: pinpool.DataLoader,
    worker: Worker,
    make: Callable[[], Any],
    ahead: bool,
    expect: Any = None,
) -> None:
    """Makes a handle with ``make()`` (None: nothing came out of the bytes) and decodes it;
    checks the rules (see the module's docstring) and, with ``expect``, the batch."""
    with no_hang(), watch_allocations(worker.segment.capacity) as seen, late_errors():
        got = accepted(lambda: decoded(make(), ahead))
        assert not seen.refused, f"the loader asked for {seen.refused}"
        pool = loader.pool
        if pool is not None:
            assert pool.arena_bytes <= seen.pool_limit, pool.arena_bytes
        if got is not None:
            assert_inside(got, worker.segment.capacity)
        if expect is not None:
            assert got is not None, "a valid handle was refused"
            assert_same(expect, got)
        del got
    assert_slots_back(loader)


# --------------------------------------------------------------------------- 1. handle fields


@pytest.fixture(scope="module")
def decoy() -> Iterator[int]:
    """The fd of a file like a segment but far larger (see DECOY_SIZE)."""
    fd = sealed_memfd(b"not a segment", fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, DECOY_SIZE)
    yield fd
    os.close(fd)


def test_batch_handle_fields(decoy: int) -> None:
    """A BatchHandle's state with up to three fields replaced by anything: on the segment's
    first use (naming it, or a larger file that is no segment) or a later one, with a pool
    made at the first batch or given its size, with oversize batches refused or copied,
    decoded by the pin thread first or not."""
    worker = Worker()
    names = BatchHandle._STATE
    with loader_side() as warm:  # torch and the pool open what they keep open
        worker.refill()
        state = worker.handle(warm._pinpool_receiver.token, True).__getstate__()
        check_batch_handle(warm, worker, lambda: received(state), False, worker.batch)

    @FUZZ
    @given(st.data())
    def fuzz(data: Any) -> None:
        first = data.draw(st.booleans(), label="first use of the segment")
        lazy = data.draw(st.booleans(), label="pool made at the first batch")
        oversize = data.draw(st.sampled_from(["error", "copy"]), label="oversize")
        ahead = data.draw(st.booleans(), label="pin thread first")
        extra = {} if lazy else {"slot_bytes": 2 << 20}
        with no_fd_left():  # once the loader is gone
            with loader_side(oversize=oversize, **extra) as loader:
                token = loader._pinpool_receiver.token
                if not first:  # an earlier batch announced the segment
                    worker.refill()
                    state = worker.handle(token, True).__getstate__()
                    check_batch_handle(loader, worker, lambda: received(state), False, worker.batch)
                worker.refill()
                valid = worker.handle(token, first).__getstate__()
                named = "segment"
                if first:
                    named = data.draw(st.sampled_from(["segment", "decoy"]), label="names")
                if named == "decoy":  # as a segment would be named, with the decoy's size
                    valid = (*valid[:3], (os.getpid(), decoy), DECOY_SIZE, *valid[5:])
                state, changed = corrupted(
                    data,
                    valid,
                    names,
                    lambda n, v: corrupt_batch_field(n, v, [worker.segment.fd, decoy]),
                )
                expect = None if changed or named == "decoy" else worker.batch
                check_batch_handle(loader, worker, lambda: received(state), ahead, expect)
            del loader

    fuzz()


def one_slot_handle(data: Any, worker: Worker) -> None:
    # (A worker, never started, so that the loader grants zero-copy slots.)
    with loader_side(zero_copy=True, slot_bytes=CAPACITY, num_slots=3, num_workers=1) as loader:
        receiver = loader._pinpool_receiver
        grants = receiver.grants
        grants.open(1)
        task = ZeroCopyTask(1, 0)
        sent = destination.write(receiver.token, 4, worker.plan, task, grants.desk, None)
        assert sent.slot is not None, "the worker's path did not get a slot"
        try:
            state, changed = corrupted(data, sent.__getstate__(), SLOT_FIELDS, corrupt_slot_field)
            with no_hang(), late_errors():
                got = accepted(lambda: decoded(received(state), False))
                if got is not None:
                    assert_inside(got, CAPACITY)
                if not changed:
                    assert got is not None, "a valid handle was refused"
                    assert_same(worker.batch, got)
                del got
        finally:
            # The loader takes back a slot whose batch never came (the iterator's end).
            grants.take_back(sent.slot)
            desk.disconnect()  # (this process asked as a worker does)
        assert_slots_back(loader)


def test_slot_handle_fields() -> None:
    """Zero-copy: the state of a handle naming a slot, with up to three fields replaced by
    anything, for a slot really handed out, written through the worker's own path
    (``destination.write``)."""
    worker = Worker()

    @FUZZ
    @given(st.data())
    def fuzz(data: Any) -> None:
        with no_fd_left():  # once the loader is gone
            one_slot_handle(data, worker)

    fuzz()


# --------------------------------------------------------------------------- 2. raw handle bytes


def announced(loader: pinpool.DataLoader, worker: Worker, first: bool) -> str:
    """The loader's token, with the worker's segment already received once unless ``first``
    (then the next handle is a later one); the segment refilled for the next handle."""
    token = loader._pinpool_receiver.token
    if not first:
        worker.refill()
        state = worker.handle(token, True).__getstate__()
        check_batch_handle(loader, worker, lambda: received(state), False, worker.batch)
    worker.refill()
    return token


@st.composite
def damage(draw: Any, raw: bytes) -> bytes:
    """``raw`` with a few bytes changed (set, a bit flipped, one up or down), and now and
    then some inserted or the end cut off."""
    out = bytearray(raw)
    edits = st.tuples(st.integers(0, len(raw) - 1), st.sampled_from("=^+-"), st.integers(0, 255))
    for at, how, value in draw(st.lists(edits, min_size=1, max_size=4)):
        if how == "=":
            out[at] = value
        elif how == "^":
            out[at] ^= 1 << value % 8
        else:
            out[at] = (out[at] + (1 if how == "+" else -1)) % 256
    if draw(st.integers(0, 7)) == 0:
        at = draw(st.integers(0, len(raw)))
        out[at:at] = draw(st.binary(min_size=1, max_size=8))
    if draw(st.integers(0, 7)) == 0:
        del out[draw(st.integers(0, len(out))) :]
    return bytes(out)


PINPOOL_DIR = os.path.dirname(pinpool.__file__)


def unpickled(raw: bytes) -> Any:
    """``pickle.loads(raw)``, or None when pickle refuses the bytes: any error is pickle's
    right, and a state that does not fit (``__setstate__``'s own), but not one raised
    deeper in pinpool (unpickling a BatchHandle only sets its fields)."""
    with address_space_cap(1 << 30):
        try:
            return pickle.loads(raw)
        except PinPoolError:
            raise
        except Exception as exc:
            tb = exc.__traceback__
            while tb is not None:
                code = tb.tb_frame.f_code
                if code.co_filename.startswith(PINPOOL_DIR) and code.co_name != "__setstate__":
                    raise
                tb = tb.tb_next
            return None


def test_batch_handle_bytes() -> None:
    """The pickled bytes of a real BatchHandle, damaged: pickle may refuse them; a handle
    that comes out is held to the rules of the fields test."""
    worker = Worker()

    @FUZZ
    @given(st.data())
    def fuzz(data: Any) -> None:
        first = data.draw(st.booleans(), label="first use of the segment")
        protocol = data.draw(st.sampled_from([2, pickle.DEFAULT_PROTOCOL]), label="protocol")
        ahead = data.draw(st.booleans(), label="pin thread first")
        with no_fd_left():  # once the loader is gone
            with loader_side() as loader:
                token = announced(loader, worker, first)
                raw = pickle.dumps(worker.handle(token, first), protocol)
                bad = data.draw(damage(raw), label="bytes")
                expect = worker.batch if bad == raw else None
                check_batch_handle(loader, worker, lambda: unpickled(bad), ahead, expect)
            del loader

    fuzz()


def test_worker_progress_bytes() -> None:
    """The pickled bytes of a resumable iterable dataset's batch (a WorkerProgress around a
    plain batch), damaged: pickle may refuse them; what comes out is pinned ahead and read in
    its turn with nothing but PinPoolError, and a worker it names is one of the loader's."""
    progress = WorkerProgress({"x": torch.arange(6)}, 1, {"position": 3})

    @FUZZ
    @given(st.data())
    def fuzz(data: Any) -> None:
        protocol = data.draw(st.sampled_from([2, pickle.DEFAULT_PROTOCOL]), label="protocol")
        raw = pickle.dumps(progress, protocol)
        got = unpickled(data.draw(damage(raw), label="bytes"))
        if not isinstance(got, WorkerProgress):
            return  # (pickle refused the bytes, or made something else)
        try:
            _, worker, _ = got.pin_memory().fields(num_workers=2)
        except PinPoolError:
            return
        assert worker in (0, 1)

    fuzz()


def test_a_worker_progress_without_its_fields_is_refused_clearly() -> None:
    empty = WorkerProgress.__new__(WorkerProgress)  # (a pickle that stopped before its state)
    assert empty.pin_memory() is empty
    with pytest.raises(PinPoolError, match="carries none of its fields"):
        empty.fields(num_workers=2)
    with pytest.raises(PinPoolError, match="names worker 2 of 2"):
        WorkerProgress(None, 2, {}).fields(num_workers=2)
    with pytest.raises(PinPoolError, match="names worker True"):
        WorkerProgress(None, True, {}).fields(num_workers=2)
    assert WorkerProgress("batch", 1, "state").fields(num_workers=2) == ("batch", 1, "state")


# --------------------------------------------------------------------------- 3. segment headers

MAGIC = b"PINPSEG1"
SEALS = {
    "shrink": fcntl.F_SEAL_SHRINK,
    "grow": fcntl.F_SEAL_GROW,
    "write": fcntl.F_SEAL_WRITE,
    "seal": fcntl.F_SEAL_SEAL,
}


#: What one segment may lie about: its header as a whole (arbitrary bytes), or one of its
#: fields; its size (a memfd of any size, not a worker's), its seals; or the claim made for
#: it (the length and the nonce a handle says it has).
LIES = ["header", "magic", "capacity", "nonce", "size", "seals", "length", "claimed nonce"]


def header_for(data: Any, capacity: int, nonce: int, lies: set[str]) -> bytes:
    """64 header bytes laid out as ``src/transport/segment/header.rs`` says, right but for
    ``lies``; the state word, the padding and the rest are arbitrary."""
    if "header" in lies:
        return data.draw(st.binary(min_size=64, max_size=64), label="header")
    magic = MAGIC
    if "magic" in lies:
        magic = data.draw(st.binary(min_size=8, max_size=8), label="magic")
    if "capacity" in lies:
        capacity = data.draw(st.one_of(near(capacity), U64), label="capacity field")
    if "nonce" in lies:
        nonce = data.draw(U64, label="nonce field")
    state = data.draw(st.integers(0, 2**32 - 1), label="state word")
    pad = data.draw(st.binary(min_size=4, max_size=4), label="padding")
    tail = data.draw(st.binary(min_size=32, max_size=32), label="rest")
    fields = struct.pack("=QQ", capacity % 2**64, nonce)
    return magic + struct.pack("=I", state) + pad + fields + tail


def sealed_memfd(content: bytes, seals: int, size: int | None = None) -> int:
    """A memfd of ``size`` bytes (default: the content's) that starts with ``content``."""
    fd = os.memfd_create("pinpool-fuzz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, len(content) if size is None else size)
    os.pwrite(fd, content, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def copy_ranges(data: Any, src_limit: int, dst_limit: int) -> list[tuple[int, int, int]]:
    src = st.one_of(st.integers(0, src_limit), U64)
    dst = st.one_of(st.integers(0, dst_limit), U64)
    size = st.one_of(st.integers(0, 2 * PAGE), U64)
    return data.draw(st.lists(st.tuples(src, dst, size), max_size=3), label="ranges")


def check_copied(
    fd: int, ranges: list[tuple[int, int, int]], capacity: int, out: bytes | bytearray
) -> None:
    """A copy that succeeded read only inside the data area, and read the right bytes."""
    for src, dst, size in ranges:
        assert src + size <= capacity, f"read {size} bytes at {src} of {capacity}"
        want = os.pread(fd, size, SEGMENT_DATA_OFFSET + src)
        assert bytes(out[dst : dst + size]) == want, (src, dst, size)


def test_segment_headers(make_pool: Any) -> None:
    """Arbitrary bytes over the header of a real worker segment (or of a memfd of any size
    and seals, made here), claimed with any length and nonce, a few lies at a time:
    ``SegmentCache.insert`` takes only a segment whose header matches the claim, and copies
    out of it stay inside its data area. Only PinPoolErrors come out; no fd is left open."""
    pool = make_pool(2 * PAGE, 1)
    cache = SegmentCache(pool)
    rng = np.random.default_rng(0)

    @FUZZ
    @given(st.data())
    def fuzz(data: Any) -> None:
        pool.flush()
        with no_fd_left(pool.flush, note=True):
            one_segment(data)

    def one_segment(data: Any) -> None:
        lies = data.draw(st.sets(st.sampled_from(LIES), max_size=2), label="lies")
        keep: Any = None
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        if "size" in lies or "seals" in lies:  # a memfd made here
            size = 1 + data.draw(st.sampled_from([1, 2, 3]), label="pages") * PAGE
            if "size" in lies:
                size = data.draw(st.integers(0, 4 * PAGE), label="file size")
            if "seals" in lies:
                chosen = data.draw(st.sets(st.sampled_from(sorted(SEALS))), label="seals")
                seals = sum(SEALS[s] for s in chosen)
            nonce = data.draw(U64, label="nonce")
            header = header_for(data, size - SEGMENT_DATA_OFFSET, nonce, lies)
            body = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            fd = sealed_memfd((header + body[64:])[:size], seals)
        else:  # a worker's segment
            keep = WorkerSegment(data.draw(st.sampled_from([PAGE, 3 * PAGE]), label="capacity"))
            fd, size, nonce = keep.fd, keep.total_len, keep.nonce
            with memoryview(keep) as mv:
                mv[:] = rng.integers(0, 256, keep.capacity, dtype=np.uint8).tobytes()
            header = header_for(data, keep.capacity, nonce, lies)
            os.pwrite(fd, header, 0)
        # Any length and nonce a u64 holds (test_segment_claims_of_any_size tries the others).
        total_len, claimed = size, nonce
        if "length" in lies:
            near_size = near(size).map(lambda v: v % 2**64)
            total_len = data.draw(st.one_of(near_size, U64), label="claimed length")
        if "claimed nonce" in lies:
            claimed = data.draw(st.one_of(near(nonce).map(lambda v: v % 2**64), U64), label="nonce")
        key = (data.draw(U64, label="worker"), data.draw(st.integers(0, 2**32 - 1), label="id"))
        try:
            with no_hang():
                inserted = accepted(
                    lambda: cache.insert(key, os.dup(fd), total_len, claimed) is None
                )
                if inserted:
                    capacity = total_len - SEGMENT_DATA_OFFSET
                    assert header[:8] == MAGIC, header
                    assert struct.unpack_from("=QQ", header, 16) == (capacity, claimed), header
                    assert total_len <= size, (total_len, size)
                    assert seals & fcntl.F_SEAL_SHRINK, seals
                    ranges = copy_ranges(data, capacity, 2 * PAGE)
                    with pool.checkout() as slot:
                        if accepted(lambda: cache.copy(key, slot, ranges)) is not None:
                            check_copied(fd, ranges, capacity, bytes(memoryview(slot)))
                    target = bytearray(data.draw(st.integers(0, 2 * PAGE), label="buffer"))
                    if accepted(lambda: cache.copy(key, target, ranges)) is not None:
                        check_copied(fd, ranges, capacity, target)
                    cache.hand_back(key)
                    assert os.pread(fd, 4, 8) == bytes(4), "release() left the segment busy"
                    assert cache.retire(key)
                else:
                    assert key not in cache
        finally:
            cache.retire(key)  # (already done, unless a check failed)
            if keep is None:
                os.close(fd)
            del keep

    fuzz()


def test_segment_claims_of_any_size(make_pool: Any) -> None:
    """``SegmentCache.insert`` with any integer for the length and the nonce (whatever the
    loader checks first): a PinPoolError or success, and the fd it was given is closed
    either way (it owns the fd, by its documentation)."""
    pool = make_pool(PAGE, 1)
    cache = SegmentCache(pool)
    seg = WorkerSegment(PAGE)

    @FUZZ
    @given(
        total_len=st.one_of(st.just(seg.total_len), near(seg.total_len), INTS),
        nonce=st.one_of(st.just(seg.nonce), near(seg.nonce), INTS),
    )
    def fuzz(total_len: int, nonce: int) -> None:
        pool.flush()
        with no_fd_left(pool.flush, note=True), no_hang():
            given_fd = os.dup(seg.fd)
            if accepted(lambda: cache.insert((1, 0), given_fd, total_len, nonce) is None):
                assert (total_len, nonce) == (seg.total_len, seg.nonce)
                assert cache.retire((1, 0))

    fuzz()


@pytest.mark.parametrize("first", [True, False])
def test_an_undamaged_handle_decodes(first: bool) -> None:
    """The fuzzers' starting point is sound: the handle they damage decodes to the batch,
    through pickle as through ``__setstate__``."""
    worker = Worker()
    with loader_side() as loader:
        token = announced(loader, worker, first)
        raw = pickle.dumps(worker.handle(token, first))
        check_batch_handle(loader, worker, lambda: unpickled(raw), True, worker.batch)
        assert loader.stats()["batches"] == (1 if first else 2)


# --------------------------------------------------------------------------- resume states


class Positions(torch.utils.data.IterableDataset[Any]):
    """An iterable dataset that resumes from its own ``state_dict()`` (each worker's copy its
    own shard). Its state's contents are its own business: fuzzed states only replace whole
    per-worker states, and it reads what it finds leniently."""

    def __init__(self) -> None:
        self.done = 0
        self.start = 0

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = range(worker, 13, workers)
        self.done, self.start = min(max(self.start, 0), len(mine)), 0
        while self.done < len(mine):
            self.done += 1
            yield torch.full((3,), float(mine[self.done - 1]))

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        start = state.get("done", 0)
        self.start = start if type(start) is int else 0


def _resume_loader(kind: str) -> pinpool.DataLoader:
    if kind == "map":
        return pinpool.DataLoader(
            Indexed(13), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(3)
        )
    return pinpool.DataLoader(Positions(), batch_size=3, num_workers=2 if kind == "workers" else 0)


def _value_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into the nested dicts of a state (not into a dataset's own state, whose
    meaning is the dataset's)."""
    out = [path] if path else []
    if (
        isinstance(value, dict)
        and path[-1:] not in (("dataset",),)
        and path[:2]
        != (
            "workers",
            "states",
        )
    ):
        for key, inner in value.items():
            out += _value_paths(inner, (*path, key))
    elif isinstance(value, dict) and path == ("workers", "states"):
        out += [(*path, key) for key in value]
    return out


#: What a state's value may be replaced with: anything, and things that look nearly right.
RESUME_VALUES = st.one_of(
    ANY,
    st.just(torch.get_rng_state()),
    st.integers(0, 256).map(lambda n: torch.randint(0, 256, (n,), dtype=torch.uint8)),
    st.just(torch.zeros(5056, dtype=torch.uint8)),
    st.dictionaries(st.sampled_from(["rng", "generators", "done", "states", "next"]), INTS),
    st.integers(-3, 5),
)
_GONE = object()


def test_resume_states() -> None:
    """A real mid-epoch state (a shuffled map-style loader with a generator; an iterable
    dataset's, with and without workers) with up to three values replaced by anything,
    removed, or added: ``load_state_dict`` raises a clear ``InvalidArgument`` at once, or the
    state loads and the next two epochs run to their ends, without an error or a hang."""
    states = {}
    for kind in ("map", "iterable", "workers"):
        loader = _resume_loader(kind)
        it = iter(loader)
        next(it)
        next(it)
        states[kind] = loader.state_dict()
        del it, loader
    gc.collect()

    @FUZZ
    @given(st.data())
    def fuzz(data: Any) -> None:
        kind = data.draw(st.sampled_from(sorted(states)), label="loader")
        state = copy.deepcopy(states[kind])
        for _ in range(data.draw(st.integers(1, 3), label="changes")):
            paths = _value_paths(state)
            path = data.draw(st.sampled_from(paths), label="path")
            value = data.draw(st.one_of(RESUME_VALUES, st.just(_GONE)), label="value")
            where = state
            for key in path[:-1]:
                where = where[key]
            if not isinstance(where, dict):
                continue
            if value is _GONE:
                where.pop(path[-1], None)
            else:
                where[path[-1]] = value
        if data.draw(st.booleans(), label="extra key"):
            state.setdefault("workers", {})
        loader = _resume_loader(kind)
        with no_hang():
            try:
                loader.load_state_dict(state)
            except pinpool.InvalidArgument as exc:
                assert "state" in str(exc), exc
                event("refused")
                return
            event("accepted")
            for _ in range(2):
                for batch in loader:
                    rows = batch["x"] if kind == "map" else batch
                    assert isinstance(rows, torch.Tensor) and 1 <= rows.shape[0] <= 3
            del loader
            gc.collect()

    fuzz()


# --------------------------------------------------------------------------- pool hints

#: The largest arena a hint may make here; a larger request is recorded and refused before
#: anything is allocated (a real hint may cost what the batches it announces would).
HINT_ARENA_LIMIT = 512 << 20

HINT_VALUES = st.one_of(
    st.integers(-(1 << 63), (1 << 63) - 1),
    st.integers(-4, 1 << 16),
    st.integers(1 << 16, 64 << 20),
    st.sampled_from([0, 1, PAGE - 1, PAGE, PAGE + 1, 1 << 40, (1 << 63) - 1]),
)


def test_pool_hints() -> None:
    """What a worker's process may write into the pool-hint pipe: any bytes, or two int64s of
    any value. The hint's thread ends at once, logging at most a warning; it makes at most one
    pool, sized for the bytes announced (never for a sample count, never beyond the memory's
    share); and the first real batch is taken, in a pool no more than twice what that batch
    alone would have made unless the pool was used meanwhile."""

    made: list[int] = []
    real_pool = pinpool._main.route.lazy_pool.PinPool

    def watched(*args: Any, **kwargs: Any) -> Any:
        arena = kwargs.get("arena_bytes") or 0
        made.append(arena)
        if arena > HINT_ARENA_LIMIT:
            raise pinpool.BatchTooLarge("refused by the test", arena, HINT_ARENA_LIMIT)
        return real_pool(*args, **kwargs)

    # Each example makes a pool or two: fewer of them in the bounded run.
    @settings(FUZZ, max_examples=FUZZ.max_examples if _EXAMPLES else 40)
    @given(st.data())
    def fuzz(data: Any) -> None:
        if data.draw(st.booleans(), label="packed"):
            announced = data.draw(HINT_VALUES, label="bytes")
            count = data.draw(HINT_VALUES, label="samples")
            payload = struct.pack("<qq", announced, count)
        else:
            payload = data.draw(st.binary(max_size=80), label="raw")
            announced = count = None
        real = data.draw(st.integers(1, 32 << 20), label="real batch")
        made.clear()
        fds = open_fd_count()
        with no_hang():
            one_hint(payload, announced, count, real, made)
        gc.collect()
        assert open_fd_count() <= fds

    with contextlib.ExitStack() as stack:
        stack.callback(setattr, pinpool._main.route.lazy_pool, "PinPool", real_pool)
        pinpool._main.route.lazy_pool.PinPool = watched  # type: ignore[misc,assignment]
        fuzz()


def one_hint(
    payload: bytes, announced: int | None, count: int | None, real: int, made: list[int]
) -> None:
    """One example of :func:`test_pool_hints`: ``payload`` into a fresh loader's hint pipe,
    then a real first batch of ``real`` bytes."""
    from pinpool._wire.pool_hint import PoolHint

    loader = pinpool.DataLoader(Indexed(4), batch_size=2, num_workers=0)
    receiver = loader._pinpool_receiver
    hint = PoolHint()
    try:
        hint.watch(receiver.pools.make_from_hint, lambda: receiver.pool is None)
        assert hint._writer is not None
        hint._writer.send_bytes(payload)
        thread = hint._thread
        assert thread is not None
        thread.join(10)
        assert not thread.is_alive(), "the hint's thread did not end"
        hinted = receiver.pool
        assert len(made) <= 1
        if hinted is not None:
            assert announced is not None and announced > 0
            assert made == [receiver.pools.sizing.plan(announced).arena]
            assert hinted.arena_bytes == made[0] <= HINT_ARENA_LIMIT
        elif announced is not None and announced > 0 and count is not None and count > 0:
            # Refused, and logged: by the sizing (over the memory's share) or here.
            assert all(arena > HINT_ARENA_LIMIT for arena in made), made
        else:
            assert not made, made
        pool, _ = receiver.pools.pool_for(real)
        assert pool.largest_slot >= real
        assert pool.arena_bytes <= 2 * receiver.pools.sizing.plan(real).arena
    finally:
        hint.close()
        receiver.close()
