"""Zero-copy reservations (``_main.reservations``): a worker's big batches go only where its
kept windows are, and what each worker has kept is remembered per iterator, since a new
iterator's workers are new processes that have mapped nothing yet; a worker keeps fewer
windows of big slots than of small ones."""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch

import pinpool
from pinpool._wire import handle

MiB = 1 << 20
SLOT = 8 * MiB  # (reservations from 8 MiB on go only where the worker keeps a window)


def test_a_workers_windows_are_remembered_per_iterator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handle, "WINDOW_BYTES_KEPT", 4 * SLOT)  # (four windows of a slot)
    assert handle.windows_kept(SLOT) == 4
    loader = pinpool.DataLoader(
        torch.zeros(4, 2), batch_size=2, num_workers=2, zero_copy=True, slot_bytes=SLOT, num_slots=6
    )
    pool, reservations = loader.pool, loader._pin_receiver.reservations
    assert pool is not None
    deadline = time.monotonic() + 30
    while pool.stats()["slots_preparing"] and time.monotonic() < deadline:
        time.sleep(0.01)  # (the arena's parts are made ready in the background)
    try:
        held = [reservations.reserve(pool, 1, SLOT, 0, worker=0) for _ in range(4)]
        assert all(r is not None for r in held)
        kept = {(r.arena_ino, r.offset) for r in held if r is not None}
        for r in held:
            assert r is not None
            reservations.take_back(r.claim)
        del held, r
        gc.collect()
        # Every slot where worker 0 of iterator 1 keeps a window is taken.
        taken = [pool.checkout(nbytes=SLOT) for _ in range(4)]

        def place(slot: pinpool.Slot) -> tuple[int, int]:  # (the part's file, where in it)
            where = pool.slot_memfd(slot)
            assert where is not None
            return os.fstat(where[0]).st_ino, where[1]

        assert {place(s) for s in taken} == kept
        # That worker's big batch goes nowhere else: through copy mode.
        before = reservations.fallbacks
        assert reservations.reserve(pool, 1, SLOT, 0, worker=0) is None
        assert reservations.fallbacks == before + 1
        # Worker 0 of another iterator (a new process) has no windows: anywhere.
        other = reservations.reserve(pool, 2, SLOT, 0, worker=0)
        assert other is not None and (other.arena_ino, other.offset) not in kept
        # Iterator 1 ended: what its workers kept is forgotten with its reservations.
        reservations.drop(1)
        again = reservations.reserve(pool, 1, SLOT, 0, worker=0)
        assert again is not None
        assert (again.arena_ino, again.offset) not in kept | {(other.arena_ino, other.offset)}
        for r in (other, again):
            reservations.take_back(r.claim)
        del taken, other, again
    finally:
        del loader
        gc.collect()


def test_a_worker_keeps_fewer_windows_of_big_slots() -> None:
    assert handle.windows_kept(512 << 10) == handle.WINDOWS_KEPT
    assert handle.windows_kept(335 * MiB) == 4
    assert handle.windows_kept(handle.WINDOW_BYTES_KEPT * 2) == 1
    assert handle.windows_kept(0) == handle.WINDOWS_KEPT
