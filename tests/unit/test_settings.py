"""No setting given to ``pinpool.DataLoader`` (or ``pinpool.pinned``) silently does nothing:
one that cannot apply to the loader warns once when the loader is made, saying why; one that
contradicts another raises. Settings that apply, and defaults, say nothing."""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from loader_datasets import Indexed, ShardedRange

import pinpool
from pinpool import InvalidArgument
from pinpool._main.settings import arguments


def _warnings_of(make: Any) -> list[str]:
    """What making a loader warns about (pinpool's warnings only), the loader dropped."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = make()
    del loader
    return [str(w.message) for w in caught if str(w.message).startswith("pinpool.")]


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"zero_copy": True}, "zero_copy=True does nothing with num_workers=0"),
        (
            {"zero_copy": True, "num_workers": 2, "batch_size": None},
            "zero_copy=True does nothing with batch_size=None",
        ),
        ({"stream_samples": True}, "stream_samples=True does nothing with num_workers=0"),
        (
            {"stream_samples": True, "num_workers": 2, "collate_fn": list},
            "stream_samples=True does nothing with a collate_fn of your own",
        ),
        ({"worker_copy_threads": 2}, "worker_copy_threads=2 does nothing with num_workers=0"),
    ],
)
def test_a_setting_that_cannot_apply_warns_saying_why(kwargs: dict[str, Any], why: str) -> None:
    kwargs.setdefault("batch_size", 2)
    said = _warnings_of(lambda: pinpool.DataLoader(Indexed(4), **kwargs))
    assert len(said) == 1 and said[0].startswith(f"pinpool.DataLoader: {why}"), said


def test_zero_copy_with_an_iterable_dataset_warns_and_still_loads_every_batch() -> None:
    with pytest.warns(UserWarning, match="zero_copy=True does nothing with an IterableDataset"):
        loader = pinpool.DataLoader(ShardedRange(8), batch_size=2, num_workers=2, zero_copy=True)
    assert sorted(int(i) for batch in loader for i in batch["idx"]) == list(range(8))
    # Nothing was zero-copy, and it was never going to be (not a fallback, so not counted).
    stats = loader.stats()
    assert (stats["zero_copy_batches"], stats["zero_copy_fallbacks"]) == (0, 0)


def test_the_warning_comes_once_from_the_callers_line() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: once per place in the code
        for _ in range(3):
            pinpool.DataLoader(Indexed(4), batch_size=2, zero_copy=True)
    ours = [w for w in caught if "zero_copy" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert ours[0].filename == __file__


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"num_workers": 2, "zero_copy": True},
        {"num_workers": 2, "stream_samples": True},
        {"num_workers": 2, "worker_copy_threads": 2},
        {"stream_samples": False, "zero_copy": False},
        {"pin_memory": True},
        {"pin_memory": False},  # (no accelerator here: batches are not pinned for one)
    ],
)
def test_settings_that_apply_and_defaults_say_nothing(kwargs: dict[str, Any]) -> None:
    assert _warnings_of(lambda: pinpool.DataLoader(Indexed(4), batch_size=2, **kwargs)) == []


def test_zero_copy_with_a_pool_workers_cannot_map_warns() -> None:
    # (A cuda-hostalloc pool needs a GPU: the rule is checked on a stand-in.)
    hostalloc = types.SimpleNamespace(backend="cuda-hostalloc")
    memfd = types.SimpleNamespace(backend="cuda-register")
    common: dict[str, Any] = {
        "dataset": Indexed(4),
        "num_workers": 2,
        "auto_collation": True,
        "collate_fn": None,
        "zero_copy": True,
        "stream_samples": None,
        "worker_copy_threads": None,
        "pin_memory": True,
    }
    (why,) = arguments.ignored(pool=hostalloc, **common)
    assert "backend='cuda-hostalloc' (workers cannot map it)" in why
    assert arguments.ignored(pool=memfd, **common) == []
    assert arguments.ignored(pool=None, **common) == []


@pytest.mark.parametrize(
    "given",
    [
        {"arena_bytes": 1 << 20},
        {"max_batch_bytes": 1 << 20},
        {"slot_bytes": 1 << 20, "num_slots": 2},
        {"num_slots": 2},
        {"copy_threads": 2},
    ],
)
def test_sizes_given_with_a_pool_of_your_own_are_refused(given: dict[str, Any]) -> None:
    with pinpool.PinPool(1 << 20, 2, device="cpu") as pool:
        names = ", ".join(f"{name}=" for name in given)
        with pytest.raises(InvalidArgument, match=f"^{names} cannot apply with pool="):
            pinpool.DataLoader(Indexed(4), batch_size=2, pool=pool, **given)
        inner = torch.utils.data.DataLoader(Indexed(4), batch_size=2)
        if "arena_bytes" not in given and "max_batch_bytes" not in given:  # (not pinned()'s)
            with pytest.raises(InvalidArgument, match="cannot apply with pool="):
                pinpool.pinned(inner, pool=pool, **given)
        # The pool alone is fine, and is the one used.
        loader = pinpool.DataLoader(Indexed(4), batch_size=2, pool=pool)
        assert loader.pool is pool and len(list(loader)) == 2


def _rebuilt(loader: pinpool.DataLoader[Any]) -> Iterator[str]:
    """What rebuilding ``loader`` from its attributes (as Lightning does) warns about."""
    names = [*pinpool.loader.PINPOOL_ARGUMENTS, "batch_size", "num_workers", "pin_memory"]
    kwargs = {name: getattr(loader, name) for name in names}
    kwargs["pool"] = loader.__dict__["pool"]
    yield from _warnings_of(lambda: pinpool.DataLoader(loader.dataset, **kwargs))


def test_a_loader_rebuilt_from_its_attributes_warns_only_if_the_first_did() -> None:
    quiet = pinpool.DataLoader(Indexed(4), batch_size=2)
    assert list(_rebuilt(quiet)) == []
    with pytest.warns(UserWarning, match="zero_copy"):
        loud = pinpool.DataLoader(Indexed(4), batch_size=2, zero_copy=True)
    assert [w.split(":")[1].strip()[:9] for w in _rebuilt(loud)] == ["zero_copy"]
