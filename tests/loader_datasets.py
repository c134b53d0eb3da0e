"""Datasets, collate functions and namedtuples for the DataLoader tests.

They live in an importable module (not in the test files) so that workers started with
``spawn`` or ``forkserver`` can unpickle them.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import struct
import sys
import time
import weakref
from collections import namedtuple
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


def array_leaves(x: Any) -> list[Any]:
    """Every tensor and numpy array in a batch (dicts, lists and tuples walked)."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return [x]
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in array_leaves(v)]
    if isinstance(x, (list, tuple)):
        return [leaf for v in x for leaf in array_leaves(v)]
    return []


def in_pool(pool: Any, leaf: Any) -> bool:
    """Whether an array's bytes lie in the pool's arena (False without a pool)."""
    if pool is None:
        return False
    if isinstance(leaf, torch.Tensor):
        start = leaf.untyped_storage().data_ptr()
    else:
        start = leaf.__array_interface__["data"][0]
    return bool(pool.address <= start < pool.address + pool.arena_bytes)


#: Namedtuples a generated batch may contain (module level, so they pickle).
Pair = namedtuple("Pair", ["x", "y"])
Record = namedtuple("Record", ["a", "b", "c"])


class ListDataset(Dataset):
    """Map-style: sample ``i`` is ``items[i]``, whatever it is."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


def keep_samples(samples: Any) -> Any:
    """A custom collate_fn that keeps the samples as they are (numpy arrays, strided views,
    None ...) inside a small dict."""
    return {"samples": samples, "meta": Pair(b"meta", None)}


def indices_only(samples: list[dict[str, Any]]) -> list[int]:
    """A ``collate_fn`` whose batch is only its samples' indices (no tensor to pin)."""
    return [int(s["idx"]) for s in samples]


def sum_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A custom collate_fn for :class:`Indexed` samples that does its own arithmetic."""
    return {
        "idx": torch.tensor([s["idx"] for s in samples]),
        "total": torch.stack([s["x"] for s in samples]).sum(0),
        "names": [s["name"] for s in samples],
    }


def fill(shape: tuple[int, ...], value: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full(shape, value, dtype=dtype)


class Indexed(Dataset):
    """Sample ``i``: its index, a tensor filled with ``i``, a name (and, with ``pid``, the
    pid of the process that made it)."""

    def __init__(self, n: int, shape: tuple[int, ...] = (3, 4), pid: bool = False) -> None:
        self.n = n
        self.shape = shape
        self.pid = pid

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        out = {"idx": i, "x": fill(self.shape, i), "name": f"s{i}"}
        if self.pid:
            out["pid"] = os.getpid()
        return out


class ShardedRange(IterableDataset):
    """Iterable: yields :class:`Indexed`-like samples for ``range(n)``, each worker taking
    every ``num_workers``-th index (sharded with ``get_worker_info``)."""

    def __init__(self, n: int, shape: tuple[int, ...] = (2, 3)) -> None:
        self.n = n
        self.shape = shape

    def __iter__(self) -> Any:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield {"idx": i, "x": fill(self.shape, i), "name": f"s{i}"}


class Sized(Dataset):
    """Sample ``i`` is a uint8 tensor of ``sizes[i]`` bytes filled with ``i % 251``.

    ``sleep`` maps an index to seconds to sleep before returning it."""

    def __init__(self, sizes: list[int], sleep: dict[int, float] | None = None) -> None:
        self.sizes = sizes
        self.sleep = sleep or {}

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in self.sleep:
            time.sleep(self.sleep[i])
        return torch.full((self.sizes[i],), i % 251, dtype=torch.uint8)


class Failing(Indexed):
    """Raises ``ValueError`` for index ``bad``."""

    def __init__(self, n: int, bad: int, shape: tuple[int, ...] = (3, 4)) -> None:
        super().__init__(n, shape)
        self.bad = bad

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.bad:
            raise ValueError(f"sample {i} is broken on purpose")
        return super().__getitem__(i)


class Tracked(Dataset):
    """Sample ``i``: a 64 KiB float32 tensor filled with ``i`` and how many tensors this
    dataset made earlier are still alive in this process as ``i`` is made (``alive``).
    With streaming collation the count stays 0: a sample's tensor is freed before the next
    sample is made. A ``worker_init_fn`` may set ``tag``, which every sample carries."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.live = 0
        self.tag = "main"

    def __len__(self) -> int:
        return self.n

    def _died(self) -> None:
        self.live -= 1

    def __getitem__(self, i: int) -> dict[str, Any]:
        alive = self.live
        x = fill((128, 128), i)
        self.live += 1
        weakref.finalize(x, self._died)
        return {"x": x, "alive": alive, "tag": self.tag}


def tag_worker(worker_id: int) -> None:
    """A ``worker_init_fn`` that sets an attribute on the worker's dataset, as h5py users
    open their files."""
    info = get_worker_info()
    assert info is not None
    info.dataset.tag = f"worker {worker_id}"


def worker_result_queue() -> Any:
    """In a DataLoader worker: torch's result queue (from its worker loop's frame)."""
    frame = sys._getframe()
    while frame is not None and frame.f_code.co_name != "_worker_loop":
        frame = frame.f_back
    return frame.f_locals.get("data_queue") if frame is not None else None


def flush_results() -> None:
    """In a DataLoader worker: returns once every batch the worker has put on torch's result
    queue is written to the queue's pipe (the queue is closed, its feeder thread joined).

    A worker killed while that thread writes leaves the queue's write lock held for good, by
    a process that no longer exists; torch's own shutdown, which puts a message on that
    queue in the main process (with a pin-memory thread), then leaves its feeder thread (and
    the queue's pipe) waiting on the lock forever, whatever loader it is. Tests that kill a
    worker call this first, so that what they count does not depend on that timing."""
    queue = worker_result_queue()
    if queue is not None:
        queue.close()
        queue.join_thread()


class Killing(Indexed):
    """Kills its own worker process with SIGKILL at index ``bad`` (never in the main
    process), once the batches it sent before are out of its queue (:func:`flush_results`)."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.bad and get_worker_info() is not None:
            flush_results()
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        return super().__getitem__(i)


class Dying(Indexed):
    """Its worker dies at index ``bad`` (never in the main process), ``how``: ``"kill"``
    (SIGKILL), ``"exit"`` (``os._exit(3)``, torch's "exited unexpectedly") or ``"raise"``
    (a ``ValueError``, which torch hands to the consumer; the worker lives on). Before a kill
    or an exit, the batches the worker sent are out of its queue (:func:`flush_results`),
    and ``stamp``, if given, is a file the worker writes ``time.monotonic()`` to: when it
    died."""

    def __init__(self, n: int, bad: int, how: str, stamp: str | None = None) -> None:
        super().__init__(n)
        self.bad = bad
        self.how = how
        self.stamp = stamp

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.bad and get_worker_info() is not None:
            if self.how == "raise":
                raise ValueError(f"sample {i} is broken on purpose")
            flush_results()
            if self.stamp is not None:
                with open(self.stamp, "w") as f:
                    f.write(repr(time.monotonic()))
            if self.how == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        return super().__getitem__(i)


class DiesHoldingTheResultLock(Indexed):
    """Its worker dies at index ``bad`` as a worker killed while its result queue's feeder
    thread writes would: holding that queue's write lock (see :func:`flush_results`)."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.bad and get_worker_info() is not None:
            flush_results()
            worker_result_queue()._wlock.acquire()
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        return super().__getitem__(i)


class Exiting(Sized):
    """:class:`Sized`, except that its worker process exits quietly (status 0) at index
    ``bad``, once the batches it sent before are out of its queue (:func:`flush_results`)."""

    def __init__(self, sizes: list[int], bad: int) -> None:
        super().__init__(sizes)
        self.bad = bad

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad and get_worker_info() is not None:
            flush_results()
            os._exit(0)
        return super().__getitem__(i)


class Paced(Indexed):
    """Takes ``seconds`` for every sample."""

    def __init__(self, n: int, shape: tuple[int, ...], seconds: float) -> None:
        super().__init__(n, shape)
        self.seconds = seconds

    def __getitem__(self, i: int) -> dict[str, Any]:
        time.sleep(self.seconds)
        return super().__getitem__(i)


class Lopsided(Dataset):
    """A big array and many small ones (more bytes than the big one), ``seconds`` a sample."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n = n
        self.seconds = seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        time.sleep(self.seconds)
        small = [torch.full((2048,), float(i + k)) for k in range(40)]  # 40 x 8 KiB
        return {"idx": i, "big": fill((128, 128), i), "small": small}


class Sleepy(Indexed):
    """Sleeps ``seconds`` at index ``slow``."""

    def __init__(self, n: int, slow: int, seconds: float) -> None:
        super().__init__(n)
        self.slow = slow
        self.seconds = seconds

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.slow:
            time.sleep(self.seconds)
        return super().__getitem__(i)


class NumpyMix(Dataset):
    """Sample ``i``: a numpy array, a numpy scalar and a torch tensor (for small smoke
    tests of the worker start methods)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Pair:
        a = np.arange(12, dtype=np.int16).reshape(3, 4) * i
        return Pair(x=a.T, y={"s": np.float32(i) / 3, "t": torch.arange(5) + i})


# --------------------------------------------------------------------------- generated data

TORCH_DTYPES = [
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
]
NUMPY_DTYPES = [d for d in TORCH_DTYPES if d != "bfloat16"]


def make_array(lib: str, dtype: str, shape: tuple[int, ...], layout: str, rng: Any) -> Any:
    """Random contents (every bit pattern, NaNs included; 0/1 for bool) in ``layout``."""
    base_shape = shape
    if layout == "transposed":
        base_shape = shape[::-1]
    elif layout == "strided" and shape:
        base_shape = (*shape[:-1], max(0, 2 * shape[-1] - 1))
    count = math.prod(base_shape)
    if dtype == "bool":
        arr = rng.integers(0, 2, count).astype(np.bool_)
    else:
        np_dtype = np.dtype("uint16" if dtype == "bfloat16" else dtype)
        arr = np.frombuffer(rng.bytes(count * np_dtype.itemsize), dtype=np_dtype).copy()
    arr = arr.reshape(base_shape)
    x: Any = arr
    if lib == "torch":
        x = torch.from_numpy(arr)
        if dtype == "bfloat16":
            x = x.view(torch.bfloat16)
    if layout == "transposed":
        x = x.permute(tuple(reversed(range(x.ndim)))) if lib == "torch" else x.transpose()
    elif layout == "strided" and shape:
        x = x[..., ::2]
    elif layout == "reversed" and shape:
        x = x[::-1]
    return x


# --------------------------------------------------------------------------- comparing


def raw_bytes(x: torch.Tensor | np.ndarray) -> bytes:
    """The logical contents of an array as bytes (C order; NaN payloads included)."""
    if isinstance(x, np.ndarray):
        return x.tobytes()
    if x.numel() == 0:
        return b""
    dense = torch.empty(x.shape, dtype=x.dtype).copy_(x.detach())  # a bitwise copy
    return dense.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(ref: Any, got: Any, path: str = "batch") -> None:
    """``got`` has the structure, types, dtypes, shapes and bytes of ``ref``."""
    assert type(got) is type(ref), f"{path}: {type(got).__name__} != {type(ref).__name__}"
    if isinstance(ref, torch.Tensor):
        assert got.dtype == ref.dtype, f"{path}: dtype {got.dtype} != {ref.dtype}"
        assert got.shape == ref.shape, f"{path}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
        assert raw_bytes(got) == raw_bytes(ref), f"{path}: bytes differ"
    elif isinstance(ref, np.ndarray):
        assert got.dtype.str == ref.dtype.str, f"{path}: dtype {got.dtype.str} != {ref.dtype.str}"
        assert got.shape == ref.shape, f"{path}: shape {got.shape} != {ref.shape}"
        assert raw_bytes(got) == raw_bytes(ref), f"{path}: bytes differ"
    elif isinstance(ref, float):
        assert struct.pack("<d", got) == struct.pack("<d", ref), f"{path}: {got!r} != {ref!r}"
    elif isinstance(ref, dict):
        assert list(got) == list(ref), f"{path}: keys {list(got)} != {list(ref)}"
        for k in ref:
            assert_same(ref[k], got[k], f"{path}[{k!r}]")
    elif isinstance(ref, (list, tuple)):
        assert len(got) == len(ref), f"{path}: length {len(got)} != {len(ref)}"
        for i, (r, g) in enumerate(zip(ref, got, strict=True)):
            assert_same(r, g, f"{path}[{i}]")
    else:
        assert got == ref, f"{path}: {got!r} != {ref!r}"


class ReadyBatches(Dataset):
    """A map-style dataset whose ``__getitems__`` returns a whole batch (torch passes whatever
    it returns to collate unchanged): a dict of stacked tensors, or one tensor."""

    def __init__(self, n: int, kind: str) -> None:
        self.n = n
        self.kind = kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        raise AssertionError("__getitems__ is used for every batch")

    def __getitems__(self, indices: list[int]) -> Any:
        x = torch.stack([fill((64, 64), i) for i in indices])  # 16 KiB per sample
        i = torch.tensor(indices)
        return {"x": x, "i": i} if self.kind == "dict" else x


def ready_batch(batch: Any) -> Any:
    """A collate function that keeps what the dataset made (it is already a batch)."""
    return batch


def _reachable(addr: int) -> bool:
    """Whether this thread can touch the byte at ``addr`` now: the page's protection and, where
    the machine has memory protection keys, this thread's rights to the page's key (a window
    kept writable under its key between batches is out of reach but while its worker writes).
    The kernel reads the byte for this thread (``write`` to a pipe), failing instead of
    faulting; nothing is changed."""
    libc = ctypes.CDLL(None, use_errno=True)
    r, w = os.pipe()
    try:
        return int(libc.write(w, ctypes.c_void_p(addr), 1)) == 1
    finally:
        os.close(r)
        os.close(w)


def arena_reach() -> tuple[int, int]:
    """What this process can reach of a pinpool arena right now: the bytes it has mapped
    writable and shared from one (and that this thread can touch), and the descriptors it
    holds of one."""
    mapped = 0
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "pinpool-arena" in fields[5] and fields[1][1] == "w":
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if fields[1][3] == "s" and _reachable(lo):
                    mapped += hi - lo
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += "pinpool-arena" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # (the listing's own descriptor, closed by now)
    return mapped, fds


class ArenaWatcher(Dataset):
    """Each sample is ``[index, arena bytes mapped, arena descriptors]`` as its worker saw
    them while making it (an earlier batch of this worker's is written by then)."""

    def __init__(self, n: int, pad: int = 16384) -> None:
        self.n, self.pad = n, pad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        mapped, fds = arena_reach()
        return {"seen": torch.tensor([i, mapped, fds]), "pad": torch.zeros(self.pad)}
