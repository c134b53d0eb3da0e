"""The per-batch trip between the threads of the main process: indices written to the workers'
pipes by the thread that sends them (``pinpool._main.index_queue``), and, on torch's pin
thread, copies into slots left running on a copy thread while the pin thread goes on
(``Receiver.take`` and ``delivery.Landing``)."""

from __future__ import annotations

import fcntl
import gc
import multiprocessing
import os
import queue
import threading
import time
from typing import Any

import pytest
import torch
from loader_datasets import Indexed, Sized

import pinpool
from pinpool._main import delivery
from pinpool._main.index_queue import DirectQueue, pipe_size, write_directly


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# --------------------------------------------------------------------------- index queues


def test_a_direct_queue_keeps_order_whichever_way_a_message_goes() -> None:
    ctx = multiprocessing.get_context("fork")
    gc.collect()  # (what earlier tests left for the collector closes its fds now, not below)
    before = fd_count()
    q = ctx.Queue()
    assert write_directly(q, 4)
    assert isinstance(q, DirectQueue)
    big = list(range(20_000))  # more than the pipe may hold for 4 messages
    sent: list[Any] = [(0, [1, 2]), (1, "x" * 100), (2, big), (3, [4]), (4, None)]
    for item in sent[:2]:
        q.put(item)
    assert q._thread is None, "small messages woke a feeder thread"
    for item in sent[2:]:
        q.put(item)
    assert q._thread is not None, "the big message was written by the putting thread"
    assert [q.get(timeout=5) for _ in sent] == sent
    # The semaphore the reader releases stays balanced (an extra release would raise).
    for i in range(300):
        q.put(i)
        assert q.get(timeout=5) == i
    q.close()
    q.join_thread()
    del q
    gc.collect()
    assert fd_count() == before


def test_a_direct_queue_without_a_feeder_closes_its_pipe_on_close() -> None:
    ctx = multiprocessing.get_context("fork")
    gc.collect()
    before = fd_count()
    q = ctx.Queue()
    assert write_directly(q, 8)
    q.put("one")
    assert q.get(timeout=5) == "one"
    assert fd_count() == before + 2
    q.close()
    assert fd_count() == before, "the pipe outlived close()"
    with pytest.raises(ValueError):
        q.put("after close")


def test_what_is_written_directly_fits_the_pipe_the_kernel_gave() -> None:
    """A user over the system's pipe quota gets pipes of one page: a message that would not
    fit there with the others goes through the feeder thread, never blocking the sender."""
    q = multiprocessing.get_context("fork").Queue()
    fcntl.fcntl(q._writer.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)
    assert pipe_size(q._writer.fileno()) == 4096
    assert write_directly(q, 4)
    assert q._pin_room == 512
    q.put(list(range(50)))  # about 160 bytes
    assert q._thread is None
    q.put(list(range(400)))  # about 1.2 KB
    assert q._thread is not None
    assert q.get(timeout=5) == list(range(50))
    assert q.get(timeout=5) == list(range(400))
    q.close()
    q.join_thread()


def test_only_an_unused_multiprocessing_queue_is_turned() -> None:
    assert not write_directly(queue.Queue(), 4)
    q = multiprocessing.get_context("fork").Queue()
    q.put(1)  # its feeder thread has started: its messages must keep going through it
    assert not write_directly(q, 4)
    assert q.get(timeout=5) == 1
    q.close()
    q.join_thread()


def test_a_worker_reads_what_the_sending_thread_wrote() -> None:
    """Across processes, through the same pipe and framing a worker's ``get()`` reads."""
    ctx = multiprocessing.get_context("fork")
    jobs, results = ctx.Queue(), ctx.Queue()
    assert write_directly(jobs, 16)
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
    ds = Indexed(120, shape=(4,))
    loader = pinpool.DataLoader(ds, batch_size=8, num_workers=2)
    for _ in range(2):
        seen: list[int] = []
        for batch in loader:
            seen += batch["idx"].tolist()
            feeders = [t for t in threading.enumerate() if t.name == "QueueFeederThread"]
            assert not feeders, "indices went through a feeder thread"
        assert seen == list(range(120))
    del loader
    big = pinpool.DataLoader(Indexed(6000, shape=(1,)), batch_size=3000, num_workers=2)
    assert [b["idx"].tolist() for b in big] == [list(range(3000)), list(range(3000, 6000))]


# --------------------------------------------------------------------------- background copies


@pytest.fixture
def pin_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's DataLoader starts its pin thread (as on a GPU machine; see conftest.py)."""
    if torch.accelerator.is_available():
        return
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)


@pytest.mark.usefixtures("pin_thread")
def test_the_pin_thread_leaves_copies_to_the_copy_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch the pin thread took was copied on a copy thread and waited for by the
    consumer; the batches are exact; an epoch left early and the loader's end leave no slot
    out and no segment held."""
    waits: list[bool] = []
    wait = delivery.Landing.wait

    def counted(self: delivery.Landing) -> Any:
        waits.append(self.copying.done)
        return wait(self)

    monkeypatch.setattr(delivery.Landing, "wait", counted)
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
