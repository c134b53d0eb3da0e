"""Zero-copy reservations (``_main.reservations``): a worker's big batches go only where its
kept windows are, and what each worker has kept is remembered per iterator, since a new
iterator's workers are new processes that have mapped nothing yet; a worker keeps fewer
windows of big slots than of small ones."""

from __future__ import annotations

import gc
import os
import pickle
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pinpool
from pinpool._main.sizing import Plan
from pinpool._wire import handle

MiB = 1 << 20
SLOT = 8 * MiB  # (reservations from 8 MiB on go only where the worker keeps a window)


def zero_copy_loader(slot_bytes: int, num_slots: int) -> tuple[Any, Any, Any]:
    """A zero-copy loader of two workers with its pool made (equal slots) and its arena's
    parts ready: (the loader, its pool, its reservations)."""
    loader = pinpool.DataLoader(
        torch.zeros(4, 2),
        batch_size=2,
        num_workers=2,
        zero_copy=True,
        slot_bytes=slot_bytes,
        num_slots=num_slots,
    )
    pool = loader.pool
    assert pool is not None
    deadline = time.monotonic() + 30
    while pool.stats()["slots_preparing"] and time.monotonic() < deadline:
        time.sleep(0.01)  # (the arena's parts are made ready in the background)
    return loader, pool, loader._pin_receiver.reservations


def test_a_workers_windows_are_remembered_per_iterator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handle, "WINDOW_BYTES_KEPT", 4 * SLOT)  # (four windows of a slot)
    assert handle.windows_kept(SLOT) == 4
    loader, pool, reservations = zero_copy_loader(SLOT, 6)
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
        # Worker 0 of another iterator (a new process) has no windows: anywhere, and told
        # where its predecessor's were, to map them ahead (they are its first choice).
        other = reservations.reserve(pool, 2, SLOT, 0, worker=0)
        assert other is not None and (other.arena_ino, other.offset) not in kept
        assert {(h.arena_ino, h.offset) for h in other.ahead} == kept
        assert all(h.nbytes == SLOT and h.arena_pid == os.getpid() for h in other.ahead)
        # Its predecessor's slots are offered first, but do not count as its windows until
        # it has had them: with those busy, a slot elsewhere, not copy mode.
        elsewhere = reservations.reserve(pool, 2, SLOT, 0, worker=0)
        assert elsewhere is not None and (elsewhere.arena_ino, elsewhere.offset) not in kept
        assert elsewhere.ahead == (), "hints with the first reservation only"
        reservations.take_back(elsewhere.claim)
        del elsewhere
        gc.collect()
        # Iterator 1 ended: what its workers kept is forgotten with its reservations.
        reservations.drop(1)
        again = reservations.reserve(pool, 1, SLOT, 0, worker=0)
        assert again is not None
        assert (again.arena_ino, again.offset) not in kept | {(other.arena_ino, other.offset)}
        assert again.ahead, "a new iterator's worker: hints, though all are busy"
        last = again
        for r in (other, again):
            reservations.take_back(r.claim)
        del taken, other, again
        gc.collect()
        # A new iterator's worker 0 gets its predecessor's latest slot, now free, and the
        # others it kept as hints.
        seeded = reservations.reserve(pool, 3, SLOT, 0, worker=0)
        assert seeded is not None and seeded.hint == last.hint
        assert len(seeded.ahead) == 3 and last.hint not in seeded.ahead
        later = reservations.reserve(pool, 3, SLOT, 0, worker=0)
        assert later is not None and later.ahead == (), "hints with the first reservation only"
        assert later.hint in seeded.ahead, "then the predecessor's other slots"
        for r in (seeded, later):
            reservations.take_back(r.claim)
        del seeded, later
    finally:
        del loader
        gc.collect()


def test_small_slots_are_neither_hinted_nor_remembered_for_a_later_worker() -> None:
    """Under 8 MiB a fresh worker is told of no next slots (a small window costs it little to
    fault in), and no slot is remembered for a later worker of its id."""
    loader, pool, reservations = zero_copy_loader(MiB, 8)
    try:
        made = [reservations.reserve(pool, owner, MiB, 0, worker=0) for owner in (1, 1, 2)]
        assert all(r is not None and r.ahead == () for r in made)
        assert reservations._last == {}, "remembered for a later worker"
        for r in made:
            assert r is not None
            reservations.take_back(r.claim)
        del made
    finally:
        del loader
        gc.collect()


def test_a_worker_keeps_fewer_windows_of_big_slots() -> None:
    assert handle.windows_kept(512 << 10) == handle.WINDOWS_KEPT
    assert handle.windows_kept(335 * MiB) == 4
    assert handle.windows_kept(handle.WINDOW_BYTES_KEPT * 2) == 1
    assert handle.windows_kept(0) == handle.WINDOWS_KEPT


def test_a_fresh_workers_first_slots_are_planned_apart_from_the_others() -> None:
    """With no worker of its id before it (a loader's first epoch), a worker is told of its
    share of the arena's slot-sized places with its first reservation: inside the arena's
    parts, whole pages, none shared with the next worker; then a spare, the next worker's last
    place (where a batch goes when all of its own are busy); none for small batches."""
    from pinpool._main.reservations import PLANNED_SLOTS, SPARE_SLOTS, planned

    loader, pool, reservations = zero_copy_loader(SLOT, 8)
    try:
        parts = pool.memfd_parts()
        assert parts and sum(length for _, _, length in parts) == pool.arena_bytes
        plans = [planned(pool, w, SLOT) for w in (0, 1)]
        for plan in plans:
            assert len(plan) == min(PLANNED_SLOTS + SPARE_SLOTS, handle.windows_kept(SLOT))
            assert len({at for at, _ in plan}) == len(plan), "a place told twice"
            for at, hint in plan:
                fd, start, length = next(p for p in parts if p[1] <= at < p[1] + p[2])
                assert (hint.arena_fd, hint.arena_len) == (fd, length)
                assert hint.offset == at - start and hint.offset + hint.nbytes <= length
                assert hint.nbytes == SLOT and hint.offset % 4096 == 0
        own = [{at for at, _ in plan[:PLANNED_SLOTS]} for plan in plans]
        assert not own[0] & own[1], "two workers' own shares overlap"
        assert plans[0][-1] == plans[1][PLANNED_SLOTS - 1], "the spare: the next one's last"
        assert plans[1][-1] == plans[0][PLANNED_SLOTS - 1], "(round the arena: the first's)"
        assert planned(pool, 0, 1 << 20) == [], "small batches: no plan"
        first = reservations.reserve(pool, 7, SLOT, 0, worker=1)
        assert first is not None
        told = [(h.arena_ino, h.offset) for h in first.ahead]
        assert [(first.arena_ino, first.offset), *told] == [
            (h.arena_ino, h.offset) for _, h in plans[1]
        ], "its share first of all, then the spare, in that order"
        reservations.take_back(first.claim)
        del first
    finally:
        del loader
        gc.collect()


def test_a_plan_over_few_places_names_each_place_once() -> None:
    """With fewer slot places than a plan's length, a worker is told of each place once."""
    from pinpool._main.reservations import planned

    loader, pool, _ = zero_copy_loader(SLOT, 3)
    try:
        for worker in range(4):
            plan = [at for at, _ in planned(pool, worker, SLOT)]
            assert len(plan) == len(set(plan)) == min(3, handle.windows_kept(SLOT))
    finally:
        del loader
        gc.collect()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from([4096, 65536, 1 << 20, 3 << 20, 9 << 20]), max_size=90),
    st.sampled_from([1 << 26, 1 << 28]),
)
def test_a_reservations_size_worked_out_once_is_what_working_it_out_anew_gives(
    sizes: list[int], arena: int
) -> None:
    """``LazyPool.reservation_size`` keeps its last answer while nothing it is worked out from
    changes (a workload of one batch size): after any run of batch sizes, the kept answer is
    the one worked out afresh."""
    from pinpool._main.lazy_pool import LazyPool
    from pinpool._main.pool_settings import PoolSettings

    pools = LazyPool(
        PoolSettings.checked(
            pool=None,
            arena_bytes=arena,
            max_batch_bytes=arena // 4,
            slot_bytes=None,
            num_slots=None,
            copy_threads=None,
            slot_timeout=None,
            overflow="copy",
            oversize="copy",
            device=None,
            in_flight=8,
        )
    )
    pools.plan = Plan(largest=arena // 4, arena=arena, entries=16)  # (as if the pool were made)
    for n in sizes:
        pools.seen(n)
        kept = pools.reservation_size(arena, arena // 2)
        pools._sized = None
        assert kept == pools.reservation_size(arena, arena // 2), sizes


_ints = st.integers(0, (1 << 63) - 1)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 1 << 40), max_size=20),
    st.none() | st.tuples(*[_ints] * 9),
    st.lists(st.tuples(*[_ints] * 6), max_size=4),
)
def test_tagged_indices_reach_the_worker_as_they_were_sent(
    indices: list[int], fields: tuple[int, ...] | None, hints: list[tuple[int, ...]]
) -> None:
    """A batch's indices and reservation (hints included), pickled as the index queue does
    (``ForkingPickler``), arrive equal and of the same types."""
    from multiprocessing.reduction import ForkingPickler

    reservation = None
    if fields is not None:
        ahead = tuple(handle.WindowHint(*h) for h in hints)
        reservation = handle.SlotReservation(*fields, ahead=ahead)
    sent = handle.TaggedIndices(indices, reservation)
    got = pickle.loads(ForkingPickler.dumps(sent))
    assert type(got) is handle.TaggedIndices and list(got) == indices
    assert got.reservation == reservation
    if reservation is not None:
        assert type(got.reservation) is handle.SlotReservation
        assert all(type(h) is handle.WindowHint for h in got.reservation.ahead)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=100), st.tuples(*[st.integers(0, (1 << 64) - 1)] * 10))
def test_a_ticket_names_a_reservation_only_when_issued(
    noise: bytes, words: tuple[int, ...]
) -> None:
    """A ticket's bytes decode to the reservation they name when their first word says it was
    issued, and to no reservation otherwise (zeros, a placeholder nobody wrote over, bytes
    of another length)."""
    import struct

    ticket = struct.pack("<10Q", *words)
    got = handle.ticket_reservation(ticket)
    if words[0] == 1:
        assert got == handle.SlotReservation(*words[1:])
        assert got is not None and got.claim == words[1:4]
    else:
        assert got is None
    if len(noise) != len(ticket):
        assert handle.ticket_reservation(noise) is None


def test_small_batches_get_their_slot_from_the_pipes_writer_thread() -> None:
    """A small batch's indices put on a worker's index queue reach the worker with a slot
    that the queue's writer thread checked out: the consumer's thread reserved nothing; the
    slot is adopted once, by its claim, and a slot taken back or dropped returns to the pool."""
    import multiprocessing as mp

    from pinpool._main.index_queue import write_directly
    from pinpool._main.reservations import ReservingSampler

    slot = 512 << 10
    loader, pool, reservations = zero_copy_loader(slot, 8)
    receiver = loader._pin_receiver
    queue = mp.get_context("fork").Queue()
    try:
        assert write_directly(queue)
        sampler = ReservingSampler(
            [[1, 2], [3, 4], [5, 6]], receiver.reserve_for, receiver.ticket_for
        )
        sampler.at_put = True
        queue.reserve = sampler.reserve_at_put
        queue.worker = 1
        free = pool.stats()["slots_free"]
        for n, task in enumerate(sampler):
            queue.put((n, task))
        got = [queue.get(timeout=10) for _ in range(3)]
        assert [list(t) for _, t in got] == [[1, 2], [3, 4], [5, 6]]
        tickets = [t.reservation for _, t in got]
        assert all(type(r) is handle.SlotReservation for r in tickets)
        assert reservations._reserved == {}  # (none reserved on this thread)
        assert len({(r.arena_ino, r.offset) for r in tickets}) == 3
        assert all(r.nbytes == slot for r in tickets)
        assert all(r.arena_pid == os.getpid() for r in tickets)
        assert pool.stats()["slots_free"] == free - 3
        first = reservations.adopt(tickets[0].claim)
        assert first.nbytes == slot
        with pytest.raises(pinpool.PinPoolError, match="not handed out"):
            reservations.adopt(tickets[0].claim)  # (once)
        with pytest.raises(pinpool.PinPoolError, match="not handed out"):
            reservations.adopt((*tickets[1].claim[:2], tickets[1].nonce ^ 1))
        reservations.take_back(tickets[1].claim)
        reservations.drop(sampler.owner)
        assert reservations.no_ticket == 0
        order = receiver.ticket_for(sampler.owner, 0)
        assert order is not None
        order[0].issue(sampler.owner, 0, pool.arena_bytes, 0)  # (never fits: counted)
        assert reservations.no_ticket == 1
        reservations.drop()
        assert reservations.no_ticket == 1, "the count outlives the tables"
        first.release()
        del first
        gc.collect()
        assert pool.stats()["slots_free"] == free
    finally:
        queue.close()
        loader._pin_receiver.close()
