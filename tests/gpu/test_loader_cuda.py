"""The DataLoader on a GPU: torch's pin thread decodes, batches are pinned or on the device.

All tests here need CUDA (``@pytest.mark.cuda``) and are skipped cleanly without it.
"""

from __future__ import annotations

import functools
import gc
import threading

import pytest
import torch
from loader_gpu_datasets import Images, Mixed, Tokens, strided_leaves

import pinpool
import pinpool.trace

#: In copy mode, or the mode --zero-copy/--pin-thread choose (``tests/conftest.py``).
pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("loader_mode")]


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.cpu().view(-1).view(torch.uint8), b.cpu().view(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("zero_copy", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_host_batches_are_pinned_views_and_equal_torch(workers: int, zero_copy: bool) -> None:
    ref = torch.utils.data.DataLoader(Mixed(40), batch_size=8, num_workers=workers)
    ours = pinpool.DataLoader(Mixed(40), batch_size=8, num_workers=workers, zero_copy=zero_copy)
    for a, b in zip(ref, ours, strict=True):
        _same(a, b)
        assert b["image"].is_pinned() and b["features"].is_pinned()
    assert ours.pool is not None and ours.pool.memory == "pinned"
    del a, b
    gc.collect()
    ours.pool.flush()
    stats = ours.stats()
    assert stats["slots_checked_out"] == 0
    if zero_copy and workers:
        assert stats["zero_copy_batches"] > 0


@pytest.mark.parametrize("zero_copy", [False, True])
def test_device_batches_equal_torch_and_are_safe_on_the_consumer_stream(zero_copy: bool) -> None:
    ref = torch.utils.data.DataLoader(Mixed(48), batch_size=8, num_workers=2)
    ours = pinpool.DataLoader(
        Mixed(48), batch_size=8, num_workers=2, device="cuda", zero_copy=zero_copy
    )
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the consumer works on a stream of its own
        for a, b in zip(ref, ours, strict=True):
            assert b["image"].device.type == "cuda"
            # Use the batch on the consumer stream right away: it must already be complete.
            total = b["image"].to(torch.int64).sum()
            assert int(total) == int(a["image"].to(torch.int64).sum())
            _same(a, b)
    torch.cuda.synchronize()
    del a, b
    gc.collect()
    assert ours.stats()["slots_checked_out"] == 0


@pytest.mark.parametrize("zero_copy", [False, True])
def test_device_memory_is_recorded_on_the_stream_that_consumes_it(
    monkeypatch: pytest.MonkeyPatch, zero_copy: bool
) -> None:
    """The caching allocator is told (``record_stream``) that each big batch's device memory
    is used on the consumer's stream, whichever stream that is and however it changes:
    recorded ahead on the pin thread for the stream the consumer used last, or in ``next()``.
    (A small batch's memory is allocated on the consumer's stream itself: see below.)"""
    calls: list[tuple[int, int]] = []
    lock = threading.Lock()  # (the pin thread records too)
    record = torch.Tensor.record_stream

    def counted(self: torch.Tensor, stream: torch.cuda.Stream) -> None:
        with lock:
            calls.append((self.untyped_storage().data_ptr(), int(stream.cuda_stream)))
        record(self, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", counted)
    ours = pinpool.DataLoader(
        Images(96, 3, 256, 256), batch_size=8, num_workers=2, device="cuda", zero_copy=zero_copy
    )
    side = torch.cuda.Stream()
    streams = [torch.cuda.default_stream()] * 4 + [side] * 4 + [torch.cuda.default_stream()] * 4
    it = iter(ours)
    for i, stream in enumerate(streams):
        with torch.cuda.stream(stream):
            b, _ = next(it)
        ptr = b.untyped_storage().data_ptr()
        with lock:
            mine = [raw for p, raw in calls if p == ptr]
            calls[:] = [c for c in calls if c[0] != ptr]  # (a later batch may reuse it)
        assert int(stream.cuda_stream) in mine, (i, mine)
    del it, b
    gc.collect()
    assert ours.stats()["slots_checked_out"] == 0


@pytest.mark.parametrize("zero_copy", [False, True])
def test_small_device_batches_are_copied_behind_the_consumers_work_and_fenced_there(
    zero_copy: bool,
) -> None:
    """A small device batch is copied on the stream current in ``next()``, as
    ``tensor.to(device, non_blocking=True)`` would be: behind the work queued there, with its
    slot returned fenced on that stream. Two slots, and a long kernel queued on the
    consumer's stream before each ``next()``: a slot reused before the copy out of it had run
    would hand an earlier batch a later batch's bytes."""
    from pinpool._main.route.receiver import CONSUMER_SENDS_UP_TO

    assert 8 * 3 * 32 * 32 <= CONSUMER_SENDS_UP_TO
    loader = pinpool.DataLoader(
        Images(48, 3, 32, 32),
        batch_size=8,
        num_workers=2,
        device="cuda",
        zero_copy=zero_copy,
        slot_bytes=1 << 16,
        num_slots=2,
    )
    side = torch.cuda.Stream()
    got = []
    with torch.cuda.stream(side):
        for batch, labels in loader:
            got.append((batch, labels))
            torch.cuda._sleep(100_000_000)  # about 50 ms of work before the next batch
    torch.cuda.synchronize()
    assert sum(len(labels) for _, labels in got) == 48
    for batch, labels in got:
        expected = (labels % 251).to(torch.uint8).cuda()
        assert torch.equal(batch[:, 0, 0, 0], expected)
        assert torch.equal(batch[:, -1, -1, -1], expected)
    del got, batch
    gc.collect()
    assert loader.stats()["slots_checked_out"] == 0


def test_big_batches_stream_through_few_slots() -> None:
    ours = pinpool.DataLoader(Images(64, 3, 512, 512), batch_size=16, num_workers=4, device="cuda")
    seen = 0
    for batch, labels in ours:
        # Each image i is filled with i % 251: check one value per image.
        expected = (labels % 251).to(torch.uint8).cuda()
        assert torch.equal(batch[:, 0, 0, 0], expected)
        seen += len(labels)
    assert seen == 64
    stats = ours.stats()
    assert stats["overflow_batches"] == 0
    assert stats["slots_checked_out"] == 0


@pytest.mark.parametrize("zero_copy", [False, True])
def test_small_device_batches_are_sent_by_the_consumer_and_big_ones_ahead(zero_copy: bool) -> None:
    """Device batches up to ``CONSUMER_SENDS_UP_TO`` are sent in ``next()``, on the consumer's
    thread; bigger ones by torch's pin thread, ahead. Both arrive whole."""
    from pinpool._main.route.receiver import CONSUMER_SENDS_UP_TO

    small = Images(32, 3, 32, 32)  # 8 x 3 KB
    big = Images(32, 3, 512, 512)  # 8 x 786 KB
    assert 8 * 3 * 32 * 32 <= CONSUMER_SENDS_UP_TO < 8 * 3 * 512 * 512
    me = threading.current_thread().name
    for data, by_consumer in ((small, True), (big, False)):
        loader = pinpool.DataLoader(
            data, batch_size=8, num_workers=2, device="cuda", zero_copy=zero_copy
        )
        with pinpool.trace.recording() as events:
            for batch, labels in loader:
                expected = (labels % 251).to(torch.uint8).cuda()
                assert torch.equal(batch[:, 0, 0, 0], expected)
                assert torch.equal(batch[:, -1, -1, -1], expected)
        sends = [e.thread for e in events if e.name == "batch.send"]
        assert sends, "no batch was sent"
        assert (set(sends) == {me}) is by_consumer, (data.shape, sends)
        if not by_consumer:
            # The first big batch starts the pin thread: only what the consumer's read-ahead got
            # before (at most prefetch_factor x num_workers batches) is sent by the consumer.
            assert sends.count(me) <= 2 * 2, sends
        del loader
        gc.collect()


@pytest.mark.parametrize("zero_copy", [False, True])
def test_batches_of_one_dtype_come_out_of_one_allocation_in_one_call(zero_copy: bool) -> None:
    """A batch whose leaves share one dtype (token ids, mask, labels) is copied into one device
    allocation of that dtype and viewed in one call (``leaves.DeviceLayout``); a batch of one
    tensor is that allocation itself. Small ones sent by the consumer, big ones ahead: equal to
    torch's batches either way, each leaf where its bytes were in the slot."""
    from pinpool._main.route.receiver import CONSUMER_SENDS_UP_TO

    keys = ("input_ids", "attention_mask", "labels")
    for length in (64, 1 << 16):  # 8 x 3 x 512 B, sent by the consumer; 8 x 3 x 512 KiB
        assert (8 * 3 * 8 * length <= CONSUMER_SENDS_UP_TO) is (length == 64)
        for data in (Tokens(24, length), Tokens(24, length, keys)):
            ref = torch.utils.data.DataLoader(data, batch_size=8, num_workers=2)
            ours = pinpool.DataLoader(
                data, batch_size=8, num_workers=2, device="cuda", zero_copy=zero_copy
            )
            for a, b in zip(ref, ours, strict=True):
                _same(a, b)
                if isinstance(b, torch.Tensor):
                    assert b.is_cuda and b._base is None, "a one-tensor batch: its allocation"
                    continue
                base = {b[k].untyped_storage().data_ptr() for k in keys}
                assert len(base) == 1, "leaves of one batch in one allocation"
                starts = [b[k].data_ptr() for k in keys]
                assert starts == sorted(starts) and starts[0] >= base.pop()
            torch.cuda.synchronize()
            del a, b
            gc.collect()
            assert ours.stats()["slots_checked_out"] == 0
            del ours
            gc.collect()


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("rows", [6, 300])  # small batches and big ones (over 1 MiB)
@pytest.mark.parametrize("device", [None, "cuda"])
def test_leaves_that_are_not_contiguous_keep_torchs_pinned_layout(
    device: str | None, rows: int, num_workers: int
) -> None:
    """A collate function's transposed, sliced, channels_last and lazily negated leaves come
    back as torch's ``pin_memory()`` gives them, with workers and without: pinned, in the same
    layout, negation resolved; as device batches, the same values on the GPU. An expanded leaf
    (stride 0), which torch's ``pin_memory()`` refuses, comes with its values."""
    kw = {"batch_size": 2, "num_workers": num_workers}
    theirs = functools.partial(strided_leaves, rows=rows, expanded=False)
    ref = torch.utils.data.DataLoader(Mixed(6), pin_memory=True, collate_fn=theirs, **kw)
    ours = pinpool.DataLoader(
        Mixed(6), device=device, collate_fn=functools.partial(strided_leaves, rows=rows), **kw
    )
    # (torch's workers drop a lazy negation: pinpool's values are the negated ones.)
    want = {k: v.resolve_neg() for k, v in strided_leaves([], rows=rows).items()}
    for a, b in zip(ref, ours, strict=True):
        assert b["expanded"].is_pinned() if device is None else b["expanded"].is_cuda
        for k in want:
            assert torch.equal(b[k].cpu(), want[k]), k
        for k in a:
            if device is None:
                assert b[k].is_pinned() and b[k].stride() == a[k].stride(), k
            else:
                assert b[k].is_cuda, k
    torch.cuda.synchronize()
    del a, b
    gc.collect()
    assert ours.stats()["slots_checked_out"] == 0
