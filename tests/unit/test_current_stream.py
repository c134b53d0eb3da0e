"""The stream hook (``pinpool._cuda_stream``): what a slot released without a stream is fenced
on. Without CUDA it says None; once torch's getter is kept, it is asked directly; a forked
child forgets it. (With a GPU, ``tests/gpu/test_cuda.py`` checks the stream it gives.)"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pinpool import _cuda_stream


@pytest.fixture
def fake_getter() -> Iterator[list[int]]:
    """A getter kept as torch's would be (the devices it was asked for), put back after."""
    asked: list[int] = []

    def getter(device: int) -> int:
        asked.append(device)
        return 1000 + device

    saved = _cuda_stream._getter
    _cuda_stream._getter = getter
    try:
        yield asked
    finally:
        _cuda_stream._getter = saved


@pytest.mark.skipif(torch.cuda.is_initialized(), reason="torch's CUDA is in use here")
def test_without_cuda_in_use_no_stream_is_current() -> None:
    assert _cuda_stream._getter is None
    assert _cuda_stream.current_stream(0) is None
    assert _cuda_stream._getter is None  # nothing kept


def test_a_kept_getter_is_asked_for_the_slots_device(fake_getter: list[int]) -> None:
    assert _cuda_stream.current_stream(3) == 1003
    assert _cuda_stream.current_stream(0) == 1000
    assert fake_getter == [3, 0]


def _in_child(out: Any) -> None:
    out.put((_cuda_stream._getter is None, _cuda_stream.current_stream(0)))


@pytest.mark.skipif(torch.cuda.is_initialized(), reason="torch's CUDA is in use here")
def test_a_forked_child_forgets_the_getter(fake_getter: list[int]) -> None:
    ctx = multiprocessing.get_context("fork")
    out = ctx.SimpleQueue()
    child = ctx.Process(target=_in_child, args=(out,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    # torch has not initialised CUDA in the child: no stream is current there.
    assert out.get() == (True, None)
    assert fake_getter == []  # the parent's getter was not asked in the child
    assert _cuda_stream.current_stream(1) == 1001  # the parent keeps it
