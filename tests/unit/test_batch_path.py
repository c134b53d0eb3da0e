"""The per-batch trip between the threads of the main process: indices written to the workers'
pipes by a Rust thread (``pinpool._main.epochs.index_queue``), and, on torch's pin
thread, copies into slots left running on a copy thread while the pin thread goes on
(``Receiver.take`` and ``delivery.Pending``)."""

from __future__ import annotations

import fcntl
import gc
import multiprocessing
import queue
import sys
import threading
import time
from typing import Any

import pytest
import torch
from conftest import fake_pin_thread, open_fds
from loader_datasets import Indexed, Sized

import pinpool
from pinpool._main.epochs.index_queue import DirectQueue, write_directly
from pinpool._main.route import delivery
from pinpool._native import PipeWriter

# --------------------------------------------------------------------------- index queues


def test_a_direct_queue_keeps_order_and_never_starts_a_feeder() -> None:
    ctx = multiprocessing.get_context("fork")
    before = open_fds()
    q = ctx.Queue()
    assert write_directly(q)
    assert isinstance(q, DirectQueue)
    big = list(range(20_000))  # more than the pipe holds: the writer's thread waits, not put()
    sent: list[Any] = [(0, [1, 2]), (1, "x" * 100), (2, big), (3, [4]), (4, None)]
    t = time.perf_counter()
    for item in sent:
        q.put(item)
    assert time.perf_counter() - t < 0.5
    assert q._thread is None, "a message woke a feeder thread"
    assert [q.get(timeout=5) for _ in sent] == sent
    # The semaphore the reader releases stays balanced (an extra release would raise).
    for i in range(300):
        q.put(i)
        assert q.get(timeout=5) == i
    # (The writer counts a message once its write returned, which may be after the reader
    # has it.)
    deadline = time.monotonic() + 5
    while q._pinpool_writer.written < len(sent) + 300 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert q._pinpool_writer.written == len(sent) + 300
    q.close()
    q.join_thread()
    del q
    gc.collect()
    assert open_fds() <= before


def test_a_direct_queue_closes_every_descriptor_on_close() -> None:
    ctx = multiprocessing.get_context("fork")
    before = open_fds()
    q = ctx.Queue()
    assert write_directly(q)
    q.put("one")
    assert q.get(timeout=5) == "one"
    assert len(open_fds() - before) == 3  # the pipe's two ends and the writer's own
    q.close()
    assert open_fds() <= before, "a descriptor outlived close()"
    with pytest.raises(ValueError):
        q.put("after close")


class _ClosesItsQueue:
    """As a dropped iterator does: its finalizer closes (and first writes to) its queue."""

    def __init__(self, q: Any) -> None:
        self.q = q
        self.errors: list[BaseException] = []

    def __del__(self) -> None:
        try:
            self.q.put(None)
            self.q.close()
        except BaseException as exc:
            self.errors.append(exc)
            raise


def test_a_direct_queue_in_a_reference_cycle_closes_each_descriptor_once() -> None:
    """A queue and what closes it in a reference cycle: the collector finalizes every object
    of the cycle before it clears any, in no set order (the pipe's ``Connection`` objects
    among them, which close their descriptors but keep their numbers). Nothing raises (no
    EBADF: the same number closed twice, which could as well close another file), and every
    descriptor is closed once the cycle is gone; also when the queue is never closed."""
    ctx = multiprocessing.get_context("fork")
    lost: list[BaseException] = []
    before = open_fds()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "unraisablehook", lambda u: lost.append(u.exc_value))
        for closer in (True, False):
            for _ in range(20):
                q = ctx.Queue()
                assert write_directly(q)
                q.put("x")
                cycle: list[Any] = [q, _ClosesItsQueue(q) if closer else None]
                cycle.append(cycle)
                del q, cycle
                gc.collect()
    assert lost == []
    deadline = time.monotonic() + 10
    while not open_fds() <= before and time.monotonic() < deadline:
        time.sleep(0.01)  # (each writer's thread closes its own descriptor as it ends)
    assert open_fds() <= before


def test_close_gives_up_a_full_pipe_nobody_reads() -> None:
    """A worker that died with indices still queued: close() neither hangs nor leaks."""
    before = open_fds()
    q = multiprocessing.get_context("fork").Queue()
    fcntl.fcntl(q._writer.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)
    assert write_directly(q)
    for i in range(20):
        q.put(list(range(i, i + 400)))  # about 1.2 KB each: more than a page
    t = time.perf_counter()
    q.close()
    assert time.perf_counter() - t < 2.0
    assert q._pinpool_writer.written < 20
    assert open_fds() <= before


def test_only_an_unused_multiprocessing_queue_is_turned() -> None:
    assert not write_directly(queue.Queue())
    q = multiprocessing.get_context("fork").Queue()
    q.put(1)  # its feeder thread has started: its messages must keep going through it
    assert not write_directly(q)
    assert q.get(timeout=5) == 1
    q.close()
    q.join_thread()


def test_the_pipe_writer_refuses_what_is_not_a_pipe() -> None:
    with open("/proc/self/stat", "rb") as f, pytest.raises(pinpool.InvalidArgument):
        PipeWriter(f.fileno())


def test_a_worker_reads_what_the_sending_thread_wrote() -> None:
    """Across processes, through the same pipe and framing a worker's ``get()`` reads."""
    ctx = multiprocessing.get_context("fork")
    jobs, results = ctx.Queue(), ctx.Queue()
    assert write_directly(jobs)
    p = ctx.Process(target=_echo, args=(jobs, results))
    p.start()
    sent = [(i, list(range(i))) for i in range(50)] + [(50, list(range(30_000)))]
    for item in sent:
        jobs.put(item)
    jobs.put(None)
    got = [results.get(timeout=30) for _ in sent]
    p.join(30)
    assert p.exitcode == 0
    assert got == [len(x[1]) for x in sent]
    jobs.close()
    jobs.join_thread()


def _echo(jobs: Any, results: Any) -> None:
    while (item := jobs.get(timeout=30)) is not None:
        results.put(len(item[1]))


def test_a_loader_starts_no_feeder_thread_for_indices() -> None:
    """Two epochs with small index lists, then one with index lists too big for the pipe:
    the batches are torch's in every case; the small ones woke no feeder thread."""
    # (Feeder threads of queues an earlier test left behind are not this loader's.)
    before = {t for t in threading.enumerate() if t.name == "QueueFeederThread"}
    ds = Indexed(120, shape=(4,))
    loader = pinpool.DataLoader(ds, batch_size=8, num_workers=2)
    for _ in range(2):
        seen: list[int] = []
        for batch in loader:
            seen += batch["idx"].tolist()
            feeders = [
                t
                for t in threading.enumerate()
                if t.name == "QueueFeederThread" and t not in before
            ]
            assert not feeders, "indices went through a feeder thread"
        assert seen == list(range(120))
    del loader
    big = pinpool.DataLoader(Indexed(6000, shape=(1,)), batch_size=3000, num_workers=2)
    assert [b["idx"].tolist() for b in big] == [list(range(3000)), list(range(3000, 6000))]


def test_next_opens_a_profiler_range_only_while_a_profiler_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a profiler, batches come without torch's per-batch ``record_function`` (and
    torch's count of batches yielded still holds); with one, each batch is in its range."""
    opened: list[str] = []
    enter = torch.autograd.profiler.record_function.__enter__

    def counted(self: Any) -> Any:
        opened.append(self.name)
        return enter(self)

    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__", counted)
    loader = pinpool.DataLoader(Indexed(64, shape=(4,)), batch_size=8, num_workers=2)
    it = iter(loader)
    assert [b["idx"].tolist() for b in it] == [list(range(i, i + 8)) for i in range(0, 64, 8)]
    assert it._inner._num_yielded == 8
    assert not [n for n in opened if "DataLoader" in n]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert len(list(loader)) == 8
    # (one more: the call that ends the epoch)
    assert len([n for n in opened if "DataLoader" in n]) == 9


# --------------------------------------------------------------------------- background copies


@pytest.fixture
def pin_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's DataLoader starts its pin thread (as on a GPU machine; see conftest.py)."""
    fake_pin_thread(monkeypatch)


@pytest.mark.usefixtures("pin_thread")
def test_the_pin_thread_leaves_copies_to_the_copy_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch the pin thread took was copied on a copy thread and waited for by the
    consumer; the batches are exact; an epoch left early and the loader's end leave no slot
    out and no segment held."""
    waits: list[bool] = []
    wait = delivery.Pending.wait

    def counted(self: delivery.Pending) -> Any:
        if self.copying is not None:  # (a batch whose copy the pin thread left running)
            waits.append(self.copying.done)
        return wait(self)

    monkeypatch.setattr(delivery.Pending, "wait", counted)
    sizes = [300_000 + 4096 * (i // 4 % 7) for i in range(96)]
    loader = pinpool.DataLoader(Sized(sizes), batch_size=4, num_workers=2)
    for i, batch in enumerate(loader):
        assert batch.shape == (4, sizes[4 * i])
        want = torch.arange(4 * i, 4 * i + 4, dtype=torch.uint8).view(4, 1) % 251
        assert torch.equal(batch, want.expand_as(batch))
    assert len(waits) == 24, "a batch the pin thread took was copied on it"
    it = iter(loader)
    next(it)  # and leave: batches taken ahead may still be copying
    del it
    pool = loader.pool
    assert pool is not None
    del batch, loader
    gc.collect()
    deadline = time.monotonic() + 15  # (the last copies may still be finishing)
    while pool.stats()["slots_free"] < pool.num_slots and time.monotonic() < deadline:
        time.sleep(0.01)
    s = pool.stats()
    assert s["slots_free"] == pool.num_slots and s["slots_checked_out"] == 0, s
