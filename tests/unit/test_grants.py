"""Zero-copy grants (``_main.route.grants``, ``pinpool._native.Grants``, ``_worker.desk``): a worker
asks for a slot of its batch's size once it knows it, at the main process's grant desk, and
the batch the consumer waits for is never refused room held for batches behind it.

The worker here is this process: it asks the desk through the same socket a worker uses."""

from __future__ import annotations

import gc
import pickle
import struct
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pinpool
from pinpool._main.route.grants import LoaderGrants, TaskTagger
from pinpool._native import room_kept
from pinpool._wire import handle
from pinpool._worker import desk

PAGE = 4096
_ints = st.integers(0, (1 << 64) - 1)


@pytest.fixture(autouse=True)
def _disconnected() -> Any:
    """This process asks the desk as a worker would: its connections close after each test."""
    yield
    desk.disconnect()


@given(st.lists(st.integers(0, 1 << 40), max_size=20), st.none() | st.tuples(_ints, _ints))
def test_tagged_indices_reach_the_worker_as_they_were_sent(
    indices: list[int], task: tuple[int, int] | None
) -> None:
    """A batch's indices and task, pickled as the index queue does (``ForkingPickler``),
    arrive equal and of the same types."""
    sent = handle.TaggedIndices(indices, None if task is None else handle.ZeroCopyTask(*task))
    got = pickle.loads(ForkingPickler.dumps(sent))
    assert type(got) is handle.TaggedIndices and list(got) == indices
    assert got.task == sent.task
    assert task is None or type(got.task) is handle.ZeroCopyTask


@settings(max_examples=300, deadline=None)
@given(st.lists(_ints, max_size=60), st.integers(0, 8))
def test_an_answer_names_a_grant_only_when_whole(words: list[int], hints: int) -> None:
    """The desk's answer decodes to the grant it names, hints and all, when its first word
    says granted and its length matches its count of hints; to none otherwise."""
    whole = [1, *range(2, 11), hints, *range(100, 100 + 5 * hints)]
    got = handle.grant_from_words(tuple(whole))
    assert got is not None and got.key == (2, 3, 4) and got.nbytes == 6 and got.arena_pid == 7
    assert len(got.likely) == hints
    assert all(h.arena_pid == 7 and type(h) is handle.LikelySlot for h in got.likely)
    parsed = handle.grant_from_words(tuple(words))
    whole_again = len(words) >= 11 and len(words) == 11 + 5 * words[10]
    assert (parsed is not None) == (bool(words) and words[0] == 1 and whole_again)


@pytest.fixture
def granted(make_pool: Any) -> Any:
    """A pool of 16 pages in one part (64 entries) and a loader's grants over it, iterator 1
    open: (pool, grants)."""
    pool = make_pool(16 * PAGE, 64, arena_bytes=16 * PAGE)
    grants = LoaderGrants()
    grants.use_pool(pool, 1 << 40)
    grants.open(1)
    yield pool, grants
    grants.close()


def test_a_worker_gets_a_slot_of_its_batchs_size_and_the_batch_adopts_it_once(
    granted: Any,
) -> None:
    pool, grants = granted
    at = grants.desk
    assert at is not None
    grant = desk.ask(at, handle.ZeroCopyTask(1, 0), 0, 3 * PAGE + 5)
    assert grant is not None and grant.nbytes == 4 * PAGE
    assert pool.stats()["bytes_checked_out"] == 4 * PAGE
    slot = grants.adopt(grant.key)
    assert slot.nbytes == 4 * PAGE
    with pytest.raises(pinpool.PinPoolError, match="not granted"):
        grants.adopt(grant.key)  # (once)
    slot.release()
    # Given back by the worker (its batch failed): the slot comes back, and no claim holds.
    other = desk.ask(at, handle.ZeroCopyTask(1, 1), 0, PAGE)
    assert other is not None
    desk.give_back(at, other)
    deadline = 100
    while pool.stats()["bytes_checked_out"] and deadline:
        deadline -= 1
        gc.collect()
    with pytest.raises(pinpool.PinPoolError, match="not granted"):
        grants.adopt(other.key)
    assert pool.stats()["bytes_checked_out"] == 0
    # An iterator not open, or a closed one, is granted nothing, and that is counted.
    assert desk.ask(at, handle.ZeroCopyTask(2, 0), 0, PAGE) is None
    grants.close(1)
    assert desk.ask(at, handle.ZeroCopyTask(1, 2), 0, PAGE) is None
    assert grants.no_grant == 2


def test_a_closed_desk_grants_nothing_and_the_worker_goes_on(make_pool: Any) -> None:
    pool = make_pool(16 * PAGE, 8)
    grants = LoaderGrants()
    grants.use_pool(pool, 1 << 40)
    grants.open(1)
    at = grants.desk
    assert at is not None
    grants.close()
    assert grants.desk is None
    assert desk.ask(at, handle.ZeroCopyTask(1, 0), 0, PAGE) is None
    assert desk.ask((b"pinpool-no-such-desk", 1), handle.ZeroCopyTask(1, 0), 0, PAGE) is None


def test_a_task_tagger_numbers_the_tasks_of_each_epoch_and_opens_its_iterator(
    make_pool: Any,
) -> None:
    grants = LoaderGrants()
    tagger = TaskTagger([[1, 2], [3], [4, 5]], grants)
    for _ in range(2):  # (a persistent iterator: iter() again each epoch)
        tasks = list(tagger)
        assert [list(t) for t in tasks] == [[1, 2], [3], [4, 5]]
        assert [t.task for t in tasks] == [handle.ZeroCopyTask(tagger.owner, n) for n in range(3)]
    assert len(tagger) == 3
    pool = make_pool(4 * PAGE, 4)
    grants.use_pool(pool, 1 << 40)
    assert desk.ask(grants.desk, handle.ZeroCopyTask(tagger.owner, 0), 0, PAGE) is not None
    grants.close()


class NoBatchWaitsOnTheOnesBehindIt(RuleBasedStateMachine):
    """Workers ask for batches of random sizes, for random tasks ahead of the consumer; the
    consumer adopts and releases batches in order. Whatever was granted ahead, the batch the
    consumer waits for (the head) gets room as large as the room kept whenever the consumer
    holds nothing: grants for later batches never take it."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: Any = None
        self.grants: Any = None

    @initialize(pages=st.integers(8, 64))
    def make(self, pages: int) -> None:
        self.pool = pinpool.PinPool(pages * PAGE, 128, device="cpu", arena_bytes=pages * PAGE)
        self.grants = LoaderGrants()
        self.grants.use_pool(self.pool, 1 << 40)
        self.grants.open(1)
        self.head = 0
        self.largest = 0
        self.out: dict[int, Any] = {}  # task -> grant, not adopted
        self.kept: dict[int, int] = {}  # task -> the room kept when it was granted ahead
        self.held: list[Any] = []  # slots the consumer holds

    def teardown(self) -> None:
        if self.grants is not None:
            self.held.clear()
            self.grants.close()
            self.pool.close()

    def _ask(self, task: int, nbytes: int) -> Any:
        grant = self.grants.issue(handle.ZeroCopyTask(1, task), task % 8, nbytes)
        size = -(-nbytes // PAGE) * PAGE
        if size <= self.pool.largest_slot:  # (a request no slot could hold sizes nothing)
            self.largest = max(self.largest, size)
        if grant is not None:
            assert task not in self.out
            self.out[task] = grant
        return grant

    @rule(ahead=st.integers(1, 12), pages=st.integers(1, 12))
    def a_worker_ahead_asks(self, ahead: int, pages: int) -> None:
        task = self.head + ahead
        if task in self.out:
            return
        grant = self._ask(task, pages * PAGE)
        if grant is not None:
            # A grant ahead of the consumer leaves the room kept in one range.
            s = self.pool.stats()
            keep = room_kept(self.largest, s["arena_bytes"], self.pool.largest_slot)
            assert s["largest_free"] >= keep, (s, keep)
            self.kept[task] = keep

    @precondition(lambda self: self.head not in self.out)
    @rule(pages=st.integers(1, 12))
    def the_heads_worker_asks(self, pages: int) -> None:
        nbytes = pages * PAGE
        s = self.pool.stats()
        keep = room_kept(self.largest, s["arena_bytes"], self.pool.largest_slot)
        consumer_holds = bool(self.held)
        # What the grants ahead of it left: the room kept as each was made (a batch asked for
        # since, larger than any before, raises the room kept for grants made after it only).
        keep = min([keep, *(k for t, k in self.kept.items() if t in self.out)])
        grant = self._ask(self.head, nbytes)
        if not consumer_holds and nbytes <= keep:
            assert grant is not None, ("the head was refused room", s, keep, nbytes)

    @precondition(lambda self: self.head in self.out)
    @rule(keep=st.booleans())
    def the_consumer_takes_the_head(self, keep: bool) -> None:
        grant = self.out.pop(self.head)
        slot = self.grants.adopt(grant.key)
        self.head += 1
        self.grants.set_head(1, self.head)
        if keep:
            self.held.append(slot)
        else:
            slot.release()

    @precondition(lambda self: bool(self.held))
    @rule()
    def the_consumer_lets_go(self) -> None:
        self.held.pop(0).release()

    @invariant()
    def every_byte_is_accounted_for(self) -> None:
        if self.pool is None:
            return
        s = self.pool.stats()
        held = sum(g.nbytes for g in self.out.values()) + sum(x.nbytes for x in self.held)
        assert s["bytes_checked_out"] == held
        assert s["bytes_free"] + held == s["arena_bytes"]


NoBatchWaitsOnTheOnesBehindIt.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
test_no_batch_waits_on_the_ones_behind_it = NoBatchWaitsOnTheOnesBehindIt.TestCase


def test_a_request_whose_room_is_held_by_batches_before_it_waits_for_them(
    granted: Any,
) -> None:
    """A later batch's request that finds the arena held by batches the consumer reaches first
    is answered once one of those is released, not refused at once; one whose room is held by
    batches the consumer was handed is refused at once (it may keep them)."""
    import threading

    _pool, grants = granted
    at = grants.desk
    # Batches of 4, 2 and 3 pages (9 of 16 held); the room kept for the head: 6 pages.
    sizes = (4, 2, 3)
    first = [desk.ask(at, handle.ZeroCopyTask(1, t), 0, n * PAGE) for t, n in enumerate(sizes)]
    assert all(g is not None for g in first)
    got: list[Any] = []
    waiter = threading.Thread(  # (2 pages would leave 5: less than the room kept)
        target=lambda: got.append(desk.ask(at, handle.ZeroCopyTask(1, 3), 1, 2 * PAGE))
    )
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "refused at once, though the batches before it will be released"
    slot = grants.adopt(first[0].key)
    grants.set_head(1, 1)
    slot.release()
    waiter.join(5)
    assert not waiter.is_alive() and got[0] is not None
    # The consumer keeps tasks 1 and 2, task 3 holds 2 pages: 9 pages free in two ranges, and
    # what may come back before task 5 (task 3's) leaves no room for 6 pages and the 6 kept.
    kept = [grants.adopt(first[i].key) for i in (1, 2)]
    grants.set_head(1, 3)
    assert desk.ask(at, handle.ZeroCopyTask(1, 5), 0, 6 * PAGE) is None
    del kept


def test_the_desk_answers_struct() -> None:
    """The request layout the worker sends is the desk's: seven little-endian words."""
    assert desk._REQUEST.size == 7 * 8
    assert struct.calcsize("<7Q") == desk._REQUEST.size
