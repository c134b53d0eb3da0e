"""``DataLoader.state_dict()`` / ``load_state_dict()``: a run stopped after k batches and
resumed in a fresh loader yields what the uninterrupted run yields after those k batches, bit
for bit, the next epoch included; skipped batches take no slot and no slot leaks.

Each case runs an uninterrupted loader for two epochs, then a loader stopped after k batches
(k = 0, mid-epoch, every batch, and after the epoch's end) whose state goes through
``torch.save``/``torch.load`` into a fresh loader with the same arguments, in a process whose
global RNG has meanwhile moved on.
"""

from __future__ import annotations

import copy
import functools
import gc
import io
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.data
from torch.utils._pytree import tree_flatten, tree_map

import pinpool
from pinpool import InvalidArgument

N = 23  # samples: batches of 4 leave a partial one


class Indexed(torch.utils.data.Dataset[Any]):
    """Samples that depend only on their index."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return {"x": torch.arange(8, dtype=torch.float32) + 8 * i, "i": i}


class Counting(torch.utils.data.IterableDataset[Any]):
    """An iterable dataset with the Stateful protocol: it resumes from a loaded position."""

    def __init__(self) -> None:
        self.pos = 0
        self.start = 0

    def __iter__(self) -> Iterator[Any]:
        self.pos, self.start = self.start, 0
        while self.pos < N:
            self.pos += 1
            yield torch.full((3,), float(self.pos - 1))

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["pos"]


class Sharded(torch.utils.data.IterableDataset[Any]):
    """An iterable dataset with the Stateful protocol that shards itself over the workers
    (worker w of n makes items w, w + n, ...): each worker's copy has its own position."""

    def __init__(self, size: int = N) -> None:
        self.size = size
        self.done = 0  # items this copy has made in the current pass
        self.start = 0

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = range(worker, self.size, workers)
        self.done, self.start = self.start, 0
        while self.done < len(mine):
            self.done += 1
            yield {"x": torch.full((3,), float(mine[self.done - 1])), "w": worker}

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["done"]


class Stateless(torch.utils.data.IterableDataset[Any]):
    def __iter__(self) -> Iterator[Any]:
        return iter(range(N))


def _own(batch: Any) -> Any:
    """The batch with its tensors copied out of their slots."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batch)


def _same(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        xs, xspec = tree_flatten(x)
        ys, yspec = tree_flatten(y)
        assert xspec == yspec
        for u, v in zip(xs, ys, strict=True):
            if isinstance(u, torch.Tensor):
                assert u.dtype == v.dtype and torch.equal(u, v)
            else:
                assert u == v


def _through_bytes(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)


def _check_resume(
    make: Callable[[], pinpool.DataLoader], k: int | str, before: int = 0
) -> pinpool.DataLoader:
    """Runs the uninterrupted and the interrupted run; ``k``: batches before the state is
    taken, after ``before`` whole epochs, or "end" (after that epoch's StopIteration).
    Returns the resumed loader."""
    torch.manual_seed(0)
    loader = make()
    expected = [_own(b) for _ in range(before + 2) for b in loader]
    del loader

    torch.manual_seed(0)
    loader = make()
    got = [_own(b) for _ in range(before) for b in loader]
    if k == "end":
        got += [_own(b) for b in loader]
    else:
        it = iter(loader)
        got += [_own(next(it)) for _ in range(int(k))]
    state = _through_bytes(loader.state_dict())
    del loader
    gc.collect()

    torch.manual_seed(1234)  # a fresh process: the global RNG is elsewhere
    torch.rand(7)
    fresh = make()
    fresh.load_state_dict(state)
    delivered = len(got)
    if k != "end":
        got += [_own(b) for b in fresh]  # the rest of the interrupted epoch
    got += [_own(b) for b in fresh]
    _same(got, expected)
    # Skipped batches were never loaded: the fresh loader took in only what it yielded.
    assert fresh.stats()["batches"] == len(expected) - delivered
    gc.collect()
    pool = fresh.pool
    if pool is not None:
        stats = pool.stats()
        assert (stats["bytes_checked_out"], stats["bytes_fenced"]) == (0, 0), stats
    return fresh


KS = [0, 2, 5, 6, "end"]  # 6 batches an epoch (23 samples, batches of 4)


@pytest.mark.parametrize("k", KS)
def test_sequential(k: int | str) -> None:
    _check_resume(lambda: pinpool.DataLoader(Indexed(), batch_size=4), k)


@pytest.mark.parametrize("k", KS)
def test_shuffle_from_global_rng_drop_last(k: int | str) -> None:
    _check_resume(lambda: pinpool.DataLoader(Indexed(), batch_size=4, shuffle=True), k)
    _check_resume(
        lambda: pinpool.DataLoader(Indexed(), batch_size=4, shuffle=True, drop_last=True),
        5 if k == 6 else k,
    )


@pytest.mark.parametrize(("k", "before"), [(0, 0), (3, 0), ("end", 0), (3, 1)])
def test_shuffle_with_generator(k: int | str, before: int) -> None:
    _check_resume(
        lambda: pinpool.DataLoader(
            Indexed(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)
        ),
        k,
        before,
    )


@pytest.mark.parametrize("k", [0, 2, 4, "end"])
def test_custom_batch_sampler(k: int | str) -> None:
    sampler = [[3, 1], [0, 2, 4, 5], [22], list(range(6, 20))]
    _check_resume(lambda: pinpool.DataLoader(Indexed(), batch_sampler=sampler), k)


class ItsOwnIterator:
    """A batch sampler whose iter() returns itself, restarted (as Lightning's index-tracking
    wrapper does): iter() must be called on it once an epoch."""

    def __init__(self) -> None:
        self.batches = [[1, 2], [0], [5, 3, 4], [9, 8]]
        self.it: Iterator[list[int]] = iter([])

    def __iter__(self) -> ItsOwnIterator:
        self.it = iter(self.batches)
        return self

    def __next__(self) -> list[int]:
        return next(self.it)

    def __len__(self) -> int:
        return len(self.batches)


@pytest.mark.parametrize("k", [0, 2, "end"])
def test_batch_sampler_that_is_its_own_iterator(k: int | str) -> None:
    _check_resume(lambda: pinpool.DataLoader(Indexed(), batch_sampler=ItsOwnIterator()), k)


def test_no_batching() -> None:
    _check_resume(lambda: pinpool.DataLoader(Indexed(), batch_size=None, shuffle=True), 9)


@pytest.mark.parametrize("k", [0, 2, 5, 6, "end"])
def test_iterable_dataset_with_state(k: int | str) -> None:
    _check_resume(lambda: pinpool.DataLoader(Counting(), batch_size=4), k)


@pytest.mark.parametrize("workers", [2, 3])
def test_iterable_dataset_with_workers(workers: int) -> None:
    # 23 items over 2 workers: 6 + 6 batches... over 3: the shards end at different batches.
    def make() -> pinpool.DataLoader:
        return pinpool.DataLoader(Sharded(), batch_size=3, num_workers=workers)

    for k in (0, 1, 4, 7, "end"):
        _check_resume(make, k)


def test_iterable_dataset_with_persistent_workers() -> None:
    def make() -> pinpool.DataLoader:
        return pinpool.DataLoader(
            Sharded(), batch_size=4, num_workers=2, persistent_workers=True, worker_init_fn=_init
        )

    _check_resume(make, 3, before=1)
    # A state loaded into a loader whose persistent workers have started: new ones load it.
    torch.manual_seed(0)
    loader = make()
    expected = [_own(b) for b in loader]
    it = iter(loader)
    got = [_own(next(it)) for _ in range(5)]
    state = loader.state_dict()
    again = make()
    list(again)  # its workers have started and run an epoch
    again.load_state_dict(state)
    got += [_own(b) for b in again]
    _same(got, expected)


def _init(worker_id: int) -> None:
    """A worker_init_fn of the caller's: it still runs in a resumed epoch's workers."""
    info = torch.utils.data.get_worker_info()
    assert info is not None and info.id == worker_id
    info.dataset.size = N + 1  # (every copy: uninterrupted and resumed alike)


@pytest.mark.parametrize("zero_copy", [False, True])
def test_workers(zero_copy: bool) -> None:
    def make() -> pinpool.DataLoader:
        return pinpool.DataLoader(
            Indexed(),
            batch_size=4,
            shuffle=True,
            num_workers=2,
            zero_copy=zero_copy,
            slot_bytes=1 << 16,
            num_slots=8,
        )

    fresh = _check_resume(make, 3)
    if zero_copy:
        assert fresh.stats()["zero_copy_batches"] > 0
    _check_resume(make, 6)  # every batch of the epoch: the resumed epoch is empty
    _check_resume(make, "end")


@pytest.mark.parametrize(("k", "before"), [(3, 0), (2, 1), ("end", 0)])
def test_persistent_workers(k: int | str, before: int) -> None:
    def make() -> pinpool.DataLoader:
        return pinpool.DataLoader(
            Indexed(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True
        )

    _check_resume(make, k, before)


def test_state_between_epochs_and_before_iterating() -> None:
    loader = pinpool.DataLoader(Indexed(), batch_size=4, shuffle=True)
    state = loader.state_dict()
    assert state["version"] == 2 and state["epoch"] is None
    expected = [_own(b) for b in loader]
    fresh = pinpool.DataLoader(Indexed(), batch_size=4, shuffle=True)
    torch.rand(3)
    fresh.load_state_dict(state)
    assert fresh.state_dict()["epoch"] is None  # a loaded state, not yet used, is the state
    _same([_own(b) for b in fresh], expected)


def test_state_of_a_resumed_epoch_resumes_too() -> None:
    def make() -> pinpool.DataLoader:
        return pinpool.DataLoader(Indexed(), batch_size=4, shuffle=True)

    torch.manual_seed(0)
    expected = [_own(b) for b in make()]
    torch.manual_seed(0)
    loader = make()
    it = iter(loader)
    got = [_own(next(it))]
    second = make()
    second.load_state_dict(_through_bytes(loader.state_dict()))
    it = iter(second)
    got += [_own(next(it)) for _ in range(2)]
    third = make()
    third.load_state_dict(_through_bytes(second.state_dict()))
    got += [_own(b) for b in third]
    _same(got, expected)


def test_unsupported_raise() -> None:
    stateless = pinpool.DataLoader(Stateless(), batch_size=4)
    with pytest.raises(NotImplementedError, match="without state_dict"):
        stateless.state_dict()
    with pytest.raises(NotImplementedError, match="without state_dict"):
        stateless.load_state_dict({})
    # Frameworks that checkpoint every loader with these methods (Lightning) skip this one.
    assert not hasattr(stateless, "state_dict") and not hasattr(stateless, "load_state_dict")
    with pytest.raises(ValueError, match="num_workers=2, this loader has 3"):
        workers = pinpool.DataLoader(Sharded(), batch_size=4, num_workers=2).state_dict()
        pinpool.DataLoader(Sharded(), batch_size=4, num_workers=3).load_state_dict(workers)
    state = pinpool.DataLoader(Indexed()).state_dict()
    with pytest.raises(ValueError, match="version"):
        pinpool.DataLoader(Indexed()).load_state_dict({"version": 99})
    with pytest.raises(ValueError, match="iterable"):
        pinpool.DataLoader(Counting()).load_state_dict(state)


def test_readme_snippet(tmp_path: Any) -> None:
    dataset, path = Indexed(), tmp_path / "ckpt.pt"
    torch.manual_seed(0)
    whole = pinpool.DataLoader(dataset, batch_size=4, num_workers=2, shuffle=True)
    expected = [_own(b) for b in whole]
    torch.manual_seed(0)
    got = []
    # As in docs/guide.md, "Resuming mid-epoch" (there with another batch size):
    loader = pinpool.DataLoader(dataset, batch_size=4, num_workers=2, shuffle=True)
    for step, batch in enumerate(loader):
        got.append(_own(batch))
        if step == 2:
            torch.save({"loader": loader.state_dict()}, path)
            break

    del loader
    torch.rand(5)
    loader = pinpool.DataLoader(dataset, batch_size=4, num_workers=2, shuffle=True)
    loader.load_state_dict(torch.load(path)["loader"])
    for batch in loader:
        got.append(_own(batch))
    _same(got, expected)


# --------------------------------------------------------------------------- samples, not batches


def _ids(batch: Any) -> list[int]:
    """The sample indices of a map-style batch (or of one unbatched sample)."""
    i = batch["i"]
    return i.tolist() if isinstance(i, torch.Tensor) else [int(i)]


def _resumed_with(
    make: Callable[..., pinpool.DataLoader], taken_with: Any, resumed_with: Any, k: int
) -> tuple[list[int], list[list[int]], list[int], list[int]]:
    """Samples of an uninterrupted epoch (and the next) of ``make(taken_with)``; the batches
    of a run stopped after ``k`` of them and resumed in ``make(resumed_with)``; and the two
    next epochs' samples. (``make`` takes the batch size.)"""
    torch.manual_seed(0)
    whole = make(taken_with)
    order = [i for b in whole for i in _ids(b)]
    next_order = [i for b in whole for i in _ids(b)]
    del whole
    torch.manual_seed(0)
    first = make(taken_with)
    it = iter(first)
    batches = [_ids(next(it)) for _ in range(k)]
    state = _through_bytes(first.state_dict())
    assert state["epoch"]["samples"] == sum(map(len, batches))
    del it, first
    gc.collect()
    torch.manual_seed(77)  # a fresh process
    resumed = make(resumed_with)
    resumed.load_state_dict(state)
    batches += [_ids(b) for b in resumed]
    resumed_next = [i for b in resumed for i in _ids(b)]
    return order, batches, next_order, resumed_next


@pytest.mark.parametrize(
    ("kind", "workers", "before", "after"),
    [
        ("sequential", 0, 4, 8),
        ("shuffle", 0, 4, 3),
        ("generator", 0, 8, 4),
        ("drop_last", 0, 3, 5),
        ("shuffle", 2, 4, 8),
        ("generator", 2, 4, 3),
        ("drop_last", 2, 4, 3),
        ("zero_copy", 2, 3, 5),
        ("persistent", 2, 8, 4),
    ],
)
def test_another_batch_size_resumes_at_the_next_unseen_sample(
    kind: str, workers: int, before: int, after: int
) -> None:
    def make(batch_size: int, drop_last: bool = kind == "drop_last") -> pinpool.DataLoader:
        return pinpool.DataLoader(
            Indexed(30),
            batch_size=batch_size,
            shuffle=kind != "sequential",
            generator=torch.Generator().manual_seed(3) if kind == "generator" else None,
            drop_last=drop_last,
            num_workers=workers,
            zero_copy=kind == "zero_copy",
            persistent_workers=kind == "persistent",
        )

    # The sampler's whole order in the run's first two epochs (drop_last cuts none of it).
    torch.manual_seed(0)
    reference = make(before, drop_last=False)
    order = [i for b in reference for i in _ids(b)]
    next_order = [i for b in reference for i in _ids(b)]
    del reference

    k = 4 if before != 8 else 2  # 16 samples (12 with batches of 3)
    _, batches, _, resumed_next = _resumed_with(make, before, after, k)
    seen = k * before
    assert [i for b in batches[:k] for i in b] == order[:seen]
    # The rest of the epoch: the same order from the next unseen sample on, in batches of
    # `after` (the last one partial, or dropped with drop_last).
    rest = [i for b in batches[k:] for i in b]
    kept = (30 - seen) // after * after if kind == "drop_last" else 30 - seen
    assert rest == order[seen : seen + kept], (batches, order)
    assert all(len(b) == after for b in batches[k : k + kept // after])
    # The next epoch is the one the uninterrupted run drew, cut in the new batch size.
    expected_next = next_order[: 30 // after * after] if kind == "drop_last" else next_order
    assert resumed_next == expected_next


def test_four_batches_of_four_resume_a_loader_of_eights_at_sample_16() -> None:
    # The case the issue reports: nothing skipped, nothing seen twice.
    def make(batch_size: int) -> pinpool.DataLoader:
        return pinpool.DataLoader(Indexed(40), batch_size=batch_size, num_workers=2)

    _, batches, _, _ = _resumed_with(make, 4, 8, 4)
    assert batches[4] == list(range(16, 24)), batches
    assert [len(b) for b in batches] == [4, 4, 4, 4, 8, 8, 8]


def test_batched_and_unbatched_loaders_resume_each_other() -> None:
    # batch_size=None hands out one sample at a time, in the same sampler's order.
    def make(batch_size: int | None) -> pinpool.DataLoader:
        return pinpool.DataLoader(Indexed(), batch_size=batch_size, shuffle=True)

    order, batches, _, _ = _resumed_with(make, None, 4, 6)
    assert [i for b in batches for i in b] == order
    order, batches, _, _ = _resumed_with(make, 4, None, 2)
    assert [i for b in batches for i in b] == order and len(batches) == 2 + N - 8


class Chunks:
    """A batch sampler of the caller's: fixed batches of the given sizes."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __iter__(self) -> Iterator[list[int]]:
        start = 0
        for size in self.sizes:
            yield list(range(start, start + size))
            start += size

    def __len__(self) -> int:
        return len(self.sizes)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_sampler_of_your_own_drops_whole_batches_that_must_hold_the_samples(
    workers: int,
) -> None:
    def make(sizes: list[int]) -> pinpool.DataLoader:
        return pinpool.DataLoader(Indexed(), batch_sampler=Chunks(sizes), num_workers=workers)

    sizes = [3, 5, 2, 6, 7]
    _, batches, _, _ = _resumed_with(make, sizes, sizes, 2)
    assert [len(b) for b in batches] == sizes and [i for b in batches for i in b] == list(range(N))
    # Other batches holding the same samples: resumed at the next unseen one all the same.
    _, batches, _, _ = _resumed_with(make, sizes, [4, 4, 9, 3, 3], 2)
    assert batches[2][0] == 8 and [i for b in batches for i in b] == list(range(N))
    # Other batches that split the samples elsewhere: the next unseen sample is inside a
    # batch, so the resumed epoch is refused as it starts, before anything is loaded.
    first = make(sizes)
    it = iter(first)
    next(it), next(it)
    state = _through_bytes(first.state_dict())
    del it, first
    other = make([4, 5, 1, 6, 7])
    other.load_state_dict(state)
    with pytest.raises(
        InvalidArgument, match=r"made 2 batches of 9 samples where the state's 2 had 8"
    ):
        list(other)
    # The loader is usable afterwards: its next epoch is a whole one.
    assert [len(b["i"]) for b in other] == [4, 5, 1, 6, 7]


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterable_dataset_resumes_at_its_own_position_in_another_batch_size(
    workers: int,
) -> None:
    # The dataset (each worker's copy) says where it is: another batch size goes on from
    # there, every item once.
    dataset = Counting if workers == 0 else Sharded
    first = pinpool.DataLoader(dataset(), batch_size=4, num_workers=workers)
    it = iter(first)
    seen = [x for _ in range(3) for x in _values(next(it))]
    state = _through_bytes(first.state_dict())
    assert state["epoch"]["samples"] is None  # (the dataset's position is its own)
    del it, first
    gc.collect()
    resumed = pinpool.DataLoader(dataset(), batch_size=3, num_workers=workers)
    resumed.load_state_dict(state)
    rest = [_values(b) for b in resumed]
    assert all(len(b) <= 3 for b in rest)
    assert sorted(seen + [x for b in rest for x in b]) == list(range(N))


def _values(batch: Any) -> list[int]:
    rows = batch["x"] if isinstance(batch, dict) else batch
    return [int(v) for v in rows[:, 0]]


class FailsAt(Indexed):
    """Raises for one sample: the batch holding it fails, and torch goes on with the next."""

    def __getitem__(self, i: int) -> Any:
        if i == 9:
            raise KeyError("sample 9 is broken")
        return super().__getitem__(i)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_that_raised_is_passed_not_yielded_again(workers: int) -> None:
    # torch does not yield a batch whose loading raised: the resumed epoch does not either.
    loader = pinpool.DataLoader(FailsAt(40), batch_size=4, num_workers=workers)
    it = iter(loader)
    got = [_ids(next(it)) for _ in range(2)]
    with pytest.raises(KeyError, match="sample 9 is broken"):
        next(it)
    got.append(_ids(next(it)))
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [12, 13, 14, 15]]
    state = _through_bytes(loader.state_dict())
    assert (state["epoch"]["samples"], state["epoch"]["yielded"]) == (16, 4)
    del it, loader
    gc.collect()
    resumed = pinpool.DataLoader(FailsAt(40), batch_size=8, num_workers=workers)
    resumed.load_state_dict(state)
    assert [_ids(b) for b in resumed] == [
        list(range(16, 24)),
        list(range(24, 32)),
        list(range(32, 40)),
    ]


# --------------------------------------------------------------------------- orders that differ


class EveryOther(torch.utils.data.Sampler[int]):
    """A sampler of the caller's: even indices, then odd ones."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter([*range(0, self.n, 2), *range(1, self.n, 2)])

    def __len__(self) -> int:
        return self.n


def _distributed(replicas: int = 2, rank: int = 0, seed: int = 0) -> Any:
    return torch.utils.data.DistributedSampler(
        Indexed(), num_replicas=replicas, rank=rank, shuffle=True, seed=seed
    )


#: (what the state is taken with, what the loader is made with, what the error names)
MISMATCHES = [
    (
        {"shuffle": True},
        {"shuffle": False},
        r"the state's order came from the sampler torch\.utils\.data\.sampler\.RandomSampler "
        r"\(shuffle=True\), this loader's from the sampler "
        r"torch\.utils\.data\.sampler\.SequentialSampler \(shuffle=False\)",
    ),
    ({}, {"shuffle": True}, r"SequentialSampler \(shuffle=False\), this loader's from"),
    ({"dataset": Indexed(30)}, {}, r"a dataset of 30 samples, this loader's has 23"),
    ({}, {"sampler": EveryOther()}, r"this loader's from the sampler test_resume\.EveryOther"),
    (
        {"sampler": torch.utils.data.RandomSampler(Indexed(), replacement=True)},
        {"shuffle": True},
        r"the state's sampler's replacement was True, this loader's is False",
    ),
    (
        {"sampler": torch.utils.data.RandomSampler(Indexed(), num_samples=12)},
        {"shuffle": True},
        r"the state's sampler's length was 12, this loader's is 23",
    ),
    ({"sampler": _distributed(2)}, {"sampler": _distributed(4)}, r"length was 12, this .* 6"),
    ({"sampler": _distributed(rank=0)}, {"sampler": _distributed(rank=1)}, r"rank was 0, .* 1"),
    ({"sampler": _distributed(seed=0)}, {"sampler": _distributed(seed=1)}, r"seed was 0, .* 1"),
    (
        {"batch_sampler": Chunks([4] * 5 + [3]), "batch_size": 1},
        {},
        r"from the batch sampler test_resume\.Chunks, this loader's from the sampler",
    ),
    (
        {"generator": torch.Generator().manual_seed(1)},
        {},
        r"\['generators'\] has \['generator'\], this loader's are \[\] \(a generator=",
    ),
]


def _loader(kwargs: dict[str, Any]) -> pinpool.DataLoader:
    kw = dict(kwargs)
    dataset = kw.pop("dataset", Indexed())
    if "batch_sampler" in kw:
        kw.pop("batch_size")
        return pinpool.DataLoader(dataset, **kw)
    kw.setdefault("batch_size", 4)
    return pinpool.DataLoader(dataset, **kw)


@pytest.mark.parametrize(("taken", "loading", "match"), MISMATCHES)
def test_a_state_whose_order_cannot_be_reproduced_is_refused_at_load(
    taken: dict[str, Any], loading: dict[str, Any], match: str
) -> None:
    state = _mid_epoch_state(lambda: _loader(taken))
    _refused_and_unchanged(lambda: _loader(loading), state, match)
    # What the error says the state needs is enough: the loader it was taken from resumes it.
    _loader(taken).load_state_dict(state)


def test_a_generators_seed_does_not_matter_its_state_is_in_the_checkpoint() -> None:
    def make(seed: int) -> pinpool.DataLoader:
        return pinpool.DataLoader(
            Indexed(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed)
        )

    order = [i for b in make(5) for i in _ids(b)]
    first = make(5)
    it = iter(first)
    got = [i for _ in range(2) for i in _ids(next(it))]
    other_seed = make(6)
    other_seed.load_state_dict(_through_bytes(first.state_dict()))
    assert got + [i for b in other_seed for i in _ids(b)] == order


def test_a_state_between_epochs_loads_into_another_order() -> None:
    # Nothing to skip: the next epoch is whole whatever its order (a dataset that grew
    # between epochs, say); only the random states are put back.
    loader = pinpool.DataLoader(Indexed(), batch_size=4, shuffle=True)
    list(loader)
    state = loader.state_dict()
    assert state["epoch"] is None
    grown = pinpool.DataLoader(Indexed(30), batch_size=4)
    grown.load_state_dict(state)
    assert sorted(i for b in grown for i in _ids(b)) == list(range(30))


def test_a_distributed_samplers_epoch_is_checked_as_the_resumed_epoch_starts() -> None:
    def make() -> pinpool.DataLoader:
        return pinpool.DataLoader(Indexed(), batch_size=2, sampler=_distributed())

    whole = make()
    whole.sampler.set_epoch(3)  # type: ignore[attr-defined]
    order = [i for b in whole for i in _ids(b)]
    first = make()
    first.sampler.set_epoch(3)  # type: ignore[attr-defined]
    it = iter(first)
    got = [i for _ in range(2) for i in _ids(next(it))]
    state = _through_bytes(first.state_dict())
    resumed = make()
    resumed.load_state_dict(state)  # (set_epoch may come after: it is checked at iter())
    with pytest.raises(InvalidArgument, match=r"in epoch 3 of its sampler .* at epoch 0; call"):
        iter(resumed)
    resumed.sampler.set_epoch(3)  # type: ignore[attr-defined]
    assert got + [i for b in resumed for i in _ids(b)] == order


def test_in_order_false_with_workers_cannot_resume() -> None:
    # Batches come as they arrive: a count of them does not say which were yielded.
    loader = pinpool.DataLoader(Indexed(), batch_size=4, num_workers=2, in_order=False)
    with pytest.raises(NotImplementedError, match="in_order=False"):
        loader.state_dict()
    assert not hasattr(loader, "load_state_dict")
    assert hasattr(pinpool.DataLoader(Indexed(), batch_size=4, in_order=False), "state_dict")


def test_each_random_state_is_stored_once() -> None:
    for loader in (
        pinpool.DataLoader(Indexed(), batch_size=4, shuffle=True),
        pinpool.DataLoader(
            Indexed(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2)
        ),
        pinpool.DataLoader(Indexed(), batch_size=4),
    ):
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        tensors, _ = tree_flatten(state)
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        distinct = {bytes(t.numpy()) for t in tensors}
        assert len({id(t) for t in tensors}) == len(distinct), "an RNG state stored twice"
        assert 1 <= len(distinct) <= 4
        buf = io.BytesIO()
        torch.save(state, buf)
        one = torch.get_rng_state().numel()
        assert len(buf.getvalue()) < len(distinct) * one + 4096, len(buf.getvalue())
        again = _through_bytes(state)  # (loaded, the tensors are still shared)
        assert len({id(t) for t in tree_flatten(again)[0] if isinstance(t, torch.Tensor)}) == len(
            distinct
        )


def test_a_version_1_state_still_resumes_its_own_batches_with_a_warning() -> None:
    def make() -> pinpool.DataLoader:
        return pinpool.DataLoader(Indexed(), batch_size=4, shuffle=True)

    torch.manual_seed(0)
    order = [i for b in make() for i in _ids(b)]
    torch.manual_seed(0)
    first = make()
    it = iter(first)
    got = [i for _ in range(2) for i in _ids(next(it))]
    state = _through_bytes(first.state_dict())
    # What pinpool wrote before it counted samples: no samples, no order.
    del state["order"], state["epoch"]["samples"]
    state["version"] = 1
    resumed = make()
    with pytest.warns(UserWarning, match="version 1 counts batches, not samples"):
        resumed.load_state_dict(state)
    assert got + [i for b in resumed for i in _ids(b)] == order


# --------------------------------------------------------------------------- malformed states


def _mid_epoch_state(make: Callable[[], pinpool.DataLoader], k: int = 2) -> dict[str, Any]:
    loader = make()
    it = iter(loader)
    for _ in range(k):
        next(it)
    state = _through_bytes(loader.state_dict())
    del it, loader
    gc.collect()
    return state


def _shuffled() -> pinpool.DataLoader:
    return pinpool.DataLoader(
        Indexed(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5)
    )


def _sharded() -> pinpool.DataLoader:
    return pinpool.DataLoader(Sharded(), batch_size=3, num_workers=2)


def _set(state: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """A deep copy of ``state`` with ``path`` set to ``value`` (or deleted: ``_DELETE``)."""
    out = copy.deepcopy(state)
    where = out
    for key in path[:-1]:
        where = where[key]
    if value is _DELETE:
        del where[path[-1]]
    else:
        where[path[-1]] = value
    return out


_DELETE = object()
GARBAGE_RNG = torch.arange(100, dtype=torch.uint8)

MAP_STYLE_DAMAGE = [
    (("rng",), _DELETE, r"\['rng'\] is missing"),
    (("rng",), GARBAGE_RNG, r"\['rng'\] is not a state"),
    (("rng",), "x", r"\['rng'\] must be a generator state"),
    (("rng",), torch.zeros(5056, dtype=torch.float32), r"\['rng'\] is not a state"),
    (("generators",), None, r"\['generators'\] must be dict"),
    (("generators", "generator"), GARBAGE_RNG, r"\['generators'\]\['generator'\] is not"),
    (("generators", "bogus"), GARBAGE_RNG, r"\['generators'\]\['bogus'\] is not one of"),
    (("generators",), {}, r"\['generators'\] has \[\], this loader's are \['generator'\]"),
    (("epoch",), "x", r"\['epoch'\] must be dict or None, not str"),
    (("epoch", "yielded"), 2.5, r"\['epoch'\]\['yielded'\] must be int, not float"),
    (("epoch", "yielded"), True, r"\['epoch'\]\['yielded'\] must be int, not bool"),
    (("epoch", "yielded"), -1, r"\['epoch'\]\['yielded'\] must not be negative"),
    (("epoch", "yielded"), _DELETE, r"\['epoch'\]\['yielded'\] is missing"),
    (("epoch", "at_iter"), None, r"\['epoch'\]\['at_iter'\] must be dict"),
    (("epoch", "at_pull", "rng"), GARBAGE_RNG, r"\['epoch'\]\['at_pull'\]\['rng'\] is not"),
    (("epoch", "at_iter", "generators"), [], r"\['epoch'\]\['at_iter'\]\['generators'\]"),
    (("iterator_kept",), "yes", r"\['iterator_kept'\] must be bool"),
    (("iterable",), 0, r"\['iterable'\] must be bool, not int"),
    (("num_workers",), None, r"\['num_workers'\] must be int"),
]

WORKER_DAMAGE = [
    (("workers",), None, r"\['workers'\] must be dict, not NoneType"),
    (("workers", "states"), "abc", r"\['workers'\]\['states'\] must be dict"),
    (("workers", "states", 0), "x", r"\['workers'\]\['states'\]\[0\] must be the worker's"),
    (("workers", "states", 1), ["done", 1], r"\['workers'\]\['states'\]\[1\] must be"),
    (("workers", "states", 7), {"done": 1}, r"\['workers'\]\['states'\]\[7\] is not a worker"),
    (("workers", "states", "0"), {"done": 1}, r"\['workers'\]\['states'\]\['0'\] is not a"),
    (("workers", "next"), 2, r"\['workers'\]\['next'\] is not a worker"),
    (("workers", "next"), "1", r"\['workers'\]\['next'\] must be int"),
    (("epoch", "yielded"), 2.5, r"\['epoch'\]\['yielded'\] must be int"),
]


@functools.cache
def _one_epoch(make: Callable[[], pinpool.DataLoader]) -> list[Any]:
    """An ordinary epoch of ``make()``'s loader (global seed 0), made once per test module."""
    torch.manual_seed(0)
    return [_own(b) for b in make()]


@functools.cache
def _state_of(make: Callable[[], pinpool.DataLoader], k: int = 2) -> dict[str, Any]:
    """:func:`_mid_epoch_state`, taken once per test module (a test damages a deep copy)."""
    return _mid_epoch_state(make, k)


def _refused_and_unchanged(
    make: Callable[[], pinpool.DataLoader], bad: dict[str, Any], match: str
) -> None:
    """Loading ``bad`` raises one clear error at once, and the loader is left as it was: its
    next epoch is a whole, ordinary one, and nothing half-made raises from a finalizer."""
    expected = _one_epoch(make)
    loader = make()
    unraisable: list[Any] = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        with pytest.raises(InvalidArgument, match=match) as info:
            loader.load_state_dict(bad)
        assert isinstance(info.value, ValueError)
        del info
        torch.manual_seed(0)
        _same([_own(b) for b in loader], expected)
        del loader
        gc.collect()
    finally:
        sys.unraisablehook = old_hook
    assert unraisable == [], [str(u.exc_value) for u in unraisable]


@pytest.mark.parametrize(("path", "value", "match"), MAP_STYLE_DAMAGE)
def test_a_malformed_state_is_refused_at_load(path: Any, value: Any, match: str) -> None:
    state = _state_of(_shuffled)
    _refused_and_unchanged(_shuffled, _set(state, path, value), match)


@pytest.mark.parametrize(("path", "value", "match"), WORKER_DAMAGE)
def test_a_malformed_worker_state_is_refused_at_load(path: Any, value: Any, match: str) -> None:
    state = _state_of(_sharded, k=3)
    assert set(state["workers"]["states"]) == {0, 1}
    _refused_and_unchanged(_sharded, _set(state, path, value), match)


def test_an_iterable_dataset_state_must_be_the_datasets_dict() -> None:
    def make() -> pinpool.DataLoader:
        return pinpool.DataLoader(Counting(), batch_size=4)

    state = _mid_epoch_state(make)
    _refused_and_unchanged(make, _set(state, ("dataset",), "pos"), r"\['dataset'\] must be dict")
    _refused_and_unchanged(make, _set(state, ("dataset",), _DELETE), r"\['dataset'\] is missing")
    # The undamaged state still loads and resumes.
    loader = make()
    loader.load_state_dict(state)
    assert len(list(loader)) == 4  # 23 items in batches of 4, 2 of them already yielded
