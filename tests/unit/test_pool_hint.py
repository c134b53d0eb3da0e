"""The pool made while the first batch is being made: a worker tells the main process the
batch's size after its first sample (``pinpool._wire.pool_hint``)."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import pickle
import threading
import time
from typing import Any

import pytest
from loader_datasets import Lopsided, Paced, Sized, sum_collate

import pinpool
from pinpool._main.route import lazy_pool
from pinpool._main.settings.sizing import MIN_ARENA
from pinpool._wire.pool_hint import PoolHint


def open_fds() -> dict[str, str]:
    """This process's open fds and what each is, once every pool dropped so far is freed (its
    memfds closed; the wait also covers the workers of ended epochs, whose pipes pinpool's
    ending thread closes before it lets their iterator, and the pool it holds, go)."""
    gc.collect()
    pinpool.wait_for_freed_pools(timeout=30)
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # (the listing's own fd, closed by now)
    return out


@pytest.fixture
def pool_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads on which loaders' pools were made."""
    made: list[str] = []
    real = lazy_pool.PinPool

    def recorded(*args: Any, **kwargs: Any) -> Any:
        made.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(lazy_pool, "PinPool", recorded)
    return made


def test_a_workers_hint_makes_the_pool_while_the_first_batch_is_made(
    pool_threads: list[str],
) -> None:
    """Streamed batches (1 MiB samples, 20 ms each): the pool is made on the hint's thread,
    the batches are exact, and after the loader nothing is left: no thread, no descriptor."""
    gc.collect()
    before = open_fds()
    ds = Paced(32, (256, 1024), seconds=0.02)
    loader = pinpool.DataLoader(ds, batch_size=8, num_workers=2)
    got = [b["idx"].tolist() for b in loader]
    assert got == [list(range(i, i + 8)) for i in range(0, 32, 8)]
    assert pool_threads == ["pinpool-pool-hint"]
    assert loader.pool is not None and loader.pool.slot_bytes >= 8 * 1024 * 1024
    assert not [t for t in threading.enumerate() if t.name == "pinpool-pool-hint"]
    del loader
    gc.collect()
    assert pinpool.wait_for_freed_pools(timeout=30)  # (the arena is freed on a thread of its own)
    # Every fd open now was open before (earlier tests' may have closed meanwhile).
    left = {fd: what for fd, what in open_fds().items() if before.get(fd) != what}
    assert not left, left


def test_a_hinted_pool_holds_batches_whose_small_arrays_outweigh_the_streamed_ones(
    pool_threads: list[str],
) -> None:
    """The hint counts the arrays collated after the streamed ones too: 2.5 MiB of small
    arrays beside 512 KiB of big ones still fit the pool it sized."""
    loader = pinpool.DataLoader(Lopsided(16, seconds=0.02), batch_size=8, num_workers=2)
    for i, batch in enumerate(loader):
        assert batch["idx"].tolist() == list(range(8 * i, 8 * i + 8))
        assert float(batch["small"][39][7][0]) == 8 * i + 7 + 39
    assert pool_threads == ["pinpool-pool-hint"]
    assert loader.stats()["overflow_batches"] == 0


def test_only_a_workers_first_batch_is_hinted(pool_threads: list[str]) -> None:
    """A worker whose first batch is small (not streamed) sends no hint for its later, big
    batches: the first batch sizes the pool, as without hints."""
    ds = Sized([1000] * 4 + [9 << 20] * 4)
    loader = pinpool.DataLoader(ds, batch_size=4, num_workers=1, oversize="copy")
    assert len(list(loader)) == 2
    assert len(pool_threads) == 1 and pool_threads[0] != "pinpool-pool-hint", pool_threads
    # Sized for a small first batch: the smallest arena, its largest batch half of it.
    assert loader.pool is not None and loader.pool.arena_bytes == MIN_ARENA
    assert loader.pool.largest_slot == MIN_ARENA // 2 < 36 << 20
    assert loader.stats()["oversize_batches"] == 1  # the big batch, in ordinary memory


def test_without_streamed_batches_the_first_batch_sizes_the_pool(
    pool_threads: list[str],
) -> None:
    """A collate_fn of the user's: no hint, the pool is made as the first batch arrives (on
    the main thread, or on torch's pin thread on a GPU machine)."""
    ds = Paced(16, (256, 1024), seconds=0.0)
    loader = pinpool.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=sum_collate)
    assert len(list(loader)) == 2
    assert len(pool_threads) == 1 and pool_threads[0] != "pinpool-pool-hint", pool_threads


def test_a_hint_never_blocks_the_worker_and_only_the_first_is_sent() -> None:
    hint = PoolHint()
    for _ in range(20_000):  # far more than the pipe holds: none may block or raise
        hint._sent_by = None
        hint.send(1 << 20, 8)
    hint._sent_by = None
    hint.send(1, 1)
    hint.send(2, 2)  # the same process: not sent
    assert hint._reader is not None
    hint.close()


def test_a_hint_carries_its_pipe_only_into_a_starting_process() -> None:
    hint = PoolHint()
    copy = pickle.loads(pickle.dumps(hint))
    assert copy._writer is None and copy._reader is None
    copy.send(1, 1)  # nothing to send through: a no-op
    made: list[tuple[int, int]] = []
    hint.watch(lambda n, c: made.append((n, c)), lambda: not made)
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_send_hint, args=(hint,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    deadline = time.monotonic() + 10
    while not made and time.monotonic() < deadline:
        time.sleep(0.01)
    assert made == [(12345, 7)]
    hint.close()
    assert hint._reader is None and hint._writer is None


def _send_hint(hint: PoolHint) -> None:
    hint.send(12345, 7)


def test_a_failing_hint_is_logged_and_its_thread_ends(caplog: pytest.LogCaptureFixture) -> None:
    hint = PoolHint()

    def refuse(nbytes: int, count: int) -> None:
        raise pinpool.BatchTooLarge("too large for this machine", nbytes, 0)

    gc.collect()
    with caplog.at_level(logging.WARNING, logger="pinpool"):
        hint.watch(refuse, lambda: True)
        hint._sent_by = None
        hint.send(1 << 50, 1)
        assert hint._thread is not None
        hint._thread.join(10)
    assert not hint._thread.is_alive()
    assert "could not make the pool ahead" in caplog.text
    hint.close()


def test_a_wrong_hint_is_undone_by_the_first_batch(caplog: pytest.LogCaptureFixture) -> None:
    """A hint may only speed the first batch up: a pool made from one that was too small
    for the real first batch, or far larger than it needs, is made again from the real one,
    as long as nothing has used it."""
    loader = pinpool.DataLoader(Paced(4, (1, 1), seconds=0.0), batch_size=2, num_workers=0)
    receiver = loader._pinpool_receiver
    receiver.pools.make_from_hint(1, 1)  # "a 1-byte batch"
    small = receiver.pool
    assert small is not None and small.arena_bytes == MIN_ARENA
    real = 33 << 20  # larger than any batch that pool takes
    assert small.largest_slot < real
    with caplog.at_level(logging.WARNING, logger="pinpool"):
        pool, _ = receiver.pools.pool_for(real)
    assert pool is not small and small.closed
    assert pool.largest_slot >= real
    assert "made again" in caplog.text
    # A later batch never remakes it, even one the pool cannot take (its error is the
    # claim's, naming the setting).
    assert receiver.pools.pool_for(1)[0] is pool

    # "A 64 MiB batch", then a real one of 1 KiB: the arena it would have made is the
    # smallest, and the hinted one is made again, that small.
    loader = pinpool.DataLoader(Paced(4, (1, 1), seconds=0.0), batch_size=2, num_workers=0)
    receiver = loader._pinpool_receiver
    receiver.pools.make_from_hint(64 << 20, 1)
    big = receiver.pool
    assert big is not None and big.arena_bytes > 4 * MIN_ARENA
    pool, _ = receiver.pools.pool_for(1024)
    assert pool is not big and pool.arena_bytes == MIN_ARENA

    # A hinted pool already in use stays.
    loader = pinpool.DataLoader(Paced(4, (1, 1), seconds=0.0), batch_size=2, num_workers=0)
    receiver = loader._pinpool_receiver
    receiver.pools.make_from_hint(1, 1)
    used = receiver.pool
    assert used is not None
    with used.checkout(nbytes=1):
        assert receiver.pools.pool_for(real)[0] is used
