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
def test_batches_larger_than_the_arena_takes_are_still_delivered(workers: int) -> None:
    """... and a warning the user sees by default (not only a logger's record) says so, once
    per loader, naming the user's own line."""
    loader = pinpool.DataLoader(Growing(), batch_size=1, num_workers=workers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()  # (the default filters: what a user's script sees)
        got = [int(b[0, 0]) for b in loader]
    assert got == list(range(8))
    assert loader.stats()["oversize_batches"] == 4
    said = [w for w in caught if "larger than the largest" in str(w.message)]
    assert len(said) == 1 and "max_batch_bytes=40000000" in str(said[0].message), said
    assert said[0].category is UserWarning and said[0].filename == __file__


class Kept(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((64 << 10,), i, dtype=torch.uint8)


@pytest.mark.every_mode
def test_overflow_batches_warn_where_a_user_sees_it(loader_mode: Any) -> None:
    """Every batch kept (``list(loader)``) in an arena of two: the rest overflow, and one
    warning says so."""
    loader = pinpool.DataLoader(
        Kept(), batch_size=1, num_workers=2, slot_bytes=64 << 10, num_slots=2
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        kept = list(loader)
    assert [int(b[0, 0]) for b in kept] == list(range(16))
    overflowed = loader.stats()["overflow_batches"] + loader.stats()["zero_copy_fallbacks"]
    assert overflowed > 0
    said = [str(w.message) for w in caught if str(w.message).startswith("pinpool: ")]
    assert said and len(said) == len(set(said)) <= 2, said  # (once per event and loader)
    if loader.stats()["zero_copy_fallbacks"] * 4 > 16:
        assert any("zero-copy fell back" in m for m in said), said


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


def _ints(samples: list[int]) -> list[int]:
    """A batch with no tensors: torch's pin step passes it as it is (on any machine)."""
    return list(samples)


def _missing(reference: Any, it: Any, when: str) -> list[str]:
    """The attributes torch's iterator has that pinpool's does not, at ``when``."""
    names = [n for n in dir(reference) if not (n.startswith("__") and n.endswith("__"))]
    return [f"{when}: {n}" for n in names if not hasattr(it, n)]


@pytest.mark.every_mode
@pytest.mark.filterwarnings("ignore:pinpool.DataLoader. zero_copy=True does nothing")
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("persistent", [False, True])
def test_the_iterator_has_every_attribute_torchs_has_at_every_moment(
    loader_mode: Any, workers: int, persistent: bool
) -> None:
    """At construction, mid-epoch, after exhaustion and after shutdown, with persistent
    workers and without: ``_pin_memory_thread`` from construction wherever torch has it (with
    a GPU, or ``fake_pin_thread``), ``_shutdown``, ``_worker_pids_set``..."""
    if persistent and workers == 0:
        pytest.skip("persistent_workers needs workers")
    kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": workers, "collate_fn": _ints}
    kwargs["persistent_workers"] = persistent
    data = list(range(8))
    torch_loader = torch.utils.data.DataLoader(data, pin_memory=True, **kwargs)
    ours = pinpool.DataLoader(data, **kwargs)
    missing: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch on a machine without an accelerator)
        reference, it = iter(torch_loader), iter(ours)
    missing += _missing(reference, it, "constructed")
    assert hasattr(reference, "_pin_memory_thread") == hasattr(it, "_pin_memory_thread")
    assert next(reference) == next(it) == [0, 1]
    missing += _missing(reference, it, "mid-epoch")
    assert list(reference) == list(it) == [[2, 3], [4, 5], [6, 7]]
    missing += _missing(reference, it, "exhausted")
    if workers:
        reference._shutdown_workers()
        it._shutdown_workers()
        assert reference._shutdown and it._shutdown
        missing += _missing(reference, it, "shut down")
    assert not missing, missing
    with pytest.raises(AttributeError):
        _ = it._no_such_attribute


@pytest.mark.every_mode
@pytest.mark.filterwarnings("ignore:pinpool.DataLoader. zero_copy=True does nothing")
@pytest.mark.parametrize("workers", [0, 2])
def test_pin_memory_false_gives_torchs_unpinned_batches(loader_mode: Any, workers: int) -> None:
    data = [{"x": torch.full((1000,), i), "i": i} for i in range(8)]
    reference = list(torch.utils.data.DataLoader(data, batch_size=2, num_workers=workers))
    loader = pinpool.DataLoader(data, batch_size=2, num_workers=workers, pin_memory=False)
    for _epoch in range(2):
        got = list(loader)
        assert [b["i"].tolist() for b in got] == [b["i"].tolist() for b in reference]
        assert all(torch.equal(r["x"], g["x"]) for r, g in zip(reference, got, strict=True))
        assert not any(b["x"].is_pinned() for b in got)
    assert loader.pool is None and loader.stats()["batches"] == 0, "batches went to the arena"
    assert loader.pin_memory is False


def test_pin_memory_false_says_what_it_leaves_out_and_refuses_a_device() -> None:
    data = list(range(8))
    with pytest.warns(UserWarning, match="copy_threads=2 does nothing with pin_memory=False"):
        pinpool.DataLoader(data, batch_size=2, pin_memory=False, copy_threads=2)
    with pytest.raises(ValueError, match="pin_memory=False asks for none"):
        pinpool.DataLoader(data, batch_size=2, pin_memory=False, device="cuda")
    assert pinpool.DataLoader(data).pin_memory is True, "pinpool's loader pins unless told not"


@pytest.mark.parametrize("workers", [0, 2])
def test_pin_memory_device_alone_keeps_torchs_default_and_pins_nothing(workers: int) -> None:
    """torch's deprecated ``pin_memory_device`` given without ``pin_memory``: torch's default
    (False) holds, so the batches are torch's own, unpinned, with torch's warnings."""
    kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": workers, "pin_memory_device": "cuda"}
    got: dict[str, list[Any]] = {}
    said: dict[str, list[str]] = {}
    for name, make in (("torch", torch.utils.data.DataLoader), ("pinpool", pinpool.DataLoader)):
        data = [{"x": torch.full((64,), i)} for i in range(8)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = make(data, **kwargs)
            got[name] = list(loader)
        said[name] = sorted({str(w.message) for w in caught if "pin_memory" in str(w.message)})
        assert loader.pin_memory is False
    assert not any(b["x"].is_pinned() for b in got["pinpool"])
    assert all(
        torch.equal(t["x"], p["x"]) for t, p in zip(got["torch"], got["pinpool"], strict=True)
    )
    assert said["pinpool"] == said["torch"], said


@pytest.mark.parametrize("workers", [0, 2])
def test_pin_memory_device_warns_in_torchs_words(workers: int) -> None:
    kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": workers}
    kwargs.update(pin_memory=True, pin_memory_device="cuda")
    said: dict[str, list[str]] = {}
    for name, make in (("torch", torch.utils.data.DataLoader), ("pinpool", pinpool.DataLoader)):
        loader = make(list(range(8)), **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert [int(x) for b in loader for x in b] == list(range(8))
        said[name] = sorted({str(w.message) for w in caught if "pin_memory" in str(w.message)})
    assert said["pinpool"] == said["torch"] and said["torch"], said


def test_an_exhausted_arena_says_who_holds_its_room() -> None:
    """The batches the user holds are counted apart from the room the loader holds."""
    loader = pinpool.DataLoader(
        Kept(),
        batch_size=1,
        num_workers=2,
        slot_bytes=64 << 10,
        num_slots=2,
        overflow="wait",
        slot_timeout=0.5,
    )
    kept = []
    with pytest.raises(pinpool.PoolExhausted) as info:
        for batch in loader:
            kept.append(batch)
    said = str(info.value)
    assert len(kept) == 2 and "2 batches you hold and 0 the loader holds" in said, said
