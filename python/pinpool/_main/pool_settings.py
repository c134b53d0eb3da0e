"""One loader's pool settings, as one object: built once from the keywords of
``pinpool.DataLoader`` or ``pinpool.pinned`` and passed down whole (to the receiver, the lazy
pool, the delivery), instead of the same keyword list in every signature.

Invariants: a :class:`PoolSettings` exists only checked (:meth:`PoolSettings.checked` runs
``settings.check_pool_settings`` before it is made: a setting out of range, or sizes given
with a pool of the caller's, raise ``InvalidArgument`` there), and never changes afterwards
(frozen); the public keywords it is built from stay the loaders' own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .._native import PinPool
from . import settings
from .sizing import Sizing


@dataclasses.dataclass(frozen=True)
class PoolSettings:
    """What a loader's pool is made with, and what its claims and deliveries follow."""

    #: A pool of the caller's (None: the loader makes its own, sized by ``sizing``).
    pool: PinPool | None
    #: The arena's sizes, as given, and the batches in flight.
    sizing: Sizing
    #: The CUDA device batches are delivered on (None: pinned CPU batches).
    device: torch.device | None
    #: The device the pool's memory is pinned for (None: no CUDA device; host memory).
    pool_device: int | None
    #: The pool's copy threads (None: its default).
    copy_threads: int | None
    #: How long a claim waits for a slot with ``overflow="wait"`` (None: forever).
    slot_timeout: float | None
    #: ``"copy"`` or ``"wait"``: a batch that finds the arena held by live batches.
    overflow: str
    #: ``"error"`` or ``"copy"``: a batch larger than the largest the arena takes.
    oversize: str

    @classmethod
    def checked(
        cls,
        *,
        pool: PinPool | None,
        arena_bytes: Any = None,
        max_batch_bytes: Any = None,
        slot_bytes: Any,
        num_slots: Any,
        copy_threads: Any,
        slot_timeout: Any,
        overflow: Any,
        oversize: Any,
        device: Any,
        in_flight: int = 1,
        default_num_slots: int | None = None,
    ) -> PoolSettings:
        """The settings of these keywords, checked (``settings.check_pool_settings``).
        ``in_flight``: batches in flight at once; ``default_num_slots``: the slots when
        ``num_slots`` is not given (None: sized from the batches in flight)."""
        out_device, pool_device = settings.check_pool_settings(
            pool=pool,
            arena_bytes=arena_bytes,
            max_batch_bytes=max_batch_bytes,
            slot_bytes=slot_bytes,
            num_slots=num_slots,
            copy_threads=copy_threads,
            slot_timeout=slot_timeout,
            overflow=overflow,
            oversize=oversize,
            device=device,
        )
        sizing = Sizing(
            arena_bytes=arena_bytes,
            max_batch_bytes=max_batch_bytes,
            slot_bytes=slot_bytes,
            num_slots=num_slots if num_slots is not None else default_num_slots,
            in_flight=in_flight,
        )
        return cls(
            pool=pool,
            sizing=sizing,
            device=out_device,
            pool_device=pool_device,
            copy_threads=copy_threads,
            slot_timeout=slot_timeout,
            overflow=overflow,
            oversize=oversize,
        )

    @property
    def known(self) -> bool:
        """Whether the pool can be made before any batch is seen (a pool given, or sizes)."""
        return self.pool is not None or self.sizing.known
