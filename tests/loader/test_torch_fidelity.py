"""What a user's code sees of torch's DataLoader, it sees of pinpool's, and pinpool's never fails
where torch's succeeds by default:

- the iterator answers what torch's does (its worker processes, their count, the dataset's
  kind), and a worker the iterator shut down is joined and not alive, every time;
- ``get_worker_info().dataset`` in a worker is the user's dataset, in every mode;
- a ``StopIteration`` from the dataset ends the epoch, as in torch;
- batches larger than the arena takes are still delivered (memory of their own, counted and
  warned about once), unless ``oversize="error"``, whose advice, followed, works;
- an object pinpool cannot look into warns once per loader, naming its type;
- ``stats()["batches"]`` counts the batches handed over, those taken ahead apart.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
import torch
import torch.utils.data
from loader_datasets import ShardedRange

import pinpool
from pinpool import BatchTooLarge

MODES = [
    pytest.param({}, id="streamed"),
    pytest.param({"zero_copy": True}, id="zero-copy"),
    pytest.param({"stream_samples": False}, id="unstreamed"),
    pytest.param({"collate_fn": torch.utils.data.default_collate}, id="collate-fn"),
]


class Marked(torch.utils.data.Dataset[torch.Tensor]):
    """Item ``i``: 64 KB of ``i`` (streamed), then whether the worker's dataset is this one."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        mine = info is not None and isinstance(info.dataset, Marked)
        row = torch.full((8192,), i, dtype=torch.int64)
        row[0] = int(mine)
        return row


@pytest.mark.parametrize("kwargs", MODES)
def test_a_worker_sees_the_users_dataset_and_the_iterator_its_workers(
    kwargs: dict[str, Any],
) -> None:
    loader = pinpool.DataLoader(Marked(), batch_size=3, num_workers=2, **kwargs)
    it = iter(loader)
    batches = list(it)
    assert all(int(b[r, 0]) == 1 for b in batches for r in range(3)), "a wrapper in the worker"
    assert [int(b[r, 1]) for b in batches for r in range(3)] == list(range(12))
    reference = iter(torch.utils.data.DataLoader(Marked(), batch_size=3, num_workers=2))
    assert it._num_workers == reference._num_workers == 2
    assert it._dataset_kind == reference._dataset_kind
    assert len(it._workers) == 2 and all(w.pid for w in it._workers)
    del reference
    with pytest.raises(AttributeError):
        _ = it._no_such_attribute


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_workers_the_iterator_shut_down_are_joined_and_gone_every_time() -> None:
    """The epoch's end shuts its workers down on a thread of its own: a caller joining them at
    the same moment finds them gone, never 'alive' for a child reaped by the other thread."""
    alive = []
    for trial in range(12):
        it = iter(pinpool.DataLoader(ShardedRange(12), batch_size=2, num_workers=3))
        for _ in it:
            pass
        for w in it._workers:
            w.join(60)
            if w.is_alive():
                alive.append((trial, w.pid))
    assert not alive, alive


class StopsAt(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 12:
            raise StopIteration
        return torch.full((8000,), i)


@pytest.mark.filterwarnings("ignore:pinpool.DataLoader. zero_copy=True does nothing")
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kwargs", MODES)
def test_a_stop_iteration_from_the_dataset_ends_the_epoch_as_in_torch(
    kwargs: dict[str, Any], workers: int
) -> None:
    reference = [
        b[:, 0].tolist()
        for b in torch.utils.data.DataLoader(StopsAt(), batch_size=2, num_workers=workers)
    ]
    got = [
        b[:, 0].tolist()
        for b in pinpool.DataLoader(StopsAt(), batch_size=2, num_workers=workers, **kwargs)
    ]
    assert got == reference and len(got) == 6


class Growing(torch.utils.data.Dataset[torch.Tensor]):
    """Four batches of 100 KB, then four of 40 MB (batch size 1)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((100_000 if i < 4 else 40_000_000,), i, dtype=torch.uint8)


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_larger_than_the_arena_takes_are_still_delivered(
    workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    loader = pinpool.DataLoader(Growing(), batch_size=1, num_workers=workers)
    with caplog.at_level(logging.WARNING, logger="pinpool"):
        got = [int(b[0, 0]) for b in loader]
    assert got == list(range(8))
    assert loader.stats()["oversize_batches"] == 4
    said = [r.getMessage() for r in caplog.records if "larger than the largest" in r.getMessage()]
    assert len(said) == 1 and "max_batch_bytes=40000000" in said[0], said


def test_oversize_error_raises_and_its_advice_works() -> None:
    with pytest.raises(BatchTooLarge) as info:
        list(pinpool.DataLoader(Growing(), batch_size=1, oversize="error"))
    advice = str(info.value)
    assert "max_batch_bytes=40000000" in advice, advice
    followed = pinpool.DataLoader(
        Growing(), batch_size=1, oversize="error", max_batch_bytes=40_000_000
    )
    assert sum(1 for _ in followed) == 8
    # With arena_bytes given too, the advice names both.
    with pytest.raises(BatchTooLarge) as info:
        list(pinpool.DataLoader(Growing(), batch_size=1, oversize="error", arena_bytes=6 << 20))
    assert "arena_bytes=" in str(info.value) and "max_batch_bytes=" in str(info.value)


class Box:
    """An object pinpool cannot look into, holding a tensor."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _boxed(samples: list[torch.Tensor]) -> Box:
    return Box(torch.stack(samples))


@pytest.mark.parametrize("workers", [0, 2])
def test_an_object_pinpool_cannot_look_into_warns_once_per_loader(workers: int) -> None:
    data = [torch.randn(4) for _ in range(8)]
    for _ in range(2):  # (each loader warns: once per loader, not per process)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = pinpool.DataLoader(data, batch_size=2, num_workers=workers, collate_fn=_boxed)
            for _epoch in range(2):
                for batch in loader:
                    assert isinstance(batch, Box)
        said = [str(w.message) for w in caught if "cannot look into" in str(w.message)]
        assert len(said) == 1 and "Box" in said[0] and "dataclass" in said[0], said


def test_stats_count_the_batches_handed_over() -> None:
    loader = pinpool.DataLoader(torch.arange(64.0), batch_size=4, num_workers=2)
    it = iter(loader)
    first = next(it)
    stats = loader.stats()
    assert stats["batches"] == 1 and stats["bytes"] == first.nbytes
    assert stats["batches_ahead"] >= 0
    rest = list(it)
    stats = loader.stats()
    assert stats["batches"] == 1 + len(rest) == 16 and stats["batches_ahead"] == 0
