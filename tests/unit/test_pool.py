"""PinPool and Slot on the host backend: construction, memory, views, release rules, close,
statistics and concurrency. Runs on any Linux machine; no GPU needed."""

from __future__ import annotations

import gc
import itertools
import logging
import os
import re
import signal
import threading
import time
import weakref

import numpy as np
import pytest
import torch

import pinpool
from pinpool import (
    BatchTooLarge,
    CudaError,
    InvalidArgument,
    OutOfBounds,
    PinPoolError,
    PoolClosed,
    PoolExhausted,
    SlotReleased,
)
from pinpool._native import SegmentCache, WorkerSegment

PAGE = pinpool.page_size()

STATS_KEYS = {
    "slots_free",
    "slots_checked_out",
    "slots_fenced",
    "slots_preparing",
    "checkouts",
    "waits",
    "wait_seconds",
    "releases",
    "bytes_copied",
    "copies",
    "segments_mapped",
    "segments_unmapped",
    "pending_unmaps",
    "fence_errors",
    "arena_bytes",
    "bytes_free",
    "bytes_checked_out",
    "bytes_fenced",
    "bytes_preparing",
    "largest_free",
    "free_ranges",
}


def slot_counts(pool: pinpool.PinPool) -> tuple[int, int, int]:
    s = pool.stats()
    return s["slots_free"], s["slots_checked_out"], s["slots_fenced"]


# --------------------------------------------------------------------------- construction


def test_page_size_is_sane() -> None:
    assert PAGE >= 4096
    assert PAGE & (PAGE - 1) == 0


def test_host_pool_with_device_cpu(make_pool) -> None:
    pool = make_pool(1 << 16, 3, device="cpu")
    assert pool.backend == "host"
    assert pool.memory in ("locked", "pageable")
    assert pool.device is None
    assert pool.num_slots == 3
    assert pool.slot_bytes == 1 << 16
    assert pool.arena_bytes == 3 * (1 << 16)
    assert pool.copy_threads >= 1
    assert not pool.closed
    # Asking for no CUDA is not a fallback: nothing about CUDA in the notes.
    assert not any("CUDA" in note for note in pool.notes)
    assert "PinPool(" in repr(pool) and "host" in repr(pool)


class _HasStream:
    cuda_stream = 0


@pytest.mark.parametrize("bad", ["not a stream", -1, 1.5, 1 << 64, object()])
def test_a_host_pools_release_checks_its_stream_argument(make_pool, bad) -> None:
    """A host pool fences nothing, but ``stream=`` is checked as on a CUDA pool: an int (the
    raw stream, taken as it is), anything with ``cuda_stream``, or None; anything else is
    refused and the slot stays out."""
    pool = make_pool(1 << 16, 1, device="cpu")
    slot = pool.checkout()
    with pytest.raises(InvalidArgument, match="stream"):
        slot.release(stream=bad)
    assert not slot.released and pool.stats()["slots_checked_out"] == 1
    slot.release(stream=0)
    assert slot.released
    for good in (_HasStream(), None):
        again = pool.checkout(timeout=1)
        again.release(stream=good)
        assert again.released
    assert pool.stats()["slots_free"] == 1


#: How an error says why CUDA cannot be used: the dynamic loader's message when libcuda cannot
#: be loaded (no driver call was made, so no driver code), else the driver's own name and code.
WHY_NO_CUDA = r"libcuda\.so\.1 could not be loaded: \S|failed: CUDA_ERROR_[A-Z_]+ \([1-9]\d*\)"


@pytest.mark.skipif(pinpool.cuda_available(), reason="checks behaviour without CUDA")
@pytest.mark.parametrize(
    ("device", "named"),
    [
        (0, "CUDA device 0"),
        ("cuda:1", "CUDA device 1"),
        (torch.device("cuda", 0), "CUDA device 0"),
        ("cuda", 'device="cuda"'),
        (torch.device("cuda"), 'device="cuda"'),
    ],
)
def test_a_device_asked_for_without_cuda_is_refused_saying_why(device, named, caplog) -> None:
    # A GPU named is used or refused, never quietly replaced by host memory: the error says
    # what was asked for, why CUDA cannot be used, and how to get host memory instead.
    with caplog.at_level(logging.WARNING, logger="pinpool"):
        with pytest.raises(InvalidArgument) as info:
            pinpool.PinPool(4096, 2, device=device)
    text = str(info.value)
    assert text.startswith(f"{named} was asked for"), text
    assert re.search(WHY_NO_CUDA, text), text
    assert 'device="cpu" gives host memory' in text and "device=None" in text, text
    assert "(0)" not in text and "NO_DRIVER" not in text, text  # no invented driver code
    # The way out the message names works.
    with pinpool.PinPool(4096, 2, device="cpu") as pool:
        assert pool.backend == "host"


@pytest.mark.skipif(pinpool.cuda_available(), reason="checks behaviour without CUDA")
def test_the_pool_and_the_dataloader_refuse_a_missing_gpu_alike() -> None:
    # Both raise InvalidArgument (a ValueError) when the loader or pool is made, and both
    # take device=None to mean "a GPU where there is one".
    for make in (
        lambda device: pinpool.PinPool(4096, 1, device=device),
        lambda device: pinpool.DataLoader(list(range(4)), batch_size=2, device=device),
    ):
        with pytest.raises(InvalidArgument, match="device=None"):
            make("cuda")
        make(None)


@pytest.mark.skipif(pinpool.cuda_available(), reason="checks the no-CUDA fallback")
def test_default_device_falls_back_to_host() -> None:
    pool = pinpool.PinPool(4096, 1)
    try:
        assert pool.backend == "host"
        assert pool.device is None
        assert pool.notes
    finally:
        pool.close()


@pytest.mark.skipif(pinpool.cuda_available(), reason="checks the no-CUDA fallback")
@pytest.mark.parametrize("device", [None])
@pytest.mark.parametrize("local_rank", [None, "0", "3", "not-a-rank"])
def test_the_automatic_device_without_cuda_is_host_memory_with_a_note(
    make_pool, monkeypatch, device, local_rank, caplog
) -> None:
    # `device=None` (the default) chooses the rank's own GPU: with no GPU there is none to
    # choose, so host memory, saying why, whatever LOCAL_RANK says (even nonsense: with no
    # device it is never read). ("cuda", which names a GPU, is refused instead: above.)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    with caplog.at_level(logging.WARNING, logger="pinpool"):
        pool = make_pool(4096, 1, device=device)
    assert pool.device is None
    assert pool.backend == "host"
    assert pool.memory != "pinned"
    assert any("CUDA" in note for note in pool.notes), pool.notes
    assert any(re.search(WHY_NO_CUDA, note) for note in pool.notes), pool.notes
    assert "PinPool(" in repr(pool) and "device=None" in repr(pool)


def test_the_default_device_is_none() -> None:
    # The signature says what a bare PinPool(...) does.
    assert "device=None" in (pinpool.PinPool.__text_signature__ or "")


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_cpu_device_names_mean_host(make_pool, device) -> None:
    pool = make_pool(4096, 1, device=device)
    assert pool.backend == "host"
    assert pool.device is None


@pytest.mark.parametrize("device", ["cpu", None, 0])
def test_explicit_host_backend(make_pool, device) -> None:
    # The host backend needs no device, whatever `device` says: no CUDA, and no note about it.
    pool = make_pool(4096, 1, device=device, backend="host")
    assert pool.backend == "host"
    assert not any("CUDA" in note for note in pool.notes), pool.notes


@pytest.mark.parametrize(
    ("asked", "expected"),
    [(1, PAGE), (1000, PAGE), (PAGE, PAGE), (PAGE + 1, 2 * PAGE), (3 * PAGE - 7, 3 * PAGE)],
)
def test_slot_size_rounded_up_to_page(make_pool, asked, expected) -> None:
    pool = make_pool(asked, 2)
    assert pool.slot_bytes == expected
    assert pool.arena_bytes == 2 * expected
    with pool.checkout() as slot:
        assert slot.nbytes == expected
        with memoryview(slot) as mv:
            assert mv.nbytes == expected


def test_slots_page_aligned_and_disjoint(make_pool) -> None:
    pool = make_pool(3 * PAGE + 1, 5)
    slots = [pool.checkout(timeout=1) for _ in range(5)]
    assert sorted(s.index for s in slots) == list(range(5))
    addrs = sorted(s.address for s in slots)
    assert all(a % PAGE == 0 for a in addrs)
    for lo, hi in itertools.pairwise(addrs):
        assert hi - lo >= pool.slot_bytes
    # All slots lie in one arena of arena_bytes.
    assert addrs[-1] + pool.slot_bytes - addrs[0] == pool.arena_bytes
    # Writing one slot never touches another.
    arrays = [np.frombuffer(s, dtype=np.uint8) for s in slots]
    for i, a in enumerate(arrays):
        a[:] = i + 1
    for i, a in enumerate(arrays):
        assert np.all(a == i + 1), f"slot {i} was overwritten by a neighbour"
    del arrays, a
    for s in slots:
        s.release()
    assert slot_counts(pool) == (5, 0, 0)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"slot_bytes": 0, "num_slots": 1}, "slot_bytes"),
        ({"slot_bytes": 4096, "num_slots": 0}, "num_slots"),
        ({"slot_bytes": 4096, "num_slots": 1, "backend": "bogus"}, "bogus"),
        ({"slot_bytes": 4096, "num_slots": 1, "device": -1}, "-1"),
        ({"slot_bytes": 4096, "num_slots": 1, "device": "tpu"}, "tpu"),
        ({"slot_bytes": 4096, "num_slots": 1, "device": "cuda:x"}, "cuda:x"),
        ({"slot_bytes": 2**62, "num_slots": 4}, "overflow"),
    ],
)
def test_bad_arguments(kwargs, needle) -> None:
    kwargs.setdefault("device", "cpu")
    with pytest.raises(InvalidArgument) as info:
        pinpool.PinPool(**kwargs)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, PinPoolError)
    assert needle in str(info.value)


def test_bogus_backend_message_lists_the_choices() -> None:
    with pytest.raises(InvalidArgument, match="cuda-register") as info:
        pinpool.PinPool(4096, 1, device="cpu", backend="bogus")
    assert "host" in str(info.value)


def test_negative_sizes_are_refused() -> None:
    # A clear InvalidArgument naming the argument, not PyO3's OverflowError.
    with pytest.raises(InvalidArgument, match="slot_bytes"):
        pinpool.PinPool(-1, 1, device="cpu")
    with pytest.raises(InvalidArgument, match="num_slots"):
        pinpool.PinPool(4096, -1, device="cpu")
    with pytest.raises(InvalidArgument, match="slot_bytes"):
        pinpool.PinPool(2**70, 1, device="cpu")
    with pytest.raises(TypeError):
        pinpool.PinPool("4096", 1, device="cpu")


@pytest.mark.parametrize("backend", ["cuda-register", "cuda-hostalloc"])
def test_cuda_backend_with_device_cpu_is_invalid(backend) -> None:
    with pytest.raises(InvalidArgument, match="device"):
        pinpool.PinPool(4096, 1, device="cpu", backend=backend)


@pytest.mark.skipif(pinpool.cuda_available(), reason="checks behaviour without CUDA")
@pytest.mark.parametrize("device", [0, None])
@pytest.mark.parametrize("backend", ["cuda-register", "cuda-hostalloc"])
def test_explicit_cuda_backend_without_cuda_is_a_clean_error(backend, device) -> None:
    try:
        pinpool.PinPool(4096, 1, device=device, backend=backend)
    except BaseException as e:
        # Never pyo3's PanicException (a BaseException), always an ordinary exception.
        assert isinstance(e, Exception), f"{type(e).__mro__}: {e}"
        assert isinstance(e, CudaError | InvalidArgument), f"{type(e)}: {e}"
        if isinstance(e, CudaError):
            assert e.name.startswith("CUDA_ERROR"), e.name
            assert str(e)
        # Why CUDA cannot be used, in the driver's or the dynamic loader's own words.
        assert re.search(WHY_NO_CUDA, str(e)), str(e)
        assert "(0)" not in str(e) and "NO_DRIVER" not in str(e), str(e)
    else:
        pytest.fail(f"backend={backend!r} without CUDA must raise")


# --------------------------------------------------------------------------- memory and views


def test_writes_visible_through_every_kind_of_view(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    slot = pool.checkout()
    arr = np.frombuffer(slot, dtype=np.uint8)
    assert arr.flags.writeable
    mv = memoryview(slot)
    assert not mv.readonly
    tfb = torch.frombuffer(slot, dtype=torch.uint8)
    tview = slot.view(torch.uint8, (PAGE,))
    assert tview.data_ptr() == slot.address == arr.ctypes.data == tfb.data_ptr()

    arr[0] = 11
    assert mv[0] == 11 and int(tfb[0]) == 11 and int(tview[0]) == 11
    mv[1] = 22
    assert arr[1] == 22 and int(tfb[1]) == 22 and int(tview[1]) == 22
    tfb[2] = 33
    assert arr[2] == 33 and mv[2] == 33 and int(tview[2]) == 33
    tview[3] = 44
    assert arr[3] == 44 and mv[3] == 44 and int(tfb[3]) == 44
    # Typed views over the same bytes.
    tview[4:8].copy_(torch.tensor([1, 0, 0, 0], dtype=torch.uint8))
    assert int(slot.view(torch.int32, (1,), offset=4)[0]) == 1  # little-endian

    mv.release()
    del arr, tfb, tview
    slot.release()


@pytest.mark.parametrize(
    "dtype",
    [
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.bool,
    ],
)
def test_view_of_torch_dtypes(make_pool, dtype) -> None:
    pool = make_pool(PAGE, 1)
    with pool.checkout() as slot:
        n = 16
        itemsize = dtype.itemsize
        offset = 8 * itemsize
        v = slot.view(dtype, (4, 4), offset=offset)
        assert isinstance(v, torch.Tensor)
        assert v.dtype == dtype and v.shape == (4, 4)
        assert v.data_ptr() == slot.address + offset
        if dtype == torch.bool:
            src = torch.arange(n).reshape(4, 4) % 3 == 0
        else:
            src = torch.arange(n).reshape(4, 4).to(dtype)
        v.copy_(src)
        assert torch.equal(v, src)
        # The bytes landed where the view says.
        raw = np.frombuffer(slot, dtype=np.uint8)[offset : offset + n * itemsize]
        assert raw.tobytes() == src.contiguous().view(torch.uint8).numpy().tobytes()
        del v, raw


def test_bfloat16_and_bool_bit_patterns(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    with pool.checkout() as slot:
        raw = np.frombuffer(slot, dtype=np.uint8)
        raw[:4] = [0, 1, 1, 0]
        b = slot.view(torch.bool, (4,))
        assert b.tolist() == [False, True, True, False]
        # bfloat16 1.5 is 0x3FC0; -2.0 is 0xC000 (little-endian storage).
        h = slot.view(torch.int16, (2,), offset=8)
        h.copy_(torch.tensor([0x3FC0, -0x4000], dtype=torch.int16))
        bf = slot.view("bfloat16", (2,), offset=8)
        assert bf.dtype == torch.bfloat16
        assert bf.float().tolist() == [1.5, -2.0]
        del raw, b, h, bf


def test_view_accepts_numpy_dtype_objects_and_strings(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    with pool.checkout() as slot:
        assert slot.view(np.dtype("float32"), (2, 3)).dtype == torch.float32
        assert slot.view(np.dtype("int64"), 5).dtype == torch.int64
        assert slot.view(np.dtype(bool), 5).dtype == torch.bool
        assert slot.view("float16", [7]).shape == (7,)
        empty = slot.view(torch.float32, (0, 3))
        assert empty.shape == (0, 3)
        with pytest.raises(InvalidArgument, match="dtype"):
            slot.view("not_a_dtype", (1,))
        with pytest.raises(InvalidArgument, match="negative"):
            slot.view(torch.uint8, (-1,))


def test_view_accepts_numpy_scalar_types(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    with pool.checkout() as slot:
        assert slot.view(np.float32, (2, 3)).dtype == torch.float32


def test_view_out_of_range_and_misaligned(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    with pool.checkout() as slot:
        n = slot.nbytes
        whole = slot.view(torch.uint8, (n,))
        assert whole.numel() == n
        last = slot.view(torch.float32, (1,), offset=n - 4)
        assert last.data_ptr() == slot.address + n - 4
        with pytest.raises(OutOfBounds):
            slot.view(torch.uint8, (n + 1,))
        with pytest.raises(OutOfBounds):
            slot.view(torch.float32, (n // 4,), offset=4)
        with pytest.raises(OutOfBounds):
            slot.view(torch.uint8, (1,), offset=n)
        with pytest.raises(OutOfBounds):
            slot.view(torch.float64, (n // 8 + 1,))
        with pytest.raises(InvalidArgument, match="offset"):
            slot.view(torch.float32, (4,), offset=2)
        with pytest.raises(InvalidArgument, match="offset"):
            slot.view(torch.int64, (4,), offset=12)
        assert isinstance(OutOfBounds("x"), ValueError)
        del whole, last
    assert slot_counts(pool) == (1, 0, 0), "a failed view must not leave the slot pinned"


def test_numpy_views_without_torch(make_pool, monkeypatch) -> None:
    """The numpy fallback of Slot.view (used when torch is not installed)."""
    import pinpool._views as views

    monkeypatch.setattr(views, "_HAVE_TORCH", False)
    pool = make_pool(PAGE, 1)
    slot = pool.checkout()
    v = slot.view(np.float32, (2, 4), offset=16)
    assert isinstance(v, np.ndarray)
    assert v.dtype == np.float32 and v.shape == (2, 4)
    assert v.ctypes.data == slot.address + 16
    v[:] = 2.5
    assert np.frombuffer(slot, dtype=np.float32)[4:12].tolist() == [2.5] * 8
    with pytest.raises(OutOfBounds):
        slot.view(np.uint8, (slot.nbytes + 1,))
    with pytest.raises(InvalidArgument, match="offset"):
        slot.view(np.int32, (1,), offset=3)
    # The numpy view pins the slot just like a tensor view does.
    slot.release()
    assert slot_counts(pool) == (0, 1, 0)
    del v
    gc.collect()
    assert slot_counts(pool) == (1, 0, 0)


# --------------------------------------------------------------------------- checkout rules


def test_checkout_timeout_raises_pool_exhausted(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    held = pool.checkout()
    t0 = time.perf_counter()
    with pytest.raises(PoolExhausted) as info:
        pool.checkout(timeout=0.2)
    waited = time.perf_counter() - t0
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, PinPoolError)
    assert "1 slots" in str(info.value) or "slot" in str(info.value)
    assert 0.19 <= waited < 3.0, waited
    with pytest.raises(PoolExhausted):
        pool.checkout(timeout=0.0)
    # A plain `except TimeoutError` catches it too.
    try:
        pool.checkout(timeout=0.01)
    except TimeoutError:
        pass
    s = pool.stats()
    assert s["waits"] >= 3
    assert s["wait_seconds"] >= 0.19
    held.release()


def test_try_checkout_returns_none_when_empty(make_pool) -> None:
    pool = make_pool(PAGE, 2)
    a = pool.try_checkout()
    b = pool.try_checkout()
    assert a is not None and b is not None
    assert {a.index, b.index} == {0, 1}
    assert pool.try_checkout() is None
    assert slot_counts(pool) == (0, 2, 0)
    a.release()
    c = pool.try_checkout()
    assert c is not None and c.index == a.index
    assert c.generation != a.generation
    b.release()
    c.release()


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_checkout_refuses_bad_timeouts_when_it_must_wait(make_pool, bad) -> None:
    pool = make_pool(PAGE, 1)
    held = pool.checkout()
    with pytest.raises(InvalidArgument, match="timeout"):
        pool.checkout(timeout=bad)
    held.release()


def test_blocked_checkout_gets_a_released_slot(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    held = pool.checkout()
    index = held.index
    timer = threading.Timer(0.1, held.release)
    timer.start()
    t0 = time.perf_counter()
    slot = pool.checkout(timeout=5)
    waited = time.perf_counter() - t0
    timer.join()
    assert slot.index == index
    assert 0.05 < waited < 4
    s = pool.stats()
    assert s["waits"] == 1 and s["wait_seconds"] > 0.05
    slot.release()


# --------------------------------------------------------------------------- release rules


def test_double_release_raises_slot_released(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    slot = pool.checkout()
    assert not slot.released
    slot.release()
    assert slot.released
    with pytest.raises(SlotReleased) as info:
        slot.release()
    assert str(slot.index) in str(info.value)
    assert "released" in repr(slot)
    assert pool.stats()["releases"] == 1
    assert slot_counts(pool) == (1, 0, 0)


def test_stale_handle_cannot_release_the_next_checkout(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    old = pool.checkout()
    old.release()
    new = pool.checkout()
    assert new.index == old.index
    with pytest.raises(SlotReleased):
        old.release()
    assert not new.released
    assert slot_counts(pool) == (0, 1, 0)
    new.release()


def test_use_after_release_raises(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    slot = pool.checkout()
    slot.release()
    with pytest.raises(SlotReleased):
        _ = slot.address
    with pytest.raises(SlotReleased):
        slot.view(torch.uint8, (16,))
    with pytest.raises(BufferError):
        memoryview(slot)
    with pytest.raises(BufferError):
        np.frombuffer(slot, dtype=np.uint8)
    with pytest.raises((BufferError, RuntimeError)):
        torch.frombuffer(slot, dtype=torch.uint8)
    # Metadata stays readable.
    assert slot.nbytes == pool.slot_bytes
    assert slot.index == 0
    assert slot.device is None


def test_auto_release_when_slot_object_dies(make_pool) -> None:
    pool = make_pool(PAGE, 2)
    slot = pool.checkout()
    ref = weakref.ref(slot)
    assert slot_counts(pool) == (1, 1, 0)
    del slot
    assert ref() is None
    assert slot_counts(pool) == (2, 0, 0)


def test_auto_release_waits_for_numpy_views_of_a_dropped_slot(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    slot = pool.checkout()
    arr = np.frombuffer(slot, dtype=np.uint8)
    part = arr[100:200]
    ref = weakref.ref(slot)
    del slot, arr
    # The numpy slice still views the slot: it is kept out of the pool.
    assert ref() is not None
    assert slot_counts(pool) == (0, 1, 0)
    assert pool.try_checkout() is None
    part[:] = 5
    del part
    gc.collect()
    assert ref() is None
    assert slot_counts(pool) == (1, 0, 0)


def test_auto_release_waits_for_tensor_views_of_a_dropped_slot(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    slot = pool.checkout()
    t = slot.view(torch.float32, (4, 8))
    row = t[2]  # a derived tensor shares the storage, and so the pin
    del slot, t
    assert slot_counts(pool) == (0, 1, 0)
    row.fill_(1.0)
    del row
    gc.collect()
    assert slot_counts(pool) == (1, 0, 0)


def test_auto_release_in_a_reference_cycle(make_pool) -> None:
    pool = make_pool(PAGE, 1)

    class Holder:
        pass

    h = Holder()
    h.slot = pool.checkout()
    h.me = h
    del h
    gc.collect()
    assert slot_counts(pool) == (1, 0, 0)


@pytest.mark.parametrize("kind", ["numpy", "memoryview", "slot.view", "numpy-of-memoryview"])
def test_release_deferred_while_a_view_lives(make_pool, kind) -> None:
    pool = make_pool(PAGE, 1)
    slot = pool.checkout()
    if kind == "numpy":
        view = np.frombuffer(slot, dtype=np.uint8)
    elif kind == "memoryview":
        view = memoryview(slot)
    elif kind == "slot.view":
        view = slot.view(torch.uint8, (64,), offset=PAGE - 64)
    else:
        view = np.asarray(memoryview(slot)[10:20])
    slot.release()
    assert slot.released
    # Released from the user's point of view, but still out of the pool.
    assert slot_counts(pool) == (0, 1, 0)
    assert pool.try_checkout() is None
    with pytest.raises(PoolExhausted):
        pool.checkout(timeout=0.05)
    with pytest.raises(SlotReleased):
        slot.release()
    # The live view may still be written (it is the user's until it dies).
    view[0] = 9
    if kind == "memoryview":
        view.release()
    del view
    gc.collect()
    assert slot_counts(pool) == (1, 0, 0)
    assert pool.stats()["releases"] == 1
    again = pool.try_checkout()
    assert again is not None
    again.release()


def test_release_deferred_until_the_last_of_several_views(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    slot = pool.checkout()
    a = np.frombuffer(slot, dtype=np.uint8)
    b = slot.view(torch.int32, (8,))
    c = memoryview(slot)
    slot.release()
    del slot
    del a
    gc.collect()
    assert slot_counts(pool) == (0, 1, 0)
    del b
    gc.collect()
    assert slot_counts(pool) == (0, 1, 0)
    c.release()
    assert slot_counts(pool) == (1, 0, 0)
    del c


def test_context_managers(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    with pool.checkout() as slot:
        assert isinstance(slot, pinpool.Slot)
        assert not slot.released
        slot.view(torch.uint8, (4,)).fill_(3)
    assert slot.released
    assert slot_counts(pool) == (1, 0, 0)

    # Releasing inside the block is fine; __exit__ does not release twice.
    with pool.checkout() as slot:
        slot.release()
    assert pool.stats()["releases"] == 2

    # An exception in the block still releases, and is not swallowed.
    with pytest.raises(RuntimeError, match="boom"), pool.checkout() as slot:
        raise RuntimeError("boom")
    assert slot.released
    assert slot_counts(pool) == (1, 0, 0)

    # A view that outlives the block defers the return.
    with pool.checkout() as slot:
        kept = slot.view(torch.uint8, (8,))
    assert slot.released
    assert slot_counts(pool) == (0, 1, 0)
    del kept
    gc.collect()
    assert slot_counts(pool) == (1, 0, 0)

    with pinpool.PinPool(PAGE, 1, device="cpu") as p2:
        assert not p2.closed
        with p2.checkout():
            pass
    assert p2.closed


# --------------------------------------------------------------------------- close


def test_close_with_slots_out(make_pool) -> None:
    pool = make_pool(PAGE, 3)
    out = pool.checkout()
    other = pool.checkout()
    view = out.view(torch.uint8, (PAGE,))
    pool.close()
    assert pool.closed
    assert "closed" in repr(pool)
    # Slots already out stay usable.
    view.fill_(7)
    assert np.frombuffer(out, dtype=np.uint8)[123] == 7
    assert out.address % PAGE == 0
    assert int(out.view(torch.uint8, (1,), offset=5)[0]) == 7
    # No new checkouts.
    with pytest.raises(PoolClosed):
        pool.checkout()
    with pytest.raises(PoolClosed):
        pool.checkout(timeout=0)
    with pytest.raises(PoolClosed):
        pool.try_checkout()
    assert isinstance(PoolClosed("x"), PinPoolError)
    # Releasing works (and the double-release rule still holds).
    out.release()
    with pytest.raises(SlotReleased):
        out.release()
    del view
    other.release()
    # Stats are still available after close, with every key.
    assert set(pool.stats()) == STATS_KEYS
    # Closing twice is harmless.
    pool.close()
    assert pool.closed


def test_close_wakes_a_blocked_checkout(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    held = pool.checkout()
    result: dict[str, object] = {}
    started = threading.Event()

    def waiter() -> None:
        started.set()
        t0 = time.perf_counter()
        try:
            result["slot"] = pool.checkout()  # no timeout: only close() can end this
        except BaseException as e:
            result["error"] = e
        result["waited"] = time.perf_counter() - t0

    th = threading.Thread(target=waiter, daemon=True)
    th.start()
    started.wait(5)
    time.sleep(0.15)  # let it block (without the GIL, or this sleep would not return)
    assert th.is_alive()
    t_close = time.perf_counter()
    pool.close()
    th.join(5)
    assert not th.is_alive(), "close() did not wake the blocked checkout"
    assert time.perf_counter() - t_close < 2
    assert isinstance(result.get("error"), PoolClosed), result
    assert result["waited"] >= 0.1
    held.release()


def test_close_wakes_a_checkout_with_timeout(make_pool) -> None:
    pool = make_pool(PAGE, 1)
    held = pool.checkout()
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            pool.checkout(timeout=30)
        except BaseException as e:
            errors.append(e)

    th = threading.Thread(target=waiter, daemon=True)
    th.start()
    time.sleep(0.1)
    pool.close()
    th.join(5)
    assert not th.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], PoolClosed)
    assert not isinstance(errors[0], PoolExhausted)
    held.release()


def test_slot_keeps_memory_alive_after_pool_object_dies() -> None:
    pool = pinpool.PinPool(PAGE, 1, device="cpu")
    slot = pool.checkout()
    arr = np.frombuffer(slot, dtype=np.uint8)
    pool.close()
    del pool
    gc.collect()
    arr[:] = 42  # the arena must still be mapped
    assert int(arr.sum()) == 42 * PAGE
    del arr
    slot.release()


# --------------------------------------------------------------------------- stats


def test_stats_keys_and_counts(make_pool) -> None:
    pool = make_pool(PAGE, 4)
    s = pool.stats()
    assert set(s) == STATS_KEYS
    assert s["slots_free"] == 4
    assert s["slots_checked_out"] == 0
    assert s["slots_fenced"] == 0
    whole = {"arena_bytes", "bytes_free", "largest_free"}
    for key in STATS_KEYS - {"slots_free", "wait_seconds", "free_ranges"} - whole:
        assert s[key] == 0, key
    assert {k: s[k] for k in whole} == dict.fromkeys(whole, 4 * PAGE)
    assert s["free_ranges"] >= 1
    assert s["wait_seconds"] == 0.0
    assert isinstance(s["wait_seconds"], float)

    a = pool.checkout()
    b = pool.try_checkout()
    c = pool.checkout(timeout=1)
    s = pool.stats()
    assert (s["slots_free"], s["slots_checked_out"], s["checkouts"]) == (1, 3, 3)
    assert (s["bytes_checked_out"], s["bytes_free"]) == (3 * PAGE, PAGE)
    assert s["waits"] == 0
    a.release()
    b.release()
    s = pool.stats()
    assert (s["slots_free"], s["slots_checked_out"], s["releases"]) == (3, 1, 2)
    del c  # auto-release counts as a release
    s = pool.stats()
    assert (s["slots_free"], s["slots_checked_out"], s["releases"]) == (4, 0, 3)
    assert sum(slot_counts(pool)) == pool.num_slots


# --------------------------------------------------------------------------- concurrency


def test_many_threads_never_share_a_slot(make_pool) -> None:
    num_slots, num_threads, rounds = 4, 8, 150
    pool = make_pool(PAGE, num_slots)
    lock = threading.Lock()
    out: set[int] = set()
    errors: list[str] = []
    done = [0]
    barrier = threading.Barrier(num_threads)

    def worker(tid: int) -> None:
        try:
            barrier.wait(10)
            for i in range(rounds):
                if i % 3 == 0:
                    slot = pool.try_checkout()
                    if slot is None:
                        slot = pool.checkout(timeout=10)
                else:
                    slot = pool.checkout(timeout=10)
                with lock:
                    if slot.index in out:
                        errors.append(f"slot {slot.index} handed out twice")
                    out.add(slot.index)
                # Write a thread-specific pattern and read it back: a shared slot shows up.
                arr = np.frombuffer(slot, dtype=np.uint32)
                arr[:64] = tid * 1000 + i
                time.sleep(0)
                if not np.all(arr[:64] == tid * 1000 + i):
                    errors.append(f"slot {slot.index} overwritten while thread {tid} held it")
                del arr
                with lock:
                    out.discard(slot.index)
                if i % 2:
                    slot.release()
                else:
                    del slot  # auto-release path
            with lock:
                done[0] += 1
        except BaseException as e:
            errors.append(f"thread {tid}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a worker hung"
    assert not errors, errors[:5]
    assert done[0] == num_threads
    total = num_threads * rounds
    s = pool.stats()
    assert s["checkouts"] == total
    assert s["releases"] == total
    assert (s["slots_free"], s["slots_checked_out"], s["slots_fenced"]) == (num_slots, 0, 0)
    assert s["waits"] >= 0 and s["wait_seconds"] >= 0.0


def test_checkout_releases_the_gil(make_pool) -> None:
    """While one thread waits in checkout, other Python threads keep running."""
    pool = make_pool(PAGE, 1)
    held = pool.checkout()
    ticks = [0]
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    th = threading.Thread(target=ticker, daemon=True)
    th.start()
    with pytest.raises(PoolExhausted):
        pool.checkout(timeout=0.3)
    stop.set()
    th.join(5)
    assert ticks[0] > 20, "the ticker thread starved: checkout held the GIL while waiting"
    held.release()


def test_batch_too_large_is_a_value_error() -> None:
    e = BatchTooLarge("too big", 10, 5)
    assert isinstance(e, ValueError) and isinstance(e, PinPoolError)
    assert (e.needed, e.slot_bytes) == (10, 5)


def _wait_for_child(pid: int, seconds: float) -> int | None:
    """The child's exit code, or None if it did not exit in time (then it is killed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@pytest.mark.parametrize("used", [False, True])
def test_a_forked_child_can_drop_its_copy_of_the_pool(used: bool) -> None:
    # A DataLoader worker forked while the parent holds a pool (an earlier loader's, kept
    # alive by a traceback, say) may drop the last reference to it: that must neither wait
    # for the parent's threads nor touch its CUDA context. With a segment cache, dropping it
    # hands its mappings to the pool's reclaimer, whose thread is not in the child.
    pool = pinpool.PinPool(1 << 20, 4, device="cpu")
    cache = SegmentCache(pool)
    segment = WorkerSegment(1 << 16)
    if used:
        cache.insert((1, 0), os.dup(segment.fd), segment.total_len, segment.nonce)
        pool.checkout().release()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, only an exit code
        code = 1
        try:
            del pool, cache
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    code = _wait_for_child(pid, 20)
    assert code is not None, "the child hung dropping its copy of the pool"
    assert code == 0
    assert pool.stats()["slots_free"] == 4  # the parent's pool is untouched
    del cache
    pool.flush()
    pool.close()


def test_try_checkout_with_a_reserve_leaves_that_many_free(make_pool) -> None:
    pool = make_pool(4096, 3)
    a = pool.try_checkout(reserve=1)
    b = pool.try_checkout(reserve=1)
    assert a is not None and b is not None
    assert pool.try_checkout(reserve=1) is None, "took the reserved slot"
    c = pool.try_checkout()
    assert c is not None and len({a.index, b.index, c.index}) == 3
    for s in (a, b, c):
        s.release()


@pytest.mark.slow
def test_a_background_pool_readies_its_slots_while_it_is_used() -> None:
    """``background=True``: the constructor makes the first 16 MiB (at least one part, so one
    slot of the largest size) ready and returns; the other slots are ``preparing`` until a
    checkout asks for them and the prepare thread has faulted them in, and checkouts wait for
    them instead of failing."""
    slot_bytes, n = 32 << 20, 32
    pool = pinpool.PinPool(slot_bytes, n, device="cpu", background=True)
    try:
        s = pool.stats()
        assert s["slots_free"] + s["slots_preparing"] == n
        assert s["slots_free"] >= 1, s
        time.sleep(0.2)  # nothing asked for: nothing more is made ready
        assert pool.stats()["slots_preparing"] == s["slots_preparing"] > 0
        slots = [pool.checkout(timeout=60) for _ in range(n)]
        assert sorted(x.index for x in slots) == list(range(n))
        assert pool.stats()["slots_preparing"] == 0
        for i, x in enumerate(slots):
            x.view("uint8", (slot_bytes,))[-1] = i % 251  # every slot's memory is usable
        del x
        for x in slots:
            x.release()
    finally:
        pool.close(wait=True)


def test_ready_first_says_how_much_of_a_background_arena_is_ready_at_once() -> None:
    """``ready_first``: a background pool makes that many bytes ready (rounded up to a page)
    before it returns, however much less than a largest slot that is; the whole slots come
    once the rest of their part is ready. A count that is not one is refused, and no pool is
    made."""
    slot_bytes, n = 4 << 20, 4
    pool = pinpool.PinPool(slot_bytes, n, device="cpu", background=True, ready_first=1)
    try:
        small = pool.try_checkout(nbytes=4096)
        assert small is not None, "the first page is not ready"
        slots = [pool.checkout(timeout=60) for _ in range(n - 1)]
        small.release()
        slots.append(pool.checkout(timeout=60))
        assert pool.stats()["slots_preparing"] == 0
        for s in slots:
            assert s.nbytes == slot_bytes
            s.release()
    finally:
        pool.close(wait=True)
    for bad in (-1, True, 1.5, "8"):
        with pytest.raises((TypeError, ValueError, OverflowError)):
            pinpool.PinPool(slot_bytes, n, device="cpu", background=True, ready_first=bad)


def test_a_checkout_goes_where_it_is_preferred_or_only_there(make_pool) -> None:
    """``prefer``: the first of the offsets where the slot can start now is taken, else first
    fit; with ``prefer_only``, nowhere else (None, and nothing taken). Bad offsets are
    refused."""
    pool = make_pool(1 << 16, 8, arena_bytes=8 << 16)
    slots = [pool.checkout(nbytes=1 << 16) for _ in range(3)]
    offsets = [s.offset for s in slots]
    slots[1].release()
    again = pool.try_checkout(1 << 16, prefer=[offsets[0], offsets[1]])
    assert again is not None and again.offset == offsets[1], "the first free preferred place"
    assert pool.try_checkout(1 << 16, prefer=[offsets[1]], prefer_only=True) is None
    assert pool.stats()["slots_checked_out"] == 3, "nothing taken by a refused checkout"
    elsewhere = pool.try_checkout(1 << 16, prefer=[offsets[1]])
    assert elsewhere is not None and elsewhere.offset not in offsets
    for bad, error in (([-4096], InvalidArgument), (["x"], TypeError), ([0] * 65, InvalidArgument)):
        with pytest.raises(error):
            pool.try_checkout(1 << 16, prefer=bad)
    for s in (slots[0], slots[2], again, elsewhere):
        s.release()
