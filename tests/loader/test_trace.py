"""``pinpool.trace``: a loader reports its steps to the hook (in every mode, with and without
workers, in the workers too), nothing once the hook is removed, and a hook that raises is
removed without breaking the loading."""

from __future__ import annotations

import gc
import os
import threading
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import LoaderMode
from loader_datasets import Indexed

import pinpool
import pinpool.trace
from pinpool._main.epochs import ending_thread

N, BATCH = 32, 4


def _run(num_workers: int, **kwargs: Any) -> list[list[int]]:
    """One epoch of a small loader, then the loader dropped (its finalizer closes it)."""
    loader = pinpool.DataLoader(Indexed(N), batch_size=BATCH, num_workers=num_workers, **kwargs)
    got = [batch["idx"].tolist() for batch in loader]
    del loader
    gc.collect()
    return got


EXPECTED = [list(range(i, i + BATCH)) for i in range(0, N, BATCH)]


@pytest.mark.every_mode
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_reports_its_steps(loader_mode: LoaderMode, num_workers: int) -> None:
    # Loaders of earlier tests closed first: the hook is the process's, and theirs would count.
    gc.collect()
    ending_thread.wait_all(timeout=30)
    with pinpool.trace.recording() as events:
        assert _run(num_workers) == EXPECTED
    batches = len(EXPECTED)
    names = Counter(e.name for e in events)
    for e in events:
        assert e.name in pinpool.trace.EVENTS, e
        assert 0 < e.start_ns <= e.end_ns and isinstance(e.thread, str), e
        assert isinstance(e.details, dict), e
    assert names["loader.iter"] == 1 and names["loader.close"] == 1
    assert names["loader.next"] == batches and names["batch.finish"] == batches
    assert names["pool.make"] == 1 and names["pool.ensure"] >= 1
    (made,) = [e for e in events if e.name == "pool.make"]
    assert made.details["arena_bytes"] > 0 and made.details["largest"] > 0
    nexts = [e for e in events if e.name == "loader.next"]
    assert all(e.thread == threading.main_thread().name for e in nexts)
    if num_workers == 0:
        copies = [e for e in events if e.name == "batch.copy"]
        assert [e.details["how"] for e in copies] == ["local"] * batches
        assert names["slot.claim"] == batches
        assert not names["workers.start"] and not names["batch.take"]
        return
    assert names["workers.start"] == 1 and names["workers.shutdown"] >= 1
    # Every batch's indices went to a worker (and each worker its exit message).
    assert names["index.put"] >= batches
    # Every batch taken once, by the pin thread or the consumer, and delivered.
    assert names["batch.deliver"] == batches
    takes = [e for e in events if e.name == "batch.take"]
    if loader_mode.pin_thread or torch.cuda.is_available():
        assert any(e.details["ahead"] and e.thread != nexts[0].thread for e in takes)
    else:
        # Without a pin thread, every batch is taken in its turn, on the consumer's thread.
        assert takes and all(e.thread == nexts[0].thread for e in takes)
        assert not any(e.details["ahead"] for e in takes)
    # Each batch came through its worker's segment or its zero-copy slot.
    assert names["batch.receive"] + names["batch.adopt"] >= batches
    assert names["batch.copy"] + names["batch.adopt"] == batches
    if loader_mode.zero_copy:
        assert names["batch.adopt"] >= 1
    else:
        assert not names["batch.adopt"]
        assert names["slot.claim"] >= batches


def test_no_event_once_the_hook_is_removed() -> None:
    seen: list[pinpool.trace.Event] = []
    assert pinpool.trace.set_hook(seen.append) is None
    assert _run(2) == EXPECTED
    assert seen
    assert pinpool.trace.set_hook(None) == seen.append
    count = len(seen)
    with pinpool.trace.recording() as inner:
        pass
    assert _run(2) == EXPECTED and _run(0) == EXPECTED
    assert len(seen) == count and not inner
    # recording() puts back the hook it found.
    pinpool.trace.set_hook(seen.append)
    try:
        with pinpool.trace.recording():
            pass
        assert pinpool.trace.set_hook(None) == seen.append
    finally:
        pinpool.trace.set_hook(None)


_WORKER_LOG: list[str] = []


def _log_to_file(e: pinpool.trace.Event) -> None:
    """A hook for the workers too: each event as a line ``pid name``, appended to a file
    (one write, whole)."""
    fd = os.open(_WORKER_LOG[0], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{os.getpid()} {e.name}\n".encode())
    finally:
        os.close(fd)


@pytest.mark.parametrize("zero_copy", [False, True])
def test_forked_workers_report_their_steps(tmp_path: Path, zero_copy: bool) -> None:
    _WORKER_LOG[:] = [str(tmp_path / "events")]
    pinpool.trace.set_hook(_log_to_file)
    try:
        got = _run(2, zero_copy=zero_copy, multiprocessing_context="fork")
    finally:
        pinpool.trace.set_hook(None)
    assert got == EXPECTED
    lines = [line.split() for line in (tmp_path / "events").read_text().splitlines()]
    workers = Counter(name for pid, name in lines if int(pid) != os.getpid())
    assert workers["worker.destination"] == len(EXPECTED), workers
    assert workers["worker.stream"] + workers["worker.write"] >= len(EXPECTED), workers
    assert workers["worker.grant"] == (len(EXPECTED) if zero_copy else 0), workers
    assert all(n.startswith("worker.") for n in workers), workers
    assert not any(n.startswith("worker.") for pid, n in lines if int(pid) == os.getpid())


def _log_places(e: pinpool.trace.Event) -> None:
    """A hook for the workers: each ``worker.destination`` as ``pid slot mapped`` (one write)."""
    if e.name != "worker.destination":
        return
    fd = os.open(_WORKER_LOG[0], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        line = f"{os.getpid()} {int(e.details['slot'])} {int(e.details['mapped'])}\n"
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@pytest.mark.parametrize("persistent", [False, True])
def test_zero_copy_workers_write_into_windows_they_mapped_before(
    tmp_path: Path, persistent: bool
) -> None:
    """Each worker is handed, first, the slots it had before, and writes most zero-copy
    batches into a window it kept from an earlier batch: few windows are mapped per worker
    (about what it keeps), whatever the number of batches."""
    from pinpool._wire.handle import WINDOWS_KEPT

    _WORKER_LOG[:] = [str(tmp_path / "places")]
    pinpool.trace.set_hook(_log_places)
    try:
        loader = pinpool.DataLoader(
            Indexed(192, shape=(64, 64)),
            batch_size=4,
            num_workers=2,
            zero_copy=True,
            persistent_workers=persistent,
            multiprocessing_context="fork",
        )
        for _epoch in range(2):
            assert sum(len(b["idx"]) for b in loader) == 192
        stats = loader.stats()
        del loader
        gc.collect()
    finally:
        pinpool.trace.set_hook(None)
    rows = [
        tuple(map(int, line.split()))
        for line in (tmp_path / "places").read_text().split("\n")
        if line
    ]
    slots = [(pid, mapped) for pid, slot, mapped in rows if slot]
    assert len(slots) == stats["zero_copy_batches"] >= 48, stats
    mapped = Counter(pid for pid, m in slots if m)
    for pid in {pid for pid, _ in slots}:
        assert mapped[pid] <= 2 * WINDOWS_KEPT, (pid, mapped)
    assert sum(mapped.values()) <= len(slots) // 4, (mapped, len(slots))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_hook_that_raises_is_removed_and_loading_goes_on(num_workers: int) -> None:
    calls: list[str] = []

    def broken(e: pinpool.trace.Event) -> None:
        calls.append(e.name)
        raise ValueError("a bug in the probe")

    pinpool.trace.set_hook(broken)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _run(num_workers) == EXPECTED
            assert _run(num_workers) == EXPECTED
        assert pinpool.trace.set_hook(None) is None  # removed
    finally:
        pinpool.trace.set_hook(None)
    assert len(calls) == 1
    mine = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(mine) == 1 and "a bug in the probe" in str(mine[0].message)
    assert "removed" in str(mine[0].message)
