"""Every setting means what it says and is checked when the loader or pool is made.

- Sizes are exact: ``max_batch_bytes`` to the byte (one byte over is over, whatever the page),
  ``arena_bytes`` to the page; a size over the memory this process may take is
  ``NotEnoughMemory`` naming the setting, at construction, not ``BatchTooLarge`` at the first
  batch.
- A setting of the wrong type or out of range raises ``InvalidArgument`` naming it and what it
  wants, at construction (a fuzz over every argument of ``pinpool.DataLoader``, ``PinPool`` and
  ``Slot.view``); a string is not taken for a boolean.
- Messages say what is true: an exhausted pool counts what holds it.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_datasets import Indexed, in_pool

import pinpool
from pinpool import BatchTooLarge, InvalidArgument, NotEnoughMemory
from pinpool._native import available_memory

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 1 << 20


class Bytes(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Item ``i`` is ``sizes[i]`` uint8 bytes: with batch size 1 a batch is exactly that."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.sizes[i],), i % 251, dtype=torch.uint8)


def _batches(loader: Any) -> list[Any]:
    return list(loader)


@pytest.mark.parametrize("limit", [1, PAGE - 1, 1_000_000])
def test_max_batch_bytes_is_exact_to_the_byte(limit: int) -> None:
    ok = pinpool.DataLoader(Bytes([limit]), batch_size=1, max_batch_bytes=limit)
    (batch,) = _batches(ok)
    assert batch.nbytes == limit and in_pool(ok.pool, batch)
    over = pinpool.DataLoader(
        Bytes([limit + 1]), batch_size=1, max_batch_bytes=limit, oversize="error"
    )
    with pytest.raises(BatchTooLarge, match=f"needs {limit + 1} bytes"):
        _batches(over)
    # By default (and with oversize="copy") it gets memory of its own, and is counted.
    for oversize in ("pin", "copy"):
        outside = pinpool.DataLoader(
            Bytes([limit + 1]), batch_size=1, max_batch_bytes=limit, oversize=oversize
        )
        (batch,) = _batches(outside)
        assert batch.nbytes == limit + 1 and not in_pool(outside.pool, batch)
        assert outside.stats()["oversize_batches"] == 1
        assert outside.stats()["overflow_batches"] == 0
        del batch


@pytest.mark.parametrize("workers", [1])
def test_max_batch_bytes_is_exact_in_zero_copy_too(workers: int) -> None:
    limit = 3 * PAGE + 1
    loader = pinpool.DataLoader(
        Bytes([limit, limit + 1]),
        batch_size=1,
        num_workers=workers,
        zero_copy=True,
        max_batch_bytes=limit,
        oversize="copy",
    )
    first, second = _batches(loader)
    assert in_pool(loader.pool, first) and not in_pool(loader.pool, second)
    assert loader.stats()["oversize_batches"] == 1
    del first, second


@pytest.mark.parametrize(
    ("arena", "largest"),
    [(64 * MiB + 4096, 64 * MiB), (5_000_000, None), (96 * MiB, None), (3 * MiB, MiB)],
)
def test_arena_bytes_is_made_as_given_to_the_page(arena: int, largest: int | None) -> None:
    loader = pinpool.DataLoader(
        Bytes([16]), batch_size=1, arena_bytes=arena, max_batch_bytes=largest
    )
    assert loader.pool is not None
    made = loader.pool.arena_bytes
    assert arena <= made < arena + PAGE, (arena, made)
    assert loader.stats()["arena_bytes"] == made


def test_a_pool_of_slot_bytes_bounds_each_batch_by_its_slot_bytes() -> None:
    pool = pinpool.PinPool(MiB, 4, device="cpu")
    loader = pinpool.DataLoader(Bytes([MiB, MiB + 1]), batch_size=1, pool=pool, oversize="error")
    it = iter(loader)
    assert in_pool(pool, next(it))
    with pytest.raises(BatchTooLarge, match=f"needs {MiB + 1} bytes"):
        next(it)


def test_sizes_over_the_memory_available_are_refused_when_the_loader_is_made() -> None:
    available = available_memory()
    assert available is not None
    big = int(available * 0.6) // PAGE * PAGE
    for kwargs, named in [
        ({"max_batch_bytes": big // 2 + PAGE}, "max_batch_bytes="),
        ({"arena_bytes": big}, "arena_bytes="),
        ({"slot_bytes": big // 2 + PAGE, "num_slots": 2}, "slot_bytes="),
    ]:
        with pytest.raises(NotEnoughMemory, match=named) as info:
            pinpool.DataLoader(Indexed(4), batch_size=2, num_workers=2, **kwargs)
        assert isinstance(info.value, MemoryError)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"zero_copy": "false"}, "zero_copy"),
        ({"zero_copy": 1}, "zero_copy"),
        ({"keep_worker_memory": "no"}, "keep_worker_memory"),
        ({"stream_samples": "yes"}, "stream_samples"),
        ({"pool": "x"}, "pool"),
        ({"device": "gpu"}, "device"),
        ({"device": 3.5}, "device"),
        ({"arena_bytes": "x"}, "arena_bytes"),
        ({"arena_bytes": -1}, "arena_bytes"),
        ({"max_batch_bytes": 1.5}, "max_batch_bytes"),
        ({"copy_threads": -1}, "copy_threads"),
        ({"worker_copy_threads": "2"}, "worker_copy_threads"),
        ({"slot_timeout": "60"}, "slot_timeout"),
        ({"overflow": "drop"}, "overflow"),
        ({"oversize": True}, "oversize"),
    ],
)
def test_a_wrong_setting_is_refused_by_name_when_the_loader_is_made(
    kwargs: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidArgument, match=named):
        pinpool.DataLoader(Indexed(4), batch_size=2, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"arena_bytes": "x"}, "arena_bytes"),
        ({"copy_threads": -1}, "copy_threads"),
        ({"copy_threads": "4"}, "copy_threads"),
        ({"slot_bytes": None}, "slot_bytes"),
        ({"num_slots": 2.0}, "num_slots"),
        ({"background": "yes"}, "background"),
        ({"backend": 3}, "backend"),
        ({"device": "gpu"}, "device"),
        ({"device": True}, "device"),
    ],
)
def test_a_wrong_pool_argument_is_refused_by_name(kwargs: dict[str, Any], named: str) -> None:
    args: dict[str, Any] = {"slot_bytes": 4096, "num_slots": 2, "device": "cpu", **kwargs}
    with pytest.raises(InvalidArgument, match=named):
        pinpool.PinPool(**args)


def test_an_exhausted_pool_says_what_holds_it() -> None:
    pool = pinpool.PinPool(4096, 4, device="cpu", arena_bytes=4 * 4096)
    held = pool.checkout(nbytes=3 * 4096)
    with pytest.raises(pinpool.PoolExhausted) as info:
        pool.checkout(nbytes=2 * 4096, timeout=0.01)
    text = str(info.value)
    assert "1 slots checked out (12288 bytes)" in text, text
    assert "longest free range is 4096 bytes" in text, text
    held.release()
    pool.close()


# -- a fuzz over every argument -------------------------------------------------------------

_JUNK = st.one_of(
    st.text(max_size=6),
    st.floats(allow_nan=True),
    st.integers(-(1 << 70), 1 << 70),
    st.booleans(),
    st.none(),
    st.just(object()),
    st.lists(st.integers(), max_size=2),
)

_LOADER_ARGS = (
    "pool",
    "arena_bytes",
    "max_batch_bytes",
    "slot_bytes",
    "num_slots",
    "device",
    "copy_threads",
    "slot_timeout",
    "overflow",
    "oversize",
    "zero_copy",
    "keep_worker_memory",
    "worker_copy_threads",
    "stream_samples",
)

_FUZZ = settings(
    max_examples=int(os.environ.get("PINPOOL_FUZZ_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _refused_by_name(exc: BaseException, name: str) -> bool:
    return isinstance(exc, pinpool.PinPoolError) and name in str(exc)


@_FUZZ
@given(name=st.sampled_from(_LOADER_ARGS), value=_JUNK)
def test_any_loader_argument_is_checked_when_the_loader_is_made(name: str, value: Any) -> None:
    """Whatever one argument is, either the loader is refused at construction with an error
    naming it, or it loads a batch (a setting that was fine)."""
    kwargs: dict[str, Any] = {name: value}
    if name == "num_slots" and value is not None:
        kwargs["slot_bytes"] = 4096
    try:
        loader = pinpool.DataLoader(Indexed(4), batch_size=2, **kwargs)
    except (InvalidArgument, NotEnoughMemory) as exc:
        assert _refused_by_name(exc, name), (name, value, exc)
        return
    except pinpool.PinPoolError as exc:  # (sizes that contradict each other, say)
        assert name in str(exc) or "num_slots" in str(exc), (name, value, exc)
        return
    try:
        next(iter(loader))
    except (BatchTooLarge, pinpool.PoolExhausted):
        pass  # (a tiny size, as asked: the batch's own error, not the setting's)
    finally:
        del loader
        gc.collect()


_POOL_ARGS = ("slot_bytes", "num_slots", "device", "backend", "copy_threads", "background")


@_FUZZ
@given(name=st.sampled_from((*_POOL_ARGS, "arena_bytes")), value=_JUNK)
def test_any_pool_argument_is_checked_when_the_pool_is_made(name: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"slot_bytes": 4096, "num_slots": 2, "device": "cpu", name: value}
    try:
        pool = pinpool.PinPool(**kwargs)
    except (InvalidArgument, NotEnoughMemory) as exc:
        assert name in str(exc), (name, value, exc)
        return
    except pinpool.PinPoolError as exc:  # (no CUDA for a device named, say)
        assert "device" in str(exc) or "CUDA" in str(exc) or "cuda" in str(exc), (value, exc)
        return
    pool.checkout().release()
    pool.close()


@_FUZZ
@given(name=st.sampled_from(("dtype", "shape", "offset")), value=_JUNK)
def test_any_view_argument_is_checked(name: str, value: Any) -> None:
    pool = pinpool.PinPool(4096, 1, device="cpu")
    slot = pool.checkout()
    kwargs: dict[str, Any] = {"dtype": torch.float32, "shape": (4,), "offset": 0, name: value}
    try:
        view = slot.view(**kwargs)
    except InvalidArgument as exc:
        assert name in str(exc) or "dtype" in str(exc), (name, value, exc)
    except pinpool.OutOfBounds:
        pass  # (a shape or offset past the slot: refused as out of bounds)
    else:
        del view
    slot.release()
    pool.close()
