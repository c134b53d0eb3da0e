"""pinpool: a fixed arena of CUDA pinned host memory, cut into slots handed out without the GIL.

>>> import pinpool
>>> pool = pinpool.PinPool(slot_bytes=1 << 20, num_slots=4, device="cpu")
>>> with pool.checkout() as slot:
...     slot.view("uint8", (16,)).fill_(7)

The low-level transport the DataLoader is built on is public too: ``WorkerSegment`` (a
producer writes a batch into it), ``SegmentCache`` (the consumer maps producers' segments and
copies from them into slots, there and then, on a copy thread (``Copying``) or on to a GPU
(``Sent``)), ``check_segment`` and ``SEGMENT_DATA_OFFSET``.

See README.md, and docs/ for the user guide, the design and the measurements.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

from . import _accelerate, _cuda_stream, _native, _torch_versions
from . import trace as trace  # (pinpool.trace: the hook probes read, pure Python)
from ._errors import (
    BatchTooLarge,
    CudaError,
    InvalidArgument,
    NotEnoughMemory,
    OutOfBounds,
    PinPoolError,
    PoolClosed,
    PoolExhausted,
    SlotReleased,
    WorkerLost,
)
from ._main.epochs.ending_thread import wait_for_freed_pools
from ._native import (
    SEGMENT_DATA_OFFSET,
    Copying,
    PinPool,
    SegmentCache,
    Sent,
    Slot,
    WorkerSegment,
    check_segment,
    cuda_available,
    page_size,
)
from ._stats import LoaderStats, PoolStats

if TYPE_CHECKING:
    from ._accelerate.shard import prepare
    from .adapter import Pinned, pinned
    from .loader import DataLoader

_native._set_stream_hook(_cuda_stream.current_stream)

# A library's logger: silent unless the application configures logging.
logging.getLogger("pinpool").addHandler(logging.NullHandler())

# accelerate's prepare() keeps a pinpool loader's pool: its data_loader module is patched now
# if imported, else as it is imported (pinpool._accelerate; PINPOOL_ACCELERATE_HOOK=0: not).
_accelerate.install()

__version__ = "0.1.0"

__all__ = [
    "SEGMENT_DATA_OFFSET",
    "BatchTooLarge",
    "Copying",
    "CudaError",
    "DataLoader",
    "InvalidArgument",
    "LoaderStats",
    "NotEnoughMemory",
    "OutOfBounds",
    "PinPool",
    "PinPoolError",
    "Pinned",
    "PoolClosed",
    "PoolExhausted",
    "PoolStats",
    "SegmentCache",
    "Sent",
    "Slot",
    "SlotReleased",
    "WorkerLost",
    "WorkerSegment",
    "check_segment",
    "cuda_available",
    "page_size",
    "pinned",
    "prepare",
    "wait_for_freed_pools",
]


def __getattr__(name: str) -> Any:
    # The DataLoader, pinned() and prepare() need torch; importing pinpool alone must not.
    if name in ("DataLoader", "pinned", "Pinned", "prepare"):
        try:
            import torch  # noqa: F401
        except ModuleNotFoundError as exc:
            raise ImportError(
                f"pinpool.{name} needs PyTorch: pip install '{_torch_versions.requirement()}' "
                "(the pool itself, pinpool.PinPool, works without it)"
            ) from exc
        if name == "DataLoader":
            from .loader import DataLoader

            return DataLoader
        if name == "prepare":
            from ._accelerate.shard import prepare

            return prepare
        from . import adapter

        return getattr(adapter, name)
    if name == "wait_for_releases":
        # wait_for_freed_pools' earlier name, kept for code written against it.
        warnings.warn(
            "pinpool.wait_for_releases is now pinpool.wait_for_freed_pools",
            DeprecationWarning,
            stacklevel=2,
        )
        return wait_for_freed_pools
    raise AttributeError(f"module 'pinpool' has no attribute {name!r}")
