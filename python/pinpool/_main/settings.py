"""A loader's settings: checked when the loader is made (not at the first batch, where an
error would come out of the middle of an epoch), and their defaults.

Invariants: a setting out of range raises ``InvalidArgument`` here; a setting given that
cannot apply to the loader it was given to never does nothing silently: one that contradicts
another (sizes given with a pool of the caller's) raises, one that only has nothing to act on
in this loader (``zero_copy=True`` without workers) is named by :func:`ignored`, whose
reasons the loader warns about once.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .._errors import ArgumentTypeError, InvalidArgument

#: The most copy threads a pool or a worker may have (the Rust core's limit).
MAX_COPY_THREADS = 64


def check_int(name: str, value: Any, low: int, high: int, none_ok: bool = False) -> None:
    """Raises InvalidArgument unless ``value`` is an int from ``low`` to ``high`` (or None):
    ``ArgumentTypeError`` (also a ``TypeError``) for one that is not an int."""
    if value is None and none_ok:
        return
    wanted = f"{name} must be an integer from {low} to {high}, not {value!r}"
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentTypeError(wanted)
    if not low <= value <= high:
        raise InvalidArgument(wanted)


def check_bool(name: str, value: Any, none_ok: bool = False) -> None:
    """Raises InvalidArgument unless ``value`` is True or False (or None): a string such as
    ``"false"`` is not taken for one."""
    if value is None and none_ok:
        return
    if not isinstance(value, bool):
        allowed = "True, False or None" if none_ok else "True or False"
        raise ArgumentTypeError(f"{name} must be {allowed}, not {value!r}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InvalidArgument(
            f"{name} must be {' or '.join(repr(c) for c in choices)}, not {value!r}"
        )


def check_timeout(name: str, value: Any) -> None:
    wanted = f"{name} must be None or a non-negative number, not {value!r}"
    if value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ArgumentTypeError(wanted)
    if not 0 <= value < float("inf"):
        raise InvalidArgument(wanted)


def cuda_device(device: Any) -> torch.device | None:
    """The CUDA device batches are delivered on (None: pinned CPU batches)."""
    if device is None:
        return None
    wanted = "None, 'cpu', 'cuda', 'cuda:N', an int or a torch.device"
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise ArgumentTypeError(f"device must be {wanted}, not {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidArgument(f"device must be {wanted}, not {device!r}: {exc}") from None
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise InvalidArgument(f"device must be None, 'cpu' or a CUDA device, not {device!r}")
    if not torch.cuda.is_available():
        raise InvalidArgument(
            f"device={device!r} was asked for, but torch sees no CUDA device: device=None "
            "(the default) gives pinned CPU batches, in host memory where there is no GPU"
        )
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


def worker_copy_threads(asked: int | None, num_workers: int) -> int:
    """Copy threads per worker: as asked, else ``$PINPOOL_WORKER_COPY_THREADS``, else the
    cores this process may use per worker, from 2 to 4 (a worker copies for only part of
    its time: on the H200, 2 per worker with 8 and with 14 workers on 16 cores was the best
    or near the best of 1 to 4, see ``benchmarks/results/h200-worker-threads``)."""
    if asked is None:
        env = os.environ.get("PINPOOL_WORKER_COPY_THREADS")
        if env:
            try:
                asked = int(env)
            except ValueError:
                raise InvalidArgument(
                    f"PINPOOL_WORKER_COPY_THREADS must be an integer, not {env!r}"
                ) from None
        else:
            # Under torchrun (or Lightning, accelerate), LOCAL_WORLD_SIZE ranks share the
            # host's cores, each with its own workers.
            ranks = local_world_size()
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
            floor = 2 if ranks == 1 else 1
            asked = min(4, max(floor, cores // ranks // max(1, num_workers)))
    check_int("worker_copy_threads", asked, 1, MAX_COPY_THREADS)
    return asked


def local_world_size() -> int:
    """How many data-parallel ranks share this host: ``$LOCAL_WORLD_SIZE`` (set by torchrun,
    and by Lightning and accelerate on top of it), else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def ignored(
    *,
    dataset: Any,
    num_workers: int,
    auto_collation: bool,
    collate_fn: Any,
    pool: Any,
    zero_copy: bool,
    stream_samples: bool | None,
    worker_copy_threads: int | None,
    pin_memory: bool,
    pin_memory_device: str,
) -> list[str]:
    """What the settings given to ``pinpool.DataLoader`` would not do in this loader, each
    with why (empty: every setting given applies). Defaults are never named: only a value the
    caller chose (``stream_samples=True``, not the default None, which means "where it
    applies")."""
    out = []
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    if zero_copy:
        why = None
        if num_workers == 0:
            why = "num_workers=0 (the batches are made in this process)"
        elif iterable:
            why = "an IterableDataset (its batches' indices are not drawn here)"
        elif not auto_collation:
            why = "batch_size=None (no batches to hand places out with)"
        elif pool is not None and pool.backend == "cuda-hostalloc":
            why = "a pool with backend='cuda-hostalloc' (workers cannot map it)"
        if why is not None:
            out.append(
                f"zero_copy=True does nothing with {why}: every batch is copied into the "
                "arena as with zero_copy=False; zero-copy needs a map-style dataset with "
                "batching, num_workers > 0 and a memfd arena"
            )
    if stream_samples:
        why = None
        if num_workers == 0:
            why = "num_workers=0"
        elif iterable:
            why = "an IterableDataset"
        elif collate_fn is not None:
            why = "a collate_fn of your own (streaming collates as torch's default_collate)"
        elif not auto_collation:
            why = "batch_size=None"
        if why is not None:
            out.append(
                f"stream_samples=True does nothing with {why}: samples are made first and "
                "collated after"
            )
    if worker_copy_threads is not None and num_workers == 0:
        out.append(
            f"worker_copy_threads={worker_copy_threads} does nothing with num_workers=0: "
            "there are no workers (copy_threads= sets this process's copy threads)"
        )
    if not pin_memory and torch.accelerator.is_available():
        out.append(
            "pin_memory=False is not followed: pinpool.DataLoader's batches are always in its "
            "pinned arena (torch's DataLoader gives unpinned batches)"
        )
    if pin_memory_device:
        out.append(
            f"pin_memory_device={pin_memory_device!r} does nothing (torch deprecated it): "
            "batches are pinned for the pool's device, device= or torch's current device"
        )
    return out
