"""Shared fixtures and helpers for the pinpool test suite.

The ``cuda`` and ``slow`` markers are registered in ``pyproject.toml``; this file only decides
when ``cuda`` tests can run (see :func:`pytest_collection_modifyitems`) and provides helpers for
leak checks (open file descriptors, ``/dev/shm`` entries) and pools that are always closed.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator

import pytest

import pinpool


def open_fd_count() -> int:
    """How many file descriptors this process has open right now."""
    return len(os.listdir("/proc/self/fd"))


def shm_entry_count() -> int:
    """How many entries ``/dev/shm`` holds right now (0 if it does not exist)."""
    try:
        return len(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return 0


def cuda_unavailable_reason() -> str | None:
    """Why CUDA tests cannot run here, or None if they can.

    Both sides must see a GPU: pinpool's own driver loader and torch.
    """
    if not pinpool.cuda_available():
        return "pinpool.cuda_available() is False (no CUDA driver or device)"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test marked ``@pytest.mark.cuda`` when no usable GPU is present."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    reason = cuda_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs CUDA: {reason}")
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture
def fd_count() -> Callable[[], int]:
    """The :func:`open_fd_count` helper, as a fixture."""
    return open_fd_count


@pytest.fixture
def shm_count() -> Callable[[], int]:
    """The :func:`shm_entry_count` helper, as a fixture."""
    return shm_entry_count


@pytest.fixture
def make_pool() -> Iterator[Callable[..., pinpool.PinPool]]:
    """A factory for pools that are closed at the end of the test.

    Defaults to a host pool (``device=None``) so tests do not depend on the machine.
    """
    pools: list[pinpool.PinPool] = []

    def factory(slot_bytes: int = 4096, num_slots: int = 2, **kwargs: object) -> pinpool.PinPool:
        kwargs.setdefault("device", None)
        pool = pinpool.PinPool(slot_bytes, num_slots, **kwargs)  # type: ignore[arg-type]
        pools.append(pool)
        return pool

    yield factory
    for pool in pools:
        pool.close()
    # Drop slots and views the test left behind while the pools are still referenced here.
    gc.collect()
