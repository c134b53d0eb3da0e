"""A soak of the whole matrix of a loader's modes (``soak_cases``): copy and zero-copy, with and
without torch's pin thread (and the device, where there is one), 0 to 8 workers, fork and
forkserver, batches of fixed, lognormal, ascending, descending and alternating sizes and one at
the largest allowed, a consumer that keeps nothing, its last few batches or everything,
persistent workers, a ``break`` in the first epoch. Each run against torch's own loader:

- every batch bit for bit torch's;
- no ``next()`` over :data:`NEXT_AT_MOST_S` (but each worker's first batch of an epoch that
  starts the workers: it waits for that worker's start, a forkserver's child importing torch);
- no batch in ordinary memory where the arena could hold it: none at all unless the consumer
  keeps everything, and then only when no free range of the arena holds the batch;
- every slot and byte back in the arena at the end, and no grant left out;
- zero-copy: at least :data:`IN_PLACE_AT_LEAST` of the batches written in place by the
  workers, unless the consumer keeps everything.

``make test`` runs the cases every run needs and :data:`CASES` drawn from a seeded generator
(``$PINPOOL_SOAK_CASES`` and ``$PINPOOL_SOAK_SEED`` change them); ``make soak`` runs many more,
with the device modes on a GPU machine.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from typing import Any

import pytest
import torch
import torch.utils.data
from conftest import fake_pin_thread
from loader_datasets import array_leaves, assert_same, in_pool
from soak_cases import KEPT_LAST, Case, dataset_of, draw

import pinpool
from pinpool._main.epochs import ending_thread

#: The longest any ``next()`` may take (but the first from each worker an iterator starts).
NEXT_AT_MOST_S = 2.0
#: The least share of zero-copy batches written in place (unless the consumer keeps everything).
IN_PLACE_AT_LEAST = 0.75
#: Cases drawn, beyond those every run needs.
CASES = int(os.environ.get("PINPOOL_SOAK_CASES", "14"))
SEED = int(os.environ.get("PINPOOL_SOAK_SEED", "20261204"))

_DEVICES = ("cuda",) if torch.cuda.is_available() else ()


def _needed() -> list[Case]:
    """The cases every run needs: dynamic padding with lognormal and ascending lengths, 8
    workers, zero-copy with and without the pin thread; and the same in copy mode."""
    base = draw(0)
    out = []
    for zero_copy in (True, False):
        for sizes, pin in (("lognormal", False), ("ascending", True)):
            out.append(
                base.__class__(
                    **{
                        **base.__dict__,
                        "seed": len(out) + 1,
                        "zero_copy": zero_copy,
                        "pin_thread": pin,
                        "device": None,
                        "workers": 8,
                        "context": "fork",
                        "sizes": sizes,
                        "keep": "nothing",
                        "persistent": False,
                        "brk": False,
                        "streamed": False,
                        "batches": 40,
                        "batch_size": 16,
                        "median": 3 << 20,
                    }
                )
            )
    return out


ALL = _needed() + [draw(SEED + i, _DEVICES) for i in range(CASES)]


def _bytes(batch: Any) -> int:
    return sum(leaf.nbytes for leaf in array_leaves(batch))


def _pages(n: int) -> int:
    page = 4096
    return -(-n // page) * page


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("case", ALL, ids=[c.id for c in ALL])
def test_a_run_of_the_matrix(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    if case.pin_thread:
        fake_pin_thread(monkeypatch)
    dataset, collate = dataset_of(case)
    reference = list(
        torch.utils.data.DataLoader(dataset, batch_size=case.batch_size, collate_fn=collate)
    )
    largest = max(_bytes(b) for b in reference)
    kw: dict[str, Any] = {
        "batch_size": case.batch_size,
        "num_workers": case.workers,
        "collate_fn": collate,
        "zero_copy": case.zero_copy and case.workers > 0,
        "persistent_workers": case.persistent,
        "device": case.device,
    }
    if case.workers:
        kw["multiprocessing_context"] = case.context
    if case.sizes == "at_max":
        kw["max_batch_bytes"] = largest  # (a streamed batch: one array, exactly its bytes)
    if case.keep == "last":  # (the default arena holds the batches in flight and 4 more)
        in_flight = 2 * case.workers if case.workers else 1
        kw["arena_bytes"] = _pages(int((in_flight + KEPT_LAST + 4) * largest * 1.5))
        kw.setdefault("max_batch_bytes", _pages(largest))
    elif case.sizes != "at_max":
        kw["oversize"] = "copy"  # (the default largest batch is sized from the first)
    loader = pinpool.DataLoader(dataset, **kw)
    epochs = 2 if case.persistent or case.brk else 1
    times: list[float] = []
    held: list[Any] = []
    for epoch in range(epochs):
        starts_workers = case.workers > 0 and (epoch == 0 or not case.persistent)
        # (batch i comes from worker i % workers: the first of each waits for its start)
        started_by = case.workers if starts_workers else 0
        it = iter(loader)
        for i, ref in enumerate(reference):
            if case.brk and epoch == 0 and i == len(reference) // 2:
                break
            t0 = time.perf_counter()
            batch = next(it)
            if i >= started_by:
                times.append(time.perf_counter() - t0)
            got = _on_host(batch)
            assert_same(ref, got, f"epoch {epoch} batch {i}")
            if case.device is None:
                leaves = [x for x in array_leaves(batch) if x.nbytes]
                if not all(in_pool(loader.pool, x) for x in leaves):
                    # In ordinary memory: only where no free range held it.
                    stats = loader.stats()
                    need = _pages(_bytes(batch))
                    assert stats["largest_free"] < need, (i, need, stats)
                del leaves
            del got
            if case.keep == "nothing":
                del batch
            else:
                held.append(batch)
                del batch
                if case.keep == "last":
                    del held[:-KEPT_LAST]
        del it
    assert max(times, default=0.0) <= NEXT_AT_MOST_S, sorted(times)[-5:]
    stats = loader.stats()
    if case.keep != "everything":
        assert stats["overflow_batches"] == 0, stats
        if kw["zero_copy"]:
            written = stats["zero_copy_batches"] + stats["zero_copy_fallbacks"]
            assert stats["zero_copy_batches"] >= IN_PLACE_AT_LEAST * written, stats
    pool = loader.pool
    grants = loader._pinpool_receiver.grants
    held.clear()
    ending_thread.wait_all(timeout=30)
    gc.collect()
    if pool is not None:
        _wait_until_back(pool)
    if grants is not None:
        assert grants._grants.outstanding == 0, "a grant left out"
    del loader
    ending_thread.wait_all(timeout=30)
    gc.collect()


def _on_host(batch: Any) -> Any:
    """The batch with its tensors on the CPU (the device mode's batches are on the GPU)."""
    if isinstance(batch, torch.Tensor):
        return batch.cpu() if batch.device.type != "cpu" else batch
    if isinstance(batch, dict):
        return {k: _on_host(v) for k, v in batch.items()}
    return batch


def _wait_until_back(pool: Any) -> None:
    """Every slot and byte back in the arena (fences complete within a moment)."""
    deadline = time.monotonic() + 10
    while True:
        s = pool.stats()
        back = s["bytes_free"] + s["bytes_preparing"] == s["arena_bytes"]
        if (s["slots_checked_out"] == 0 and s["slots_fenced"] == 0 and back) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.01)
        gc.collect()
    assert s["slots_checked_out"] == 0 and s["bytes_checked_out"] == 0, s
    assert s["bytes_free"] + s["bytes_fenced"] + s["bytes_preparing"] == s["arena_bytes"], s


class Fixed(torch.utils.data.Dataset[torch.Tensor]):
    """Item ``i``: ``nbytes`` bytes of ``i % 251``."""

    def __init__(self, n: int, nbytes: int) -> None:
        self.n, self.nbytes = n, nbytes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.nbytes,), i % 251, dtype=torch.uint8)


#: (room in the arena, in batches; overflow=; zero_copy; pin thread): each with 1, 2, 4 or 8
#: workers in turn.
TIGHT = [
    (room, overflow, zero_copy, pin)
    for room in (1.0, 1.5, 2.0)
    for overflow in ("wait", "copy")
    for zero_copy in (False, True)
    for pin in (False, True)
]


@pytest.mark.filterwarnings("ignore:pinpool. zero-copy fell back:UserWarning")
@pytest.mark.parametrize(
    ("room", "overflow", "zero_copy", "pin", "workers"),
    [(*case, (1, 2, 4, 8)[i % 4]) for i, case in enumerate(TIGHT)],
    ids=[f"room{r}-{o}-{'zc' if z else 'copy'}{'+pin' if p else ''}" for r, o, z, p in TIGHT],
)
def test_an_arena_with_room_for_one_batch_delivers_every_batch(
    room: float,
    overflow: str,
    zero_copy: bool,
    pin: bool,
    workers: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The awaited batch comes first: room the loader holds for itself (batches taken ahead or
    granted ahead of the one the consumer waits for) never keeps it waiting, however little
    room there is. A consumer that keeps nothing gets every batch, in the arena, at once."""
    if pin:
        fake_pin_thread(monkeypatch)
    batch = 256 << 10
    loader = pinpool.DataLoader(
        Fixed(24, batch),
        batch_size=1,
        num_workers=workers,
        zero_copy=zero_copy,
        arena_bytes=_pages(int(room * batch)),
        max_batch_bytes=batch,
        overflow=overflow,
        slot_timeout=10,
    )
    slowest = 0.0
    it = iter(loader)
    for i in range(24):
        t0 = time.perf_counter()
        got = next(it)
        if i >= workers:
            slowest = max(slowest, time.perf_counter() - t0)
        assert int(got[0, 0]) == i and in_pool(loader.pool, got), i
        del got
    assert next(it, None) is None
    assert slowest <= NEXT_AT_MOST_S, slowest
    assert loader.stats()["overflow_batches"] == 0, loader.stats()
    del it, loader
    ending_thread.wait_all(timeout=30)


#: Runs of the keep-last case per mode (``$PINPOOL_KEEP_LAST_RUNS``: 20 on a GPU machine, where
#: torch's pin thread takes batches in arrival order).
KEEP_LAST_RUNS = int(os.environ.get("PINPOOL_KEEP_LAST_RUNS", "1"))
#: (zero_copy, pin thread, device): copy and zero-copy, through the pin thread or not, and to
#: the device where there is one.
KEEP_LAST_MODES = [
    (False, False, None),
    (True, False, None),
    (True, True, None),
    *[(zero_copy, True, device) for device in _DEVICES for zero_copy in (False, True)],
]


@pytest.mark.parametrize("run", range(KEEP_LAST_RUNS))
@pytest.mark.parametrize(
    ("zero_copy", "pin", "device"),
    KEEP_LAST_MODES,
    ids=[
        f"{'zc' if z else 'copy'}{'+pin' if p else ''}{'+' + d if d else ''}"
        for z, p, d in KEEP_LAST_MODES
    ],
)
def test_a_consumer_keeping_its_last_batches_finds_room_in_the_default_arena(
    zero_copy: bool, pin: bool, device: str | None, run: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamic padding (lognormal lengths, batches of about 1 to 8 MB), 8 workers, the consumer
    keeping its last 4 batches, at most half the default arena: no batch in ordinary memory.
    Each run draws other lengths."""
    if pin:
        fake_pin_thread(monkeypatch)
    case = dataclasses.replace(
        _needed()[0],
        seed=1000 + run,
        sizes="lognormal",
        zero_copy=zero_copy,
        batches=40,
        median=3 << 20,
    )
    dataset, collate = dataset_of(case)
    loader = pinpool.DataLoader(
        dataset,
        batch_size=case.batch_size,
        num_workers=8,
        collate_fn=collate,
        zero_copy=zero_copy,
        device=device,
    )
    held: list[Any] = []
    for batch in loader:
        held = [*held[-3:], batch]
        assert sum(_bytes(b) for b in held) <= loader.pool.arena_bytes // 2
    assert loader.stats()["overflow_batches"] == 0, loader.stats()
    held.clear()
    del loader
    ending_thread.wait_all(timeout=30)


class ChangingBatches(torch.utils.data.Sampler[list[int]]):
    """A batch sampler whose batch size changes each epoch (2, 4 or 6 items)."""

    def __init__(self) -> None:
        self.epoch = 0

    def __len__(self) -> int:
        return 40

    def __iter__(self) -> Any:
        self.epoch += 1
        size = 2 + 2 * (self.epoch % 3)
        for b in range(40):
            yield list(range(b * size, (b + 1) * size))


#: The longest a call may take after a ``break`` with every batch kept (torch's own: about 50
#: ms here; a worker's request parked at the grant desk used to hold it for 5 s).
AFTER_BREAK_AT_MOST_S = 1.0


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_a_break_with_every_batch_kept_waits_on_no_parked_request(persistent: bool) -> None:
    """Zero-copy, batch sizes changing each epoch, the consumer keeping every batch until the
    next ``iter()`` and breaking mid-epoch: the workers' requests for room that only the
    consumer could give back are parked at the grant desk, and an iterator that ends (or a
    persistent one's next epoch) has them answered at once. No ``iter()``, ``next()`` or drop
    waits for them."""
    loader = pinpool.DataLoader(
        Fixed(400, 256 << 10),
        batch_sampler=ChangingBatches(),
        num_workers=4,
        zero_copy=True,
        persistent_workers=persistent,
        arena_bytes=8 << 20,
    )
    slowest = 0.0

    def timed(call: Any, arg: Any) -> Any:
        nonlocal slowest
        t0 = time.perf_counter()
        out = call(arg)
        slowest = max(slowest, time.perf_counter() - t0)
        return out

    kept: list[Any] = []
    for _ in range(4):
        it = timed(iter, loader)  # (the last epoch's batches still kept)
        kept = [timed(next, it) for _ in range(6)]
        time.sleep(0.3)  # (the workers' requests for the next batches park meanwhile)
        if not persistent:
            t0 = time.perf_counter()
            it = None  # (dropped mid-epoch)
            slowest = max(slowest, time.perf_counter() - t0)
    t0 = time.perf_counter()
    del loader, it
    slowest = max(slowest, time.perf_counter() - t0)
    kept.clear()
    ending_thread.wait_all(timeout=30)
    assert slowest <= AFTER_BREAK_AT_MOST_S, slowest
