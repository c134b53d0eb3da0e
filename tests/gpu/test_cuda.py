"""CUDA behaviour: pinned slots, asynchronous copies, and fences that keep a slot out of the
pool until the GPU has finished reading it.

Every test here is marked ``cuda`` and is skipped (by ``conftest.py``) unless both pinpool and
torch see a GPU. Nothing at import time touches CUDA, so the module imports cleanly without
one. Long GPU work is simulated with ``torch.cuda._sleep`` (a spin of N clock cycles),
calibrated once per module with CUDA events.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import run_python

torch = pytest.importorskip("torch")

import pinpool  # noqa: E402
from pinpool import CudaError, InvalidArgument  # noqa: E402

pytestmark = pytest.mark.cuda

MiB = 1 << 20
LONG_KERNEL_S = 0.3  # how long the "slow GPU work" ahead of a copy runs


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def gpu() -> Iterator[torch.device]:
    """Initialises torch's CUDA (so pinpool's stream hook sees a current stream)."""
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # creates the primary context
    torch.cuda.synchronize()
    yield torch.device("cuda", 0)
    torch.cuda.synchronize()


@pytest.fixture(scope="module")
def cycles_per_ms(gpu: torch.device) -> float:
    """GPU clock cycles per millisecond, for ``torch.cuda._sleep``.

    The highest rate seen is kept, so a sleep computed from it lasts at least as long as asked
    even if the clock later runs faster than during the calibration.
    """
    torch.cuda._sleep(1000)  # load the kernel
    torch.cuda.synchronize()
    best = 0.0
    cycles = 20_000_000
    for _ in range(3):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        best = max(best, cycles / max(start.elapsed_time(end), 1e-3))
    return best


@pytest.fixture
def gpu_sleep(cycles_per_ms: float) -> Callable[[float], None]:
    """Enqueues a kernel that spins for about ``seconds`` on the current stream."""

    def sleep(seconds: float) -> None:
        torch.cuda._sleep(int(seconds * 1000 * cycles_per_ms))

    return sleep


@pytest.fixture
def cuda_pool(gpu: torch.device) -> Iterator[Callable[..., pinpool.PinPool]]:
    """A factory for CUDA pools (device 0 by default), all closed when the test ends."""
    pools: list[pinpool.PinPool] = []

    def factory(slot_bytes: int, num_slots: int, **kwargs: object) -> pinpool.PinPool:
        kwargs.setdefault("device", 0)
        pool = pinpool.PinPool(slot_bytes, num_slots, **kwargs)  # type: ignore[arg-type]
        pools.append(pool)
        return pool

    yield factory
    torch.cuda.synchronize()
    gc.collect()
    for pool in pools:
        pool.close()
    torch.cuda.synchronize()


def timed_events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def byte_pattern(n: int, seed: int) -> torch.Tensor:
    """A CPU uint8 tensor of ``n`` pseudo-random bytes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def checksum(t: torch.Tensor) -> int:
    return int(t.sum(dtype=torch.int64).item())


# --------------------------------------------------------------------------- construction


def test_cuda_is_seen_by_pinpool_and_torch(gpu: torch.device) -> None:
    assert pinpool.cuda_available()
    assert torch.cuda.is_available()


def test_default_backend_is_cuda_register_and_pinned(cuda_pool) -> None:
    pool = cuda_pool(2 * MiB, 2)
    assert pool.backend == "cuda-register"
    assert pool.memory == "pinned"
    assert pool.device == 0
    assert not any("unavailable" in note for note in pool.notes), pool.notes
    slot = pool.checkout()
    assert slot.device == 0
    whole = slot.view(torch.uint8, (slot.nbytes,))
    part = slot.view(torch.float32, (256,), offset=4096)
    assert whole.is_pinned()
    assert part.is_pinned()
    assert whole.data_ptr() == slot.address
    del whole, part
    slot.release()


@pytest.mark.parametrize("device", [0, "cuda", "cuda:0", "torch-cuda:0"])
def test_device_spellings(cuda_pool, device) -> None:
    if device == "torch-cuda:0":
        device = torch.device("cuda", 0)
    pool = cuda_pool(MiB, 1, device=device)
    assert pool.device == 0
    assert pool.backend == "cuda-register"


def test_missing_device_ordinal_is_an_error(gpu: torch.device) -> None:
    missing = torch.cuda.device_count()
    with pytest.raises((InvalidArgument, CudaError), match=str(missing)):
        pinpool.PinPool(MiB, 1, device=missing)


# --------------------------------------------------------------------------- the rank's device


def test_the_default_device_is_the_current_one(gpu: torch.device) -> None:
    # torch.cuda.set_device(n) makes device n's primary context current on this thread: a
    # bare PinPool(...) (and device="cuda", torch's "current device") binds that device, and
    # leaves torch's current device as it was.
    before = torch.cuda.current_device()
    try:
        for d in range(torch.cuda.device_count()):
            torch.cuda.set_device(d)
            torch.zeros(1, device=torch.device("cuda", d))  # its context exists and is current
            for device in (None, "cuda", torch.device("cuda")):
                with pinpool.PinPool(MiB, 1, device=device) as pool:
                    assert pool.device == d, (device, pool.device)
                    assert pool.backend == "cuda-register"
                    assert not any("CUDA" in note for note in pool.notes), pool.notes
                assert torch.cuda.current_device() == d, "the pool moved torch's current device"
    finally:
        torch.cuda.set_device(before)


@pytest.mark.parametrize("rank", [0, 1, 5])
def test_without_a_current_context_local_rank_picks_the_device(gpu: torch.device, rank) -> None:
    code = "import pinpool; p = pinpool.PinPool(1 << 20, 1); print(p.device, p.backend)"
    proc = run_python(code, LOCAL_RANK=str(rank))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(rank % torch.cuda.device_count()), "cuda-register"]


def test_without_a_current_context_or_local_rank_device_zero(gpu: torch.device) -> None:
    code = (
        "import os; os.environ.pop('LOCAL_RANK', None)\n"
        "import pinpool; p = pinpool.PinPool(1 << 20, 1); print(p.device, p.backend)"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["0", "cuda-register"]


def test_a_local_rank_that_is_not_a_rank_is_a_clear_error(gpu: torch.device) -> None:
    code = (
        "import pinpool\n"
        "try:\n"
        "    pinpool.PinPool(1 << 20, 1)\n"
        "except pinpool.InvalidArgument as e:\n"
        "    print('refused:', e)\n"
    )
    proc = run_python(code, LOCAL_RANK="first")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("refused:") and "LOCAL_RANK" in proc.stdout, proc.stdout


def test_the_current_context_wins_over_local_rank(gpu: torch.device) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: with one, the context and LOCAL_RANK name the same device")
    last = torch.cuda.device_count() - 1
    code = (
        "import torch\n"
        f"torch.cuda.set_device({last}); torch.zeros(1, device='cuda')\n"
        "import pinpool; print(pinpool.PinPool(1 << 20, 1).device, torch.cuda.current_device())"
    )
    proc = run_python(code, LOCAL_RANK="0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(last), str(last)]


def test_a_pool_on_another_gpu_leaves_torchs_current_device_alone(gpu: torch.device) -> None:
    # pinpool calls the driver on its callers' threads (making a pool, a slot's fence, the
    # loader's deliveries): each makes its device's context current, then puts the thread's
    # own back, which is torch's current device.
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    before = torch.cuda.current_device()
    try:
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda:0")
        with pinpool.PinPool(MiB, 2, device=1) as pool:
            assert torch.cuda.current_device() == 0, "making the pool"
            slot = pool.checkout()
            host = torch.frombuffer(slot, dtype=torch.uint8, count=MiB)
            host.fill_(7)
            on_1 = host.to("cuda:1", non_blocking=True)
            del host
            slot.release(torch.cuda.current_stream(1))  # its fence, on device 1's stream
            assert torch.cuda.current_device() == 0, "fencing a slot"
            assert int(on_1.sum()) == 7 * MiB
        data = torch.utils.data.TensorDataset(torch.arange(64.0))
        for zero_copy, workers in ((False, 0), (False, 2), (True, 2)):
            loader = pinpool.DataLoader(
                data, batch_size=8, num_workers=workers, zero_copy=zero_copy, device="cuda:1"
            )
            got = [x for (x,) in loader]
            assert all(x.device == torch.device("cuda", 1) for x in got)
            assert torch.cat(got).cpu().tolist() == list(range(64))
            assert torch.cuda.current_device() == 0, f"a loader (zero_copy={zero_copy})"
            del loader, got
    finally:
        torch.cuda.set_device(before)


def test_device_cpu_means_no_cuda(gpu: torch.device) -> None:
    with pinpool.PinPool(MiB, 1, device="cpu") as pool:
        assert pool.device is None
        assert pool.backend == "host"
        assert not any("CUDA" in note for note in pool.notes), pool.notes


def test_cuda_hostalloc_backend(cuda_pool) -> None:
    n = 4 * MiB
    pool = cuda_pool(n, 2, backend="cuda-hostalloc")
    assert pool.backend == "cuda-hostalloc"
    assert pool.memory == "pinned"
    with pool.checkout() as slot:
        host = slot.view(torch.uint8, (n,))
        assert host.is_pinned()
        src = byte_pattern(n, seed=1)
        host.copy_(src)
        dev = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), src)
        del host, dev
    assert slot.released


def test_host_backend_on_a_gpu_machine_is_not_pinned(cuda_pool) -> None:
    pool = cuda_pool(MiB, 1, backend="host")
    assert pool.backend == "host"
    assert pool.memory != "pinned"
    with pool.checkout() as slot:
        assert slot.device is None  # no fences on a host pool
        view = slot.view(torch.uint8, (16,))
        assert not view.is_pinned()
        del view


def test_a_forked_child_reads_a_registered_arena_and_writes_only_its_own_copy(cuda_pool) -> None:
    """A child forked after a pinned (driver-registered) arena exists reads the batches it
    inherited, and what it writes there stays its own: the parent's bytes, and their copy to
    the GPU, are unchanged (``src/memory/forked_child.rs``)."""
    import ctypes

    pool = cuda_pool(2 * MiB, 2)
    assert pool.backend == "cuda-register"
    slot = pool.checkout()
    host = slot.view(torch.uint8, (slot.nbytes,))
    src = byte_pattern(slot.nbytes, seed=3)
    host.copy_(src)
    expected = checksum(src)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            seen = ctypes.string_at(slot.address, slot.nbytes)
            if sum(seen) == expected:
                ctypes.memset(slot.address, 0, slot.nbytes)
                code = 0 if ctypes.string_at(slot.address, 4) == b"\0\0\0\0" else 3
            else:
                code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert checksum(host) == expected, "the child's writes reached the parent's arena"
    dev = host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert checksum(dev.cpu()) == expected
    del host, dev
    slot.release()


def test_the_stream_hook_follows_torchs_current_stream_and_says_none_in_a_forked_child(
    gpu: torch.device,
) -> None:
    """What a slot released without a stream is fenced on (``pinpool._cuda_stream``): torch's
    current stream, each time it is asked (its getter kept after the first ask); in a child
    forked after CUDA started, no stream (torch's CUDA cannot be used there)."""
    from pinpool import _cuda_stream

    side = torch.cuda.Stream()
    default = torch.cuda.current_stream().cuda_stream
    assert _cuda_stream.current_stream(0) == default
    with torch.cuda.stream(side):
        assert _cuda_stream.current_stream(0) == side.cuda_stream
    assert _cuda_stream.current_stream(0) == default
    assert _cuda_stream._getter is not None
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if _cuda_stream.current_stream(0) is None else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


# --------------------------------------------------------------------------- asynchronous copies


def test_non_blocking_copy_from_a_slot_is_asynchronous_and_correct(cuda_pool, gpu_sleep) -> None:
    n = 64 * MiB
    pool = cuda_pool(n, 1)
    slot = pool.checkout()
    host = slot.view(torch.uint8, (n,))
    host.copy_(byte_pattern(n, seed=2))
    want = checksum(host)
    # Warm up: the timed call must find a cached device block (no cudaMalloc in it).
    warm = host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    del warm

    start, end = timed_events()
    start.record()
    gpu_sleep(LONG_KERNEL_S)
    t0 = time.perf_counter()
    dev = host.to("cuda", non_blocking=True)
    call_s = time.perf_counter() - t0
    end.record()
    end.synchronize()
    gpu_ms = start.elapsed_time(end)
    print(f"non_blocking .to('cuda') call: {call_s * 1e3:.2f} ms; GPU time {gpu_ms:.1f} ms")
    assert gpu_ms >= 0.5 * LONG_KERNEL_S * 1e3, "the sleep kernel was too short to tell"
    # The call returned long before the kernel queued ahead of the copy had finished.
    assert call_s * 1e3 < gpu_ms / 4, (call_s, gpu_ms)
    assert checksum(dev) == want
    assert torch.equal(dev.cpu(), host)
    del host, dev
    slot.release()


def test_a_segment_copied_on_to_the_device_in_one_call(cuda_pool, gpu_sleep) -> None:
    """``SegmentCache.copy`` with ``send=``: the segment's bytes reach the device behind GPU work
    already queued on the stream, the call does not wait for it, ``Sent.make_wait`` orders
    another stream after it, and targets that do not qualify are refused."""
    n = 16 * MiB
    pool = cuda_pool(n + MiB, 2)
    cache = pinpool.SegmentCache(pool)
    ws = pinpool.WorkerSegment(n)
    assert ws.try_begin()
    data = byte_pattern(n, seed=5)
    with memoryview(ws) as mv:
        mv[:n] = data.numpy().tobytes()
    cache.insert((1, 0), os.dup(ws.fd), ws.total_len, ws.nonce)
    side = torch.cuda.Stream()
    target = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with pool.checkout() as slot:
        with torch.cuda.stream(side):
            gpu_sleep(LONG_KERNEL_S)
        t0 = time.perf_counter()
        sent = cache.copy((1, 0), slot, [(0, 0, n)], send=(target, n, side))
        call_s = time.perf_counter() - t0
        assert not sent.done, "the copy ran before the work queued ahead of it"
        assert call_s < LONG_KERNEL_S / 4, call_s
        slot.release(side)
        sent.make_wait()  # the current stream waits for the copy
        got = target.clone()  # on the current stream
        torch.cuda.synchronize()
        assert sent.done
        assert torch.equal(got.cpu(), data)
    cache.hand_back((1, 0))
    with pool.checkout() as slot:
        for bad in (
            torch.empty(n, dtype=torch.uint8),  # on the CPU
            torch.empty(n - 1, dtype=torch.uint8, device="cuda"),  # too small
            torch.empty(2 * n, dtype=torch.uint8, device="cuda")[::2],  # not contiguous
            "not a tensor",
        ):
            with pytest.raises(InvalidArgument):
                cache.copy((1, 0), slot, [(0, 0, n)], send=(bad, n, side))
    assert pool.stats()["slots_checked_out"] == 0


def test_a_slot_copied_to_the_device_in_one_call(cuda_pool, gpu_sleep) -> None:
    """``Slot.send`` (a zero-copy batch, in its slot already): asynchronous behind
    the stream's work, ordered by ``Sent.make_wait``, byte-exact; bad targets and a released
    slot are refused."""
    n = 16 * MiB
    pool = cuda_pool(n, 2)
    data = byte_pattern(n, seed=6)
    side = torch.cuda.Stream()
    target = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    slot = pool.checkout()
    slot.view(torch.uint8, (n,)).copy_(data)
    with torch.cuda.stream(side):
        gpu_sleep(LONG_KERNEL_S)
    t0 = time.perf_counter()
    sent = slot.send(target, n, side.cuda_stream)
    assert time.perf_counter() - t0 < LONG_KERNEL_S / 4
    assert not sent.done, "the copy ran before the work queued ahead of it"
    for bad in (
        torch.empty(n, dtype=torch.uint8),  # on the CPU
        torch.empty(n - 1, dtype=torch.uint8, device="cuda"),  # too small
        torch.empty(2 * n, dtype=torch.uint8, device="cuda")[::2],  # not contiguous
    ):
        with pytest.raises(InvalidArgument):
            slot.send(bad, n, side)
    with pytest.raises(pinpool.OutOfBounds):
        slot.send(torch.empty(2 * n, dtype=torch.uint8, device="cuda"), 2 * n, side)
    slot.release(side)
    with pytest.raises(pinpool.SlotReleased):
        slot.send(target, n, side)
    sent.make_wait()
    got = target.clone()
    torch.cuda.synchronize()
    assert sent.done and torch.equal(got.cpu(), data)
    assert pool.stats()["slots_checked_out"] == 0


def test_a_send_then_release_queues_the_copy_and_fences_the_slot_behind_it(
    cuda_pool, gpu_sleep
) -> None:
    """``Slot.send(..., then_release=True)`` (the training thread's send of a small batch,
    made with the GIL held): the call returns while GPU work queued ahead on the stream still
    runs, the slot is released at once but stays out of the pool until the copy behind that
    work has run, and the bytes land exactly; bad targets are refused before anything is
    queued."""
    n = 512 * 1024
    pool = cuda_pool(n, 1)
    data = byte_pattern(n, seed=7)
    side = torch.cuda.Stream()
    target = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    slot = pool.checkout()
    slot.view(torch.uint8, (n,)).copy_(data)
    for bad in (torch.empty(n, dtype=torch.uint8), torch.empty(n - 1, dtype=torch.uint8)):
        with pytest.raises(InvalidArgument):
            slot.send(bad, n, side, then_release=True)
    assert not slot.released, "a refused send releases nothing"
    with torch.cuda.stream(side):
        gpu_sleep(LONG_KERNEL_S)
    t0 = time.perf_counter()
    slot.send(target, n, side.cuda_stream, then_release=True)
    call_s = time.perf_counter() - t0
    assert call_s < LONG_KERNEL_S / 4, call_s
    assert slot.released
    assert pool.try_checkout() is None, "handed out while the copy from it was still queued"
    assert pool.stats()["slots_fenced"] == 1
    again = pool.checkout(timeout=10)  # (back once the fence has passed)
    side.synchronize()
    assert torch.equal(target.cpu(), data)
    again.release()
    assert pool.stats()["slots_checked_out"] == 0


# --------------------------------------------------------------------------- fences


@pytest.mark.parametrize("stream_kind", ["torch.cuda.Stream", "raw int"])
def test_fenced_release_keeps_the_slot_until_the_copy_is_done(
    cuda_pool, gpu_sleep, stream_kind
) -> None:
    n = 32 * MiB
    pool = cuda_pool(n, 1)
    side = torch.cuda.Stream()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()

    slot = pool.checkout()
    host = slot.view(torch.uint8, (n,))
    pattern_a = byte_pattern(n, seed=3)
    host.copy_(pattern_a)
    start, end = timed_events()
    with torch.cuda.stream(side):
        start.record()
        gpu_sleep(LONG_KERNEL_S)
        dev.copy_(host, non_blocking=True)
        end.record()
    del host  # no live view: the release below is not deferred

    slot.release(side if stream_kind == "torch.cuda.Stream" else side.cuda_stream)
    assert slot.released
    # The kernel is still running: the slot is fenced, not free.
    assert pool.try_checkout() is None
    s = pool.stats()
    assert s["slots_fenced"] == 1 and s["slots_free"] == 0

    t0 = time.perf_counter()
    again = pool.checkout(timeout=10)
    waited = time.perf_counter() - t0
    # The slot came back only after everything queued before the fence, copy included.
    assert end.query(), "the slot was handed out before the copy reading it had finished"
    view_b = again.view(torch.uint8, (n,))
    view_b.fill_(0x5A)  # pattern B: would corrupt the copy if it had not finished
    torch.cuda.synchronize()
    gpu_ms = start.elapsed_time(end)
    print(f"checkout waited {waited * 1e3:.1f} ms for a fence; GPU work took {gpu_ms:.1f} ms")
    assert waited * 1e3 >= 0.5 * gpu_ms, (waited, gpu_ms)
    assert waited < 10
    assert checksum(dev) == checksum(pattern_a)
    assert torch.equal(dev.cpu(), pattern_a)
    s = pool.stats()
    assert s["slots_fenced"] == 0
    assert s["fence_errors"] == 0
    assert s["waits"] >= 1
    del view_b
    again.release()


def test_release_without_stream_fences_on_the_current_stream(cuda_pool, gpu_sleep) -> None:
    n = 8 * MiB
    pool = cuda_pool(n, 1)
    side = torch.cuda.Stream()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    slot = pool.checkout()
    host = slot.view(torch.uint8, (n,))
    pattern = byte_pattern(n, seed=4)
    host.copy_(pattern)
    with torch.cuda.stream(side):
        gpu_sleep(LONG_KERNEL_S)
        dev.copy_(host, non_blocking=True)
        del host
        slot.release()  # stream=None: torch's current stream, i.e. `side`
    # A fence on any other (idle) stream would have completed by now.
    time.sleep(0.05)
    assert pool.try_checkout() is None
    assert pool.stats()["slots_fenced"] == 1
    side.synchronize()
    again = pool.checkout(timeout=10)
    assert torch.equal(dev.cpu(), pattern)
    again.release()
    assert pool.stats()["fence_errors"] == 0


def test_dropping_a_slot_fences_on_the_current_stream(cuda_pool, gpu_sleep) -> None:
    n = 8 * MiB
    pool = cuda_pool(n, 1)
    side = torch.cuda.Stream()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    slot = pool.checkout()
    host = slot.view(torch.uint8, (n,))
    pattern = byte_pattern(n, seed=5)
    host.copy_(pattern)
    with torch.cuda.stream(side):
        gpu_sleep(LONG_KERNEL_S)
        dev.copy_(host, non_blocking=True)
        del host, slot  # automatic release, fenced on `side`
    time.sleep(0.05)
    assert pool.try_checkout() is None
    assert pool.stats()["slots_fenced"] == 1
    again = pool.checkout(timeout=10)
    again.view(torch.uint8, (n,)).fill_(0)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), pattern)
    again.release()


def test_an_exception_outlives_the_slots_freed_while_it_propagates(cuda_pool) -> None:
    """A slot released implicitly while Python unwinds an exception (``list()`` of a loader
    that raised frees the batches it had) asks the stream hook for the current stream: the
    exception must come out whole (it once came out as ``SystemError: ... returned NULL
    without setting an exception``)."""
    pool = cuda_pool(MiB, 2)

    def batches() -> Iterator[torch.Tensor]:
        for _ in range(2):
            yield pool.checkout().view(torch.uint8, (16,))
        raise ValueError("the third batch is bad")

    with pytest.raises(ValueError, match="third batch"):
        list(batches())
    gc.collect()
    torch.cuda.synchronize()
    pool.flush()
    assert pool.stats()["slots_checked_out"] == 0


def test_deferred_release_is_fenced_too(cuda_pool, gpu_sleep) -> None:
    """release(stream) with a view alive: the slot returns when the view dies, fenced."""
    n = 8 * MiB
    pool = cuda_pool(n, 1)
    side = torch.cuda.Stream()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    slot = pool.checkout()
    host = slot.view(torch.uint8, (n,))
    pattern = byte_pattern(n, seed=6)
    host.copy_(pattern)
    with torch.cuda.stream(side):
        gpu_sleep(LONG_KERNEL_S)
        dev.copy_(host, non_blocking=True)
    slot.release(side)
    s = pool.stats()
    assert s["slots_checked_out"] == 1, "a live view must defer the release"
    del host
    time.sleep(0.05)
    assert pool.try_checkout() is None, "the deferred release must still be fenced"
    again = pool.checkout(timeout=10)
    again.view(torch.uint8, (n,)).fill_(0xFF)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), pattern)
    again.release()


def test_pipelined_fenced_reuse_never_corrupts(cuda_pool, gpu_sleep) -> None:
    """Many batches through two slots, the GPU lagging behind: every copy sees its own batch."""
    n = 2 * MiB
    pool = cuda_pool(n, 2)
    side = torch.cuda.Stream()
    outs = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(40)]
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        slot = pool.checkout(timeout=10)
        host = slot.view(torch.uint8, (n,))
        host.fill_(i % 251)
        with torch.cuda.stream(side):
            gpu_sleep(0.002)
            out.copy_(host, non_blocking=True)
        del host
        slot.release(side)
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        lo, hi = int(out.min()), int(out.max())
        assert lo == hi == i % 251, f"batch {i} was overwritten before its copy ran"
    s = pool.stats()
    assert s["checkouts"] == s["releases"] == len(outs)
    assert s["fence_errors"] == 0


def test_bad_stream_arguments_are_refused_and_the_slot_stays_out(cuda_pool) -> None:
    pool = cuda_pool(MiB, 1)
    slot = pool.checkout()
    for bad in ("not a stream", -1, 1.5):
        with pytest.raises(InvalidArgument, match="stream"):
            slot.release(stream=bad)
        assert not slot.released
        assert pool.stats()["slots_checked_out"] == 1
    v = slot.view(torch.uint8, (16,))
    v.fill_(3)
    assert checksum(v.to("cuda")) == 48
    del v
    slot.release(torch.cuda.current_stream())
    torch.cuda.synchronize()
    again = pool.checkout(timeout=5)
    again.release()


# A raw int stream is trusted as a live CUstream: the driver dereferences it, and a garbage
# pointer crashes the process (seen on the H200: SIGSEGV inside cuEventRecord). Only its type
# is checked (test_bad_stream_arguments_are_refused_and_the_slot_stays_out).


def test_close_with_a_fenced_slot_does_not_pull_memory_from_under_the_gpu(
    cuda_pool, gpu_sleep
) -> None:
    n = 16 * MiB
    pool = cuda_pool(n, 1)
    side = torch.cuda.Stream()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    slot = pool.checkout()
    host = slot.view(torch.uint8, (n,))
    pattern = byte_pattern(n, seed=7)
    host.copy_(pattern)
    with torch.cuda.stream(side):
        gpu_sleep(LONG_KERNEL_S)
        dev.copy_(host, non_blocking=True)
    del host
    slot.release(side)
    del slot
    pool.close()  # the arena may be freed only once the fenced copy has finished
    assert pool.closed
    torch.cuda.synchronize()  # would raise on an illegal access
    assert torch.equal(dev.cpu(), pattern)


# --------------------------------------------------------------------------- bandwidth


def test_h2d_from_a_slot_is_much_faster_than_from_pageable_memory(cuda_pool) -> None:
    n = 256 * MiB
    pool = cuda_pool(n, 1)
    slot = pool.checkout()
    pinned = slot.view(torch.uint8, (n,))
    pinned.fill_(1)
    pageable = torch.ones(n, dtype=torch.uint8)
    assert pinned.is_pinned()
    assert not pageable.is_pinned()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")

    def best_seconds(src: torch.Tensor, reps: int = 5) -> float:
        dev.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            dev.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    pinned_gbs = n / best_seconds(pinned) / 1e9
    pageable_gbs = n / best_seconds(pageable) / 1e9
    print(f"H2D from a 256 MiB slot: {pinned_gbs:.1f} GB/s; pageable: {pageable_gbs:.1f} GB/s")
    assert checksum(dev) == n
    assert pinned_gbs > 2 * pageable_gbs, (pinned_gbs, pageable_gbs)
    del pinned
    slot.release()
