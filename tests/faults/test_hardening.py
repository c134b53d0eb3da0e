"""Hostile and careless input: each case here once crashed the interpreter, returned wrong data
or stalled, and must now give a clear ``PinPoolError`` (or torch's own behaviour) and lose
nothing.

- views of slot memory with dtypes that have no plain bytes (quantized, sub-byte);
- ``SegmentCache.insert`` of a file that could shrink under the mapping (SIGBUS on the next
  read);
- a dataset whose ``__getitems__`` returns a whole batch rather than a list of samples;
- a forked child checking out slots of its parent's pool;
- pinpool's own errors keeping torch's iterator (and its workers) alive in a reference cycle;
- a handle whose claimed size sizes the pool before anything checks it;
- unbounded thread counts.
"""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from conftest import make_memfd, open_fds
from handles import HandleFactory
from loader_datasets import ArenaWatcher, Exiting, Indexed, ReadyBatches, ready_batch

import pinpool
from pinpool import InvalidArgument, OutOfBounds, PinPoolError, WorkerLost
from pinpool._main.epochs import ending_thread
from pinpool._main.settings.sizing import MIN_ARENA
from pinpool._wire.handle import BatchHandle

MiB = 1 << 20


# --------------------------------------------------------------------------- slot views


def test_slot_views_refuse_dtypes_without_plain_bytes() -> None:
    # Run in a child: on a build without the check, the first of these kills the interpreter.
    code = textwrap.dedent(
        """
        import torch, pinpool
        pool = pinpool.PinPool(4096, 1, device="cpu")
        slot = pool.checkout()
        refused = []
        for name in ("quint8", "qint8", "qint32", "quint4x2", "bits8", "uint4", "int4"):
            try:
                slot.view(getattr(torch, name), (2,)).sum()
            except pinpool.InvalidArgument as exc:
                assert "dtype" in str(exc), exc
                refused.append(name)
        # Plain dtypes still work, numpy names included.
        assert slot.view(torch.bfloat16, (4,)).dtype == torch.bfloat16
        assert slot.view("float32", (4,)).dtype == torch.float32
        print(",".join(refused))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"rc {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.split() == ["quint8,qint8,qint32,quint4x2,bits8,uint4,int4"]


# --------------------------------------------------------------------------- segment seals


def test_segments_that_can_shrink_are_refused(make_pool: Any, fd_count: Any) -> None:
    pool = make_pool(4096, 1)
    cache = pinpool.SegmentCache(pool)
    ws = pinpool.WorkerSegment(4096)
    header = os.pread(ws.fd, pinpool.SEGMENT_DATA_OFFSET, 0)
    before = fd_count()
    unsealed = make_memfd(ws.total_len, seal=False)
    with tempfile.TemporaryFile() as f:
        f.truncate(ws.total_len)
        for fd in (unsealed, f.fileno()):
            os.pwrite(fd, header, 0)  # a valid header, so only the missing seal is wrong
            with pytest.raises(InvalidArgument, match="sealed"):
                pinpool.check_segment((1, 0), fd, ws.total_len, ws.nonce)
            with pytest.raises(InvalidArgument, match="sealed"):
                cache.insert((1, 0), os.dup(fd), ws.total_len, ws.nonce)
    os.close(unsealed)
    # A worker's segment maps, and can no longer be truncated under the mapping.
    cache.insert((1, 0), os.dup(ws.fd), ws.total_len, ws.nonce)
    with pool.checkout() as slot:
        with pytest.raises(OSError):
            os.ftruncate(ws.fd, 0)
        assert cache.copy((1, 0), slot, [(0, 0, 4096 // 2)]) == 2048
    cache.retire((1, 0))
    pool.flush()
    assert fd_count() == before


# --------------------------------------------------------------------------- __getitems__


@pytest.mark.parametrize("kind", ["dict", "tensor"])
def test_a_dataset_returning_whole_batches_gets_what_torch_gives(kind: str) -> None:
    ds = ReadyBatches(8, kind)
    kw: dict[str, Any] = {"batch_size": 4, "num_workers": 1}
    want = list(torch.utils.data.DataLoader(ds, collate_fn=ready_batch, **kw))
    for zero_copy in (False, True):
        got = list(pinpool.DataLoader(ds, collate_fn=ready_batch, zero_copy=zero_copy, **kw))
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert type(a) is type(b)
            if kind == "dict":
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            else:
                assert torch.equal(a, b)
    # With the default collation, torch's outcome too (for these, an error of the same kind).
    outcomes = []
    for make in (torch.utils.data.DataLoader, pinpool.DataLoader):
        try:
            outcomes.append(list(make(ds, **kw)))
        except Exception as exc:
            outcomes.append(type(exc))
            # The frames hold torch's iterator in a cycle of torch's own: clear them, so it
            # shuts its workers down now, not when the garbage collector finds it.
            traceback.clear_frames(exc.__traceback__)
    if isinstance(outcomes[0], list):
        assert all(torch.equal(a, b) for a, b in zip(outcomes[1], outcomes[0], strict=True))
    else:
        assert outcomes[1] is outcomes[0], outcomes


# --------------------------------------------------------------------------- fork


def test_a_forked_child_cannot_check_out_its_parents_slots(make_pool: Any) -> None:
    pool = make_pool(4096, 2)
    held = pool.checkout()
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        status = 1
        try:
            refused = 0
            for attempt in (pool.try_checkout, lambda: pool.checkout(timeout=0)):
                try:
                    attempt()
                except InvalidArgument as exc:
                    refused += "forked child" in str(exc)
            status = 0 if refused == 2 else 2
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's slots are untouched: one held, one free, and both still usable here.
    assert pool.stats()["slots_checked_out"] == 1
    with pool.checkout(timeout=0) as other:
        assert other.index != held.index
    held.release()


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "arg",
    [
        {"num_slots": 0},
        {"num_slots": -3},
        {"slot_bytes": 0},
        {"copy_threads": 100_000},
        {"copy_threads": 0},
        {"worker_copy_threads": 100_000},
        {"slot_timeout": -1.0},
    ],
)
def test_bad_loader_settings_fail_at_construction(arg: dict[str, Any]) -> None:
    # Not at the first batch, in the middle of an epoch (and from a worker's handle).
    with pytest.raises(InvalidArgument, match=next(iter(arg))):
        pinpool.DataLoader(Indexed(4), batch_size=2, num_workers=1, **arg)


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_handle_met_after_its_loader_closed_opens_nothing() -> None:
    # Its segment would be held in the cache for good: nothing retires segments after close.
    # (A pool of the caller's stays open when the loader closes.)
    pool = pinpool.PinPool(MiB, 2, device="cpu")
    loader = pinpool.DataLoader(Indexed(4), batch_size=2, pool=pool)
    make = HandleFactory(loader)
    taken, dropped = make.make(), make.make()
    loader._pinpool_receiver.close()
    fds = open_fds()
    with pytest.raises(PinPoolError, match="loader was closed"):
        taken.take()
    del dropped
    gc.collect()
    assert not open_fds() - fds
    assert loader._pinpool_receiver.cache is None or len(loader._pinpool_receiver.cache) == 0


class Marker:
    """Something a frame holds; dies by reference count unless a cycle keeps the frame."""


def test_an_error_taking_a_batch_is_raised_without_a_reference_cycle() -> None:
    loader = pinpool.DataLoader(Indexed(4), batch_size=2, slot_bytes=MiB, num_slots=2)
    make = HandleFactory(loader)
    handle = make.make(origin=(_dead_pid(), make.segment.fd))
    gc.disable()
    try:

        def consume(h: BatchHandle, error: type[BaseException], text: str) -> weakref.ref[Marker]:
            marker = Marker()  # stands for torch's iterator, up the stack
            ref = weakref.ref(marker)
            try:
                h.take()
            except error as exc:
                assert text in str(exc)
            return ref

        # The worker is gone; then the handle, dropped, cannot be taken again. Each error is
        # raised without a cycle.
        for error, text in ((WorkerLost, "exited"), (PinPoolError, "taken or dropped")):
            ref = consume(handle, error, text)
            assert ref() is None, "the frame that raised is kept alive by a cycle"
    finally:
        gc.enable()
    del handle, loader
    gc.collect()


def test_foreign_errors_while_receiving_reach_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's SIGCHLD handler raises RuntimeError in the main thread at any moment, also while
    # a batch is taken: torch must see it (to mark the worker failed), not a pinpool error.
    # Unpickling a handle does nothing at all (it touches no segment and no pool).
    loader = pinpool.DataLoader(Indexed(4), batch_size=2, slot_bytes=MiB, num_slots=2)
    make = HandleFactory(loader)
    good = make.make()
    state = good.__getstate__()
    calls = []
    raised = []
    receive = type(loader._pinpool_receiver.intake).receive

    def worker_died(self: Any, handle: Any) -> Any:
        calls.append(handle)
        if not raised:  # (a handler raises once, where it lands)
            raised.append(handle)
            raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed.")
        return receive(self, handle)

    monkeypatch.setattr(type(loader._pinpool_receiver.intake), "receive", worker_died)
    h = BatchHandle.__new__(BatchHandle)
    h.__setstate__(state)
    assert not calls, "unpickling a handle acted on it"
    with pytest.raises(RuntimeError, match="killed by signal"):
        h.take()
    assert calls
    calls.clear()
    del good, h, loader
    gc.collect()


def test_a_lost_worker_leaves_nothing_alive_once_the_iterator_is_dropped() -> None:
    # As a user writes it: catch the error, keep its text, drop the iterator. torch's iterator
    # must die at once (no cycle), shutting its workers down, without the garbage collector.
    pool = pinpool.PinPool(8 * MiB, 4, device="cpu")
    sizes = [10, 10, 3 * MiB, 3 * MiB, 10, 10]
    loader = pinpool.DataLoader(
        Exiting(sizes, bad=4), batch_size=2, num_workers=1, timeout=10, pool=pool
    )
    it = iter(loader)
    inner = weakref.ref(it._inner)
    message = ""
    gc.disable()
    try:
        try:
            for batch in it:
                del batch
                time.sleep(0.3)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
        assert "DataLoader worker (pid" in message, message
        del it
        assert inner() is None, f"torch's iterator outlived `del` after {message!r}"
    finally:
        gc.enable()
    del loader
    gc.collect()
    pool.flush()
    s = pool.stats()
    assert s["slots_free"] == pool.num_slots and s["segments_mapped"] == s["segments_unmapped"], s


# --------------------------------------------------------------------------- sizes


def test_a_handle_claiming_more_than_its_segment_sizes_nothing() -> None:
    loader = pinpool.DataLoader(Indexed(4), batch_size=2)  # the pool is made from batch 1
    make = HandleFactory(loader)  # a 64 KiB segment
    seg = make.segment
    lies = {
        "nbytes": {"nbytes": 512 * MiB},
        "total_len": {"total_len": 512 * MiB + seg.total_len, "nbytes": 512 * MiB},
        "count": {"count": 0},
    }
    for name, fields in lies.items():
        h = make.make(**fields)
        with pytest.raises(OutOfBounds):
            h.take()
        assert loader.pool is None, f"a handle lying about {name} made a pool"
        del h
    # An honest handle still makes a pool sized from its batch.
    assert make.make().take()["a"].tolist() == list(range(10))
    assert loader.pool is not None and loader.pool.arena_bytes == MIN_ARENA


def test_a_handles_sample_count_scales_nothing() -> None:
    """A handle for a real 64 KiB segment that says it holds 1 sample, on a loader of 2**20
    samples a batch: the arena is sized from the bytes that arrived (the smallest arena), not
    a million times them (nor is an honest short last batch arriving first scaled up)."""
    loader = pinpool.DataLoader(Indexed(4), batch_size=1 << 20)
    make = HandleFactory(loader)
    assert make.make(count=1).take()["a"].tolist() == list(range(10))
    assert loader.pool is not None and loader.pool.arena_bytes == MIN_ARENA


def test_automatic_sizing_is_capped_by_available_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import pinpool._main.settings.sizing

    monkeypatch.setattr(pinpool._main.settings.sizing, "available_memory", lambda: 16 * MiB)
    # A first batch of 4 MiB: the arena may take 8 MiB, so it holds two batches of 4 MiB.
    loader = pinpool.DataLoader(Indexed(4), batch_size=2, num_workers=0)
    pools = loader._pinpool_receiver.pools
    pool, _ = pools.pool_for(4 * MiB)
    assert pool.arena_bytes <= 8 * MiB and pool.largest_slot >= 4 * MiB
    # A first batch of 6 MiB: no arena of two of it fits; the arena is what fits, and the
    # batch gets memory of its own (counted), or, with oversize="error", a clear error.
    for oversize in ("pin", "error"):
        loader = pinpool.DataLoader(Indexed(4), batch_size=2, num_workers=0, oversize=oversize)
        pools = loader._pinpool_receiver.pools
        pool, _ = pools.pool_for(6 * MiB)
        assert pool.arena_bytes <= 8 * MiB and pools.max_batch < 6 * MiB
        if oversize == "error":
            with pytest.raises(pinpool.BatchTooLarge, match="memory available") as info:
                pools.claim(pool, 6 * MiB)
            del info
        else:
            own = pools.claim(pool, 6 * MiB)
            assert isinstance(own, torch.Tensor) and own.nbytes == 6 * MiB
            assert pools.oversize_batches == 1
            del own


def test_ranks_on_one_host_share_the_memory_automatic_sizing_may_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pinpool._main.settings.sizing

    monkeypatch.setattr(pinpool._main.settings.sizing, "available_memory", lambda: 64 * MiB)
    # Batches of 5 MiB: an arena of two of them (12.5 MiB with headroom) is over a quarter of
    # half of 64 MiB (4 ranks), and within half of it for one rank (made smaller than its
    # default, 5 batches or the smallest arena, to fit).
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    loader = pinpool.DataLoader(Indexed(4), batch_size=2, num_workers=0, oversize="error")
    pools = loader._pinpool_receiver.pools
    pool, _ = pools.pool_for(5 * MiB)
    assert pool.arena_bytes <= 8 * MiB and pools.max_batch < 5 * MiB
    with pytest.raises(pinpool.BatchTooLarge, match="4 ranks on this host") as info:
        pools.claim(pool, 5 * MiB)
    del info, pool
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    loader = pinpool.DataLoader(Indexed(4), batch_size=2, num_workers=0)
    pool, _ = loader._pinpool_receiver.pools.pool_for(5 * MiB)
    assert pool.arena_bytes <= 32 * MiB
    assert pool.largest_slot >= 5 * MiB


def test_a_pool_larger_than_memory_is_refused_before_it_is_touched() -> None:
    available = pinpool._native.available_memory()
    assert available is not None
    # Twice what is available: memory another process frees between the reading above and
    # the pool's own (tests run side by side) must not let it through.
    with pytest.raises(pinpool.NotEnoughMemory, match="arena") as info:
        pinpool.PinPool(available + MiB, 2, device="cpu")
    assert isinstance(info.value, MemoryError)


# --------------------------------------------------------------------------- threads


def test_thread_counts_are_bounded(make_pool: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    t0 = time.monotonic()
    for n in (0, 65, 100_000):
        with pytest.raises(InvalidArgument, match="copy_threads"):
            make_pool(4096, 1, copy_threads=n)
    for text in ("100000", "0", "many"):
        monkeypatch.setenv("PINPOOL_COPY_THREADS", text)
        with pytest.raises(InvalidArgument, match="PINPOOL_COPY_THREADS"):
            make_pool(4096, 1)
    monkeypatch.setenv("PINPOOL_COPY_THREADS", "3")
    assert make_pool(4096, 1).copy_threads == 3
    assert time.monotonic() - t0 < 30  # refused, not attempted


# --------------------------------------------------------------------------- arguments that guessed


def test_slot_views_refuse_what_they_would_have_to_guess(make_pool: Any) -> None:
    pool = make_pool(4096, 1)
    with pool.checkout() as slot:
        # numpy reads dtype None as float64; a shape of 1.9 was truncated to 1.
        with pytest.raises(InvalidArgument, match="dtype"):
            slot.view(None, (4,))
        with pytest.raises(InvalidArgument, match="dtype"):
            slot.view(dtype=None, shape=(4,))
        for shape in ((1.9,), 1.9, (2, "3"), "12", (True,), None):
            with pytest.raises(InvalidArgument, match="shape"):
                slot.view(torch.float32, shape)
        # A negative offset: a clear error, not PyO3's OverflowError.
        for offset in (-4, -(2**70), 4.0, "8"):
            with pytest.raises(InvalidArgument, match="offset"):
                slot.view(torch.float32, (1,), offset=offset)
        # Integers of other kinds still work.
        assert slot.view(torch.float32, (np.int64(2), 3), offset=np.int32(8)).shape == (2, 3)
        assert slot.view("float32", np.int64(5)).shape == (5,)
    with pool.checkout() as slot, pytest.raises(InvalidArgument, match="dtype"):
        slot.view(None, (4,))  # the numpy path of the check too (below)


def test_numpy_slot_views_refuse_a_dtype_of_none(
    make_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pinpool._views as views

    monkeypatch.setattr(views, "_HAVE_TORCH", False)
    pool = make_pool(4096, 1)
    with pool.checkout() as slot:
        with pytest.raises(InvalidArgument, match="dtype"):
            slot.view(None, (4,))
        with pytest.raises(InvalidArgument, match="shape"):
            slot.view(np.float32, (1.9,))
        with pytest.raises(InvalidArgument, match="offset"):
            slot.view(np.float32, (1,), offset=-4)


def test_a_slot_view_honours_byte_order_or_refuses_it(make_pool: Any) -> None:
    pool = make_pool(4096, 1)
    with pool.checkout() as slot:
        np.frombuffer(memoryview(slot), ">f4", 2)[:] = [1.0, -2.5]
        swapped = ">f4" if sys.byteorder == "little" else "<f4"
        with pytest.raises(InvalidArgument, match="byte order"):
            slot.view(swapped, (2,))
        with pytest.raises(InvalidArgument, match="byte order"):
            slot.view(np.dtype(swapped), (2,))
        # Native and byte-order-free dtypes are views as before.
        native = "<f4" if sys.byteorder == "little" else ">f4"
        assert slot.view(native, (2,)).dtype == torch.float32
        assert slot.view("|u1", (2,)).dtype == torch.uint8
        assert slot.view("=i4", (2,)).dtype == torch.int32
        # numpy, without torch, keeps the byte order: big-endian 1.0 reads as 1.0.
        assert np.frombuffer(memoryview(slot), ">f4", 2).tolist() == [1.0, -2.5]


def test_negative_sizes_are_clear_errors(make_pool: Any) -> None:
    with pytest.raises(InvalidArgument, match="slot_bytes"):
        pinpool.PinPool(-1, 2, device="cpu")
    with pytest.raises(InvalidArgument, match="num_slots"):
        pinpool.PinPool(4096, -2, device="cpu")
    with pytest.raises(InvalidArgument, match="slot_bytes"):
        pinpool.DataLoader(Indexed(4), batch_size=2, slot_bytes=-1)
    with pytest.raises(InvalidArgument, match="num_slots"):
        pinpool.DataLoader(Indexed(4), batch_size=2, num_slots=-1)
    pool = make_pool(4096, 1)
    with pool.checkout() as slot, pytest.raises(InvalidArgument, match="offset"):
        slot.view(torch.uint8, (4,), offset=-4)


@pytest.mark.parametrize("timeout", [1e20, 1e300, float(2**64), 4e9])
def test_a_huge_timeout_waits_instead_of_panicking(make_pool: Any, timeout: float) -> None:
    # Run in a child: a panic prints its backtrace to stderr (checked empty) before it becomes
    # "internal error in pinpool".
    code = textwrap.dedent(
        f"""
        import threading, time, pinpool
        pool = pinpool.PinPool(4096, 1, device="cpu")
        held = pool.checkout()
        threading.Timer(0.3, held.release).start()
        t0 = time.monotonic()
        slot = pool.checkout(timeout={timeout!r})
        print("waited", round(time.monotonic() - t0, 1), slot.index)
        slot.release()
        claimed = pool.claim(timeout={timeout!r})
        print("claimed", claimed.index)
        print("flushed", pinpool.wait_for_freed_pools(timeout={timeout!r}))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "panick" not in done.stderr, done.stderr[-2000:]
    lines = done.stdout.split("\n")
    assert lines[0].startswith("waited") and lines[0].endswith(" 0"), done.stdout
    assert float(lines[0].split()[1]) >= 0.2, done.stdout
    assert lines[1:3] == ["claimed 0", "flushed True"], done.stdout


# --------------------------------------------------------------------------- out of fds


def test_running_out_of_fds_is_not_reported_as_a_dead_worker() -> None:
    # In a child: the whole process runs at its fd limit. The worker (this very process, as
    # HandleFactory builds handles) is alive; the error must say so and name the limit.
    code = textwrap.dedent(
        f"""
        import gc, os, resource, sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r})
        import pinpool
        from handles import HandleFactory
        from loader_datasets import Indexed

        loader = pinpool.DataLoader(Indexed(4), batch_size=2, slot_bytes=1 << 20, num_slots=2)
        make = HandleFactory(loader)
        batch = make.make().take()  # the pool is made, with the fds it needs
        del batch
        gc.collect()
        make.write()
        handle = make.make()  # another worker: its segment is opened through /proc
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
        held = []
        try:
            while True:
                held.append(os.dup(0))
        except OSError:
            pass
        try:
            handle.take()
        except pinpool.WorkerLost as exc:
            print("lost:", exc)
        except pinpool.PinPoolError as exc:
            print("error:", exc)
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.strip()
    assert out.startswith("error:"), out
    assert "file descriptors" in out and "EMFILE" in out and "ulimit -n" in out, out
    assert "exited" not in out.replace("not known to have exited", ""), out


def test_a_process_that_cannot_be_looked_at_is_not_taken_for_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pinpool._wire import peer

    assert peer.alive(os.getpid())
    assert not peer.alive(_dead_pid())

    def no_fds(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr("builtins.open", no_fds)
    assert peer.alive(os.getpid()), "EMFILE said the process was dead"


# --------------------------------------------------------------------------- trust model


def test_memfds_are_owner_only(make_pool: Any) -> None:
    # The kernel creates memfds with mode 0777; reopening one through /proc/<pid>/fd checks
    # the mode, so owner-only keeps every other user out.
    from pinpool._native import WorkerSegment

    pool = make_pool(1 << 16, 2)
    with pool.checkout() as slot:
        found = pool.slot_memfd(slot)
    assert found is not None, "a host arena is made of memfds"
    segment = WorkerSegment(1 << 16)
    for fd in (found[0], segment.fd):
        mode = os.fstat(fd).st_mode & 0o7777
        assert mode == 0o600, oct(mode)
        # Still open to its owner through /proc, as the main process opens a worker's.
        os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDWR))


# --------------------------------------------------------------------------- zero-copy reach


@pytest.mark.parametrize("context", ["forkserver", "fork"])
def test_a_zero_copy_worker_reaches_no_arena_between_its_batches(
    context: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A zero-copy worker maps its granted slot only while writing the batch: when it starts
    the next batch it holds no writable mapping and no descriptor of the main process's
    arena, so nothing it does then can reach a batch the consumer holds, not even while its
    pre-map thread faults in the windows of its next slots (told as likely here for batches of any
    size; pre-mapped only where windows have keys). Streamed batches are written sample by
    sample, so only a batch's first sample is made before its slot is mapped. With ``fork``
    the workers of the second epoch start after the arena exists."""
    from pinpool._main.route import grants

    monkeypatch.setattr(grants, "BIG_FROM", 1)
    gc.collect()
    pinpool.wait_for_freed_pools(timeout=60)
    for stream in (False, True):
        loader = pinpool.DataLoader(
            ArenaWatcher(48),
            batch_size=4,
            num_workers=2,
            zero_copy=True,
            multiprocessing_context=context,
            stream_samples=stream,
        )
        for _epoch in range(2):
            seen = torch.cat([b["seen"] for b in loader])
            assert sorted(seen[:, 0].tolist()) == list(range(48))
            if stream:
                seen = seen[seen[:, 0] % 4 == 0]
            reached = seen[seen[:, 1:].sum(1) > 0]
            assert len(reached) == 0, f"made while the arena was reachable: {reached.tolist()}"
        assert loader.stats()["zero_copy_batches"] >= 12, loader.stats()
        receiver_grants = loader._pinpool_receiver.grants
        assert receiver_grants.told_likely >= 2, "no worker was told of its next slots"
        # (A child forked while an arena is being freed may inherit it as it was: nothing
        # uses that arena any more, but it would count here. The last epoch's iterator, which
        # holds the arena, goes once the ending thread has shut its workers down.)
        del loader
        ending_thread.wait_all()
        gc.collect()
        pinpool.wait_for_freed_pools(timeout=60)


def test_a_kept_window_faults_on_a_write_between_batches() -> None:
    """A window a zero-copy worker keeps between batches is writable only while open: a write
    after ``close()`` (a stray pointer into a slot the consumer now holds) kills the writer
    with SIGSEGV instead of changing the consumer's batch."""
    code = textwrap.dedent(
        """
        import fcntl, os, sys
        from pinpool._native import ArenaWindow
        fd = os.memfd_create("pinpool-test", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 3 * 4096)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        window = ArenaWindow(fd, 4096, 2 * 4096)
        view = memoryview(window)
        window.open(4096, 100)
        view[:5] = b"batch"
        assert os.pread(fd, 5, 4096) == b"batch"
        print("written while open", flush=True)
        del view
        window.close()
        view = memoryview(window)
        view[:5] = b"stray"
        print("written while closed", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "written while open" in done.stdout, done.stderr
    assert "written while closed" not in done.stdout
    assert done.returncode == -11, (done.returncode, done.stderr)  # SIGSEGV


def test_a_workers_window_is_kept_for_its_next_slot_there(make_pool: Any) -> None:
    """A grant at the pages of an earlier one reopens the window kept for it (checked:
    same file, inside it); one elsewhere maps a window of its own; at most ``WINDOWS_KEPT``
    are kept, the least recently used going first."""
    from pinpool._wire.handle import WINDOWS_KEPT, SlotGrant
    from pinpool._worker import windows

    pool = make_pool(1 << 16, WINDOWS_KEPT + 4, arena_bytes=(WINDOWS_KEPT + 4) << 16)
    slots = [pool.checkout(nbytes=1 << 16) for _ in range(WINDOWS_KEPT + 1)]

    def grant(slot: Any, nonce: int) -> SlotGrant:
        fd, offset, part_len = pool.slot_memfd(slot)
        ino = os.fstat(fd).st_ino
        return SlotGrant(slot.index, 1, nonce, offset, slot.nbytes, os.getpid(), fd, part_len, ino)

    windows._WINDOWS.clear()
    first, at, new = windows.open_for(grant(slots[0], 1))
    assert at == 0 and new
    windows.close(first)
    again, _, new = windows.open_for(grant(slots[0], 2))
    assert again is first and not new, "the kept window is reopened"
    windows.close(again)
    # Another file with the same offset (its inode differs): a window of its own.
    other = grant(slots[0], 3)._replace(arena_ino=grant(slots[0], 3).arena_ino + 1)
    with pytest.raises(PinPoolError, match="no longer names"):
        windows.open_for(other)
    for n, slot in enumerate(slots[1:], start=4):
        window, _, _ = windows.open_for(grant(slot, n))
        assert window is not first
        windows.close(window)
    assert len(windows._WINDOWS) == WINDOWS_KEPT
    assert all(w is not first for _, w in windows._WINDOWS), "the oldest went first"
    windows._WINDOWS.clear()
    for slot in slots:
        slot.release()


def test_windows_kept_here_are_left_alone_by_forked_children(make_pool: Any) -> None:
    """A window kept in this process (writing a batch here keeps one) is not mapped in a child
    forked from it (``MADV_DONTFORK``), where its addresses may be reused: there it opens
    nothing, exports nothing and unmaps nothing; and forked workers run whole epochs."""
    from pinpool._wire.handle import SlotGrant
    from pinpool._worker import windows

    pool = make_pool(1 << 16, 8, arena_bytes=8 << 16)
    slot = pool.checkout(nbytes=1 << 16)
    fd, offset, part_len = pool.slot_memfd(slot)
    grant = SlotGrant(
        slot.index, 1, 1, offset, slot.nbytes, os.getpid(), fd, part_len, os.fstat(fd).st_ino
    )
    windows._WINDOWS.clear()
    window, _, _ = windows.open_for(grant)
    windows.close(window)
    try:
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            code = 0
            try:
                try:
                    window.open(offset, 1)
                    code = 2
                except PinPoolError as exc:
                    code = 0 if "forked from" in str(exc) else 3
                try:
                    memoryview(window)
                    code = code or 4
                except BufferError:
                    pass
            except BaseException:
                code = 6
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        loader = pinpool.DataLoader(
            Indexed(64), batch_size=4, num_workers=2, multiprocessing_context="fork"
        )
        for _epoch in range(2):
            assert sum(len(b["idx"]) for b in loader) == 64
        del loader
    finally:
        windows._WINDOWS.clear()
        del window
        slot.release()


def test_a_granted_slot_is_checked_before_it_is_mapped(make_pool: Any) -> None:
    """The worker's side of a grant maps only the slot's pages, and only from the file the
    grant names: another file behind the descriptor, an unsealed one, one of another length
    or a slot outside it is refused with the reason, and nothing stays open."""
    from pinpool._wire.handle import SlotGrant
    from pinpool._worker.windows import map_window

    pool = make_pool(1 << 20, 4, arena_bytes=8 << 20)
    pool.checkout(nbytes=1 << 20).release()  # (the slot below starts past the first page)
    first = pool.checkout(nbytes=4096)
    slot = pool.checkout(nbytes=3 * 4096)
    where = pool.slot_memfd(slot)
    assert where is not None
    fd, offset, part_len = where
    good = SlotGrant(1, 1, 7, offset, slot.nbytes, os.getpid(), fd, part_len, os.fstat(fd).st_ino)
    fds = open_fds()
    window = map_window(good)
    assert (window.offset, window.length) == (offset, slot.nbytes) and slot.nbytes < part_len
    window.open(offset, slot.nbytes)
    with memoryview(window) as mapped:
        mapped[:5] = b"hello"
    window.close()
    assert bytes(slot.view(np.uint8, (5,))) == b"hello"
    del window
    assert not open_fds() - fds, "a descriptor left open"

    unsealed = make_memfd(part_len, seal=False)
    with tempfile.TemporaryFile() as plain:
        plain.truncate(part_len)
        cases = {
            "another file": good._replace(arena_ino=good.arena_ino + 1),
            "unsealed": good._replace(arena_fd=unsealed, arena_ino=os.fstat(unsealed).st_ino),
            "plain file": good._replace(
                arena_fd=plain.fileno(), arena_ino=os.fstat(plain.fileno()).st_ino
            ),
            "length": good._replace(arena_len=part_len + 4096),
            "outside": good._replace(offset=part_len - 4096),
            "negative": good._replace(offset=-4096),
            "empty": good._replace(nbytes=0),
        }
        reasons = {
            "another file": "no longer names",
            "unsealed": "not sealed",
            "plain file": "not sealed",
            "length": "not",
            "outside": "outside",
            "negative": "outside",
            "empty": "outside",
        }
        for name, grant in cases.items():
            with pytest.raises(PinPoolError, match=reasons[name]):
                map_window(grant)
            assert len(open_fds() - fds) == 2, name  # (the two files above)
    os.close(unsealed)
    slot.release()
    first.release()
