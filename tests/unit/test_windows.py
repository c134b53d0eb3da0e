"""A zero-copy worker's windows (``pinpool._worker.windows``): open only between ``open_for``
and ``close``, kept for the worker's next slots, given up when they cannot be closed, and none
inherited by a forked child.

The worker here is this process: a grant names a slot of a pool made here, reached
through ``/proc/<own pid>/fd`` as a worker reaches the main process's arena."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_datasets import _reachable, arena_reach

from pinpool._wire.handle import WINDOW_BYTES_KEPT, WINDOWS_KEPT, LikelySlot, SlotGrant
from pinpool._worker import windows

BIG = 8 << 20
SMALL = 1 << 16


@pytest.fixture
def fresh_windows() -> Iterator[None]:
    windows._start_afresh()
    yield
    faulted_ahead()
    windows._start_afresh()


def grant_of(pool: Any, slot: Any, nonce: int = 1) -> SlotGrant:
    fd, offset, part_len = pool.slot_memfd(slot)
    return SlotGrant(
        slot.index, 1, nonce, offset, slot.nbytes, os.getpid(), fd, part_len, os.fstat(fd).st_ino
    )


def faulted_ahead(timeout: float = 60.0) -> None:
    """Waits for the pre-map thread, if one runs, to finish."""
    for thread in threading.enumerate():
        if thread.name == "pinpool-premap":
            thread.join(timeout)
            assert not thread.is_alive()


def test_hinted_slots_are_mapped_ahead_out_of_reach_and_then_opened_without_mapping(
    make_pool: Callable[..., Any], fresh_windows: None
) -> None:
    """Where windows have keys, a first grant's likely slots are mapped as kept windows, faulted
    in on a thread of their own while no other thread can reach them, and opened for no one
    until a grant there is; a likely slot naming another file is skipped; a later
    grant's likely slots map nothing (once per process); no descriptor of the arena stays open.
    Without keys nothing is pre-mapped."""
    pool = make_pool(BIG, 5, arena_bytes=5 * BIG)
    slots = [pool.checkout(nbytes=BIG) for _ in range(5)]
    r = [grant_of(pool, s) for s in slots]
    fds = arena_reach()[1]  # (this process's pool holds its parts' own)
    stale = LikelySlot(*r[3].as_likely[:5], r[3].arena_ino + 1)  # (another file's inode)
    first, _, new = windows.open_for(r[0]._replace(likely=(r[1].as_likely, r[2].as_likely, stale)))
    assert new
    ahead = [w for w in windows.kept() if w is not first]
    if not first.has_key:
        assert os.environ.get("PINPOOL_REQUIRE_PKEYS") != "1", "no protection key for the window"
        assert ahead == [], "pre-mapped where every thread could write it as it is faulted in"
    else:
        assert [w.offset for w in ahead] == [r[1].offset, r[2].offset], (
            "the likely slots', in order"
        )
        for w in ahead:  # (probed while the pre-map thread may be faulting it in)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(memoryview(w)))
            assert not _reachable(addr) and not _reachable(addr + BIG - 1)
    write_through(first, 0, r[0].nbytes, 5)
    windows.close(first)
    assert arena_reach()[1] == fds, "an arena descriptor kept"
    faulted_ahead()
    assert all(w.faulted and w.open_range is None and w.armed_range is None for w in ahead)
    window, at, new = windows.open_for(r[1]._replace(likely=(r[4].as_likely,)))
    assert new == (not ahead) and (not ahead or window is ahead[0])
    write_through(window, at, r[1].nbytes, 9)
    windows.close(window)
    view = memoryview(slots[1])
    assert view[0] == 9 and view[r[1].nbytes - 1] == 9
    view.release()
    faulted_ahead()
    assert _kept_at(r[4]) is None, "a later grant's likely slots map nothing"
    window, _, new = windows.open_for(r[3])
    assert new, "the stale likely slot mapped nothing"
    windows.close(window)
    for s in slots:
        s.release()


def _kept_at(r: SlotGrant) -> Any:
    """The kept window holding ``r``'s slot (in its file), if one does."""
    return windows._kept((r.arena_pid, r.arena_ino), r.offset, r.nbytes, use=False)


def write_through(window: Any, at: int, nbytes: int, value: int) -> None:
    """Writes the first and last byte as a worker does: with this thread's access switched on
    (a range opened under its key, as it is where torch runs on one thread, is out of reach
    otherwise; elsewhere ``allow`` does nothing)."""
    window.allow()
    try:
        view = memoryview(window)
        view[at] = value
        view[at + nbytes - 1] = value
        view.release()
    finally:
        window.deny()


@pytest.mark.parametrize("nbytes", [SMALL, BIG])
def test_a_window_is_open_only_between_open_for_and_close(
    make_pool: Callable[..., Any], fresh_windows: None, nbytes: int
) -> None:
    pool = make_pool(nbytes, 2, arena_bytes=2 * nbytes)
    slot = pool.checkout(nbytes=nbytes)
    r = grant_of(pool, slot)
    window, at, new = windows.open_for(r)
    assert new and window.open_range is not None
    assert window.open_range[0] <= r.offset and r.offset + r.nbytes <= window.open_range[1]
    write_through(window, at, r.nbytes, 7)
    windows.close(window)
    assert window.open_range is None
    again, _, new = windows.open_for(grant_of(pool, slot, 2))
    assert again is window and not new, "kept for the next batch there"
    windows.close(again)
    view = memoryview(slot)
    assert view[0] == 7 and view[r.nbytes - 1] == 7
    view.release()
    slot.release()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_slot_is_opened_keyed_where_one_thread_writes_it(
    make_pool: Callable[..., Any], fresh_windows: None, threads: int
) -> None:
    """Where the machine has memory protection keys: with torch on one thread (as in its
    workers) the slot is opened under the window's key, reached only between ``allow`` and
    ``deny`` (or the close) on this thread, and left armed between batches, so that opening it
    again changes nothing but this thread's access; with torch on more, opened plainly
    (torch's own threads write it). Without keys (or ``PINPOOL_REQUIRE_PKEYS=1`` unset and
    none here), opened plainly either way."""
    pool = make_pool(SMALL, 2, arena_bytes=2 * SMALL)
    slot = pool.checkout(nbytes=SMALL)
    r = grant_of(pool, slot)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        window, at, _ = windows.open_for(r)
        first = memoryview(window)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(first)) + at
        first.release()
        keys = window.has_key
        if os.environ.get("PINPOOL_REQUIRE_PKEYS") == "1":
            assert keys, "no protection key for the window"
        keyed = keys and threads == 1
        assert (window.armed_range is not None) == keyed
        assert _reachable(addr) == (not keyed), "reached before allow() only if opened plainly"
        window.allow()
        assert _reachable(addr)
        window.deny()
        assert _reachable(addr) == (not keyed)
        window.allow()
        write_through(window, at, r.nbytes, 9)
        windows.close(window)
        assert not _reachable(addr)
        assert (window.armed_range is not None) == keyed, "kept armed between batches"
        again, _, new = windows.open_for(grant_of(pool, slot, 2))
        assert again is window and not new
        assert not _reachable(addr) or not keyed
        windows.close(again)
    finally:
        torch.set_num_threads(before)
    view = memoryview(slot)
    assert view[0] == 9 and view[r.nbytes - 1] == 9
    view.release()
    slot.release()


def test_a_window_that_cannot_be_closed_is_no_longer_kept(
    make_pool: Callable[..., Any], fresh_windows: None
) -> None:
    pool = make_pool(SMALL, 2, arena_bytes=2 * SMALL)
    slot = pool.checkout(nbytes=SMALL)
    window, _, _ = windows.open_for(grant_of(pool, slot))
    held = memoryview(window)  # (as a traceback may hold one)
    windows.close(window)
    assert window not in windows.kept(), "given up"
    assert window.open_range is not None, "never closed under a live view"
    held.release()
    again, _, new = windows.open_for(grant_of(pool, slot, 2))
    assert new and again is not window, "a window of its own"
    windows.close(again)
    slot.release()


def test_a_forked_child_keeps_none_of_its_parents_windows(
    make_pool: Callable[..., Any], fresh_windows: None
) -> None:
    """A forked child keeps none of its parent's windows (they are not mapped there): it maps,
    opens and closes its own."""
    pool = make_pool(BIG, 2, arena_bytes=2 * BIG)
    slots = [pool.checkout(nbytes=BIG) for _ in range(2)]
    window, _, _ = windows.open_for(grant_of(pool, slots[0]))
    windows.close(window)
    r = grant_of(pool, slots[1], 2)  # (the parent's: a worker reaches the main process's arena)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            signal.alarm(20)
            assert not windows.kept(), "the parent's windows are not kept here"
            mine, at, new = windows.open_for(r)
            write_through(mine, at, r.nbytes, 9)
            windows.close(mine)
            assert new and mine is not window
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
@given(steps=st.lists(st.integers(0, 3), min_size=1, max_size=24))
def test_batches_into_big_and_small_slots_land_and_leave_nothing_open(
    make_pool: Callable[..., Any], fresh_windows: None, steps: list[int]
) -> None:
    """Batches into big and small slots in any order: every open finds its range closed (no
    "open already"), every batch's bytes land in its slot, at most ``WINDOWS_KEPT`` windows
    and ``WINDOW_BYTES_KEPT`` bytes are kept, and nothing is open at the end."""
    pool = make_pool(BIG, 4, arena_bytes=4 * BIG)
    slots = [pool.checkout(nbytes=n) for n in (BIG, SMALL, BIG, SMALL)]
    windows._WINDOWS.clear()
    for n, i in enumerate(steps, start=1):
        r = grant_of(pool, slots[i], n)
        window, at, _ = windows.open_for(r)
        write_through(window, at, r.nbytes, n % 251)
        windows.close(window)
        view = memoryview(slots[i])
        assert view[0] == n % 251 and view[r.nbytes - 1] == n % 251
        view.release()
        kept = windows.kept()
        assert len(kept) <= WINDOWS_KEPT
        assert sum(w.length for w in kept) <= max(WINDOW_BYTES_KEPT, kept[0].length)
    assert all(w.open_range is None for w in windows.kept())
    windows._WINDOWS.clear()
    for s in slots:
        s.release()
