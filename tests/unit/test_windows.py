"""A zero-copy worker's windows (``pinpool._worker.windows``): big ones opened ahead and closed
on the window thread, in the order asked, and no handle pickled before its window is closed.

The worker here is this process: a reservation names a slot of a pool made here, reached
through ``/proc/<own pid>/fd`` as a worker reaches the main process's arena."""

from __future__ import annotations

import os
import pickle
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pinpool._wire import codec
from pinpool._wire.handle import BatchHandle, SlotReservation
from pinpool._worker import windows

BIG = windows.OFF_PATH_BYTES
SMALL = 1 << 16


@pytest.fixture
def fresh_windows() -> Iterator[None]:
    windows._wait_idle()
    windows._AHEAD = None
    windows._WINDOWS.clear()
    yield
    windows._wait_idle()
    windows._AHEAD = None
    windows._WINDOWS.clear()


def reserve(pool: Any, slot: Any, nonce: int = 1) -> SlotReservation:
    fd, offset, part_len = pool.slot_memfd(slot)
    return SlotReservation(
        slot.index, 1, nonce, offset, slot.nbytes, os.getpid(), fd, part_len, os.fstat(fd).st_ino
    )


def write_through(window: Any, at: int, nbytes: int, value: int) -> None:
    view = memoryview(window)
    view[at] = value
    view[at + nbytes - 1] = value
    view.release()


def test_a_big_windows_handle_is_pickled_only_once_the_window_is_closed(
    make_pool: Callable[..., Any], fresh_windows: None
) -> None:
    pool = make_pool(BIG, 2, arena_bytes=2 * BIG)
    slot = pool.checkout(nbytes=BIG)
    r = reserve(pool, slot)
    windows.ahead(r)
    window, at, new = windows.open_for(r)
    assert new and window.open_range is not None
    assert window.open_range[0] <= r.offset and r.offset + r.nbytes <= window.open_range[1]
    write_through(window, at, r.nbytes, 7)
    wait = windows.close(window)
    assert wait is not None, "a big window is closed on the window thread"
    seen: list[Any] = []

    def before_sending() -> None:
        wait()
        seen.append(window.open_range)

    handle = BatchHandle("t", codec.plan({"x": 1}), 1, slot=r.claim)
    handle.sent_after(before_sending)
    pickle.dumps(handle)
    assert seen == [None], "pickled after the close, not before"
    pickle.dumps(handle)
    assert seen == [None], "waited for once"
    view = memoryview(slot)
    assert view[0] == 7 and view[r.nbytes - 1] == 7
    view.release()
    slot.release()


def test_a_small_window_is_closed_on_the_spot(
    make_pool: Callable[..., Any], fresh_windows: None
) -> None:
    pool = make_pool(SMALL, 2, arena_bytes=2 * SMALL)
    slot = pool.checkout(nbytes=SMALL)
    r = reserve(pool, slot)
    windows.ahead(r)  # (small: nothing opened ahead)
    assert windows._AHEAD is None
    window, _, _ = windows.open_for(r)
    assert window.open_range is not None
    assert windows.close(window) is None
    assert window.open_range is None
    slot.release()


def test_an_ahead_not_taken_is_closed_again(
    make_pool: Callable[..., Any], fresh_windows: None
) -> None:
    pool = make_pool(BIG, 3, arena_bytes=3 * BIG)
    slots = [pool.checkout(nbytes=BIG) for _ in range(3)]
    first, second, third = (reserve(pool, s, n) for n, s in enumerate(slots))
    windows.ahead(first)
    window, _, _ = windows.open_for(second)  # another batch's: the ahead is closed again
    windows._wait_idle()
    assert [w.open_range is None for w in windows.kept()].count(False) == 1
    assert windows.close(window) is not None
    windows.ahead(third)
    windows.drop_ahead(third)  # its batch went into a segment
    windows._wait_idle()
    assert all(w.open_range is None for w in windows.kept())
    assert len(windows.kept()) == 3
    for s in slots:
        s.release()


def test_the_window_thread_is_the_processs_own_after_a_fork(
    make_pool: Callable[..., Any], fresh_windows: None
) -> None:
    """A forked child does not wait on its parent's window thread (not running there) nor touch
    its parent's windows (not mapped there): it opens and closes its own."""
    pool = make_pool(BIG, 2, arena_bytes=2 * BIG)
    slots = [pool.checkout(nbytes=BIG) for _ in range(2)]
    window, _, _ = windows.open_for(reserve(pool, slots[0]))
    wait = windows.close(window)
    assert wait is not None
    wait()
    r = reserve(pool, slots[1], 2)  # (the parent's: a worker reaches the main process's arena)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            signal.alarm(20)  # a wait on a thread that is not there would hang
            assert not windows.kept(), "the parent's windows are not kept here"
            windows.ahead(r)
            mine, at, new = windows.open_for(r)
            write_through(mine, at, r.nbytes, 9)
            done = windows.close(mine)
            assert new and done is not None
            done()
            code = 0 if mine.open_range is None else 2
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    view = memoryview(slots[1])
    assert view[0] == 9
    view.release()
    for s in slots:
        s.release()


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, 3),  # which slot
            st.sampled_from(["ahead", "ahead other", "none"]),
            st.booleans(),  # wait for the close before the next step
        ),
        min_size=1,
        max_size=12,
    )
)
def test_big_and_small_windows_change_in_the_order_asked(
    make_pool: Callable[..., Any], fresh_windows: None, steps: list[tuple[int, str, bool]]
) -> None:
    """Batches into big and small slots, with and without an ahead (or an ahead for another
    slot, not taken), closes waited for or not: every open finds its range closed (no
    "open already"), every batch's bytes land in its slot, and at the end nothing is open."""
    pool = make_pool(SMALL, 8, arena_bytes=2 * BIG + 4 * SMALL)
    slots = [pool.checkout(nbytes=n) for n in (BIG, SMALL, BIG, SMALL)]
    windows._wait_idle()
    windows._AHEAD = None
    windows._WINDOWS.clear()
    pending = []
    for n, (i, how, wait_now) in enumerate(steps, start=1):
        r = reserve(pool, slots[i], n)
        if how == "ahead":
            windows.ahead(r)
        elif how == "ahead other":
            windows.ahead(reserve(pool, slots[(i + 1) % len(slots)], n))
        window, at, _ = windows.open_for(r)
        write_through(window, at, r.nbytes, n % 251)
        done = windows.close(window)
        if done is not None:
            if wait_now:
                done()
            else:
                pending.append(done)
        view = memoryview(slots[i])
        assert view[0] == n % 251 and view[r.nbytes - 1] == n % 251
        view.release()
    for done in pending:
        done()
    windows._wait_idle()
    assert all(w.open_range is None for w in windows.kept())
    windows._WINDOWS.clear()
    for s in slots:
        s.release()
