"""One loader's pool settings, as one object: built once from the keywords of
``pinpool.DataLoader`` or ``pinpool.pinned`` and passed down whole (to the receiver, the lazy
pool, the delivery), instead of the same keyword list in every signature.

Invariants: a :class:`PoolSettings` exists only checked (:meth:`PoolSettings.checked` checks
the keywords before it is made: a setting out of range, or sizes given with a pool of the
caller's, raise ``InvalidArgument`` there), and never changes afterwards
(frozen); the public keywords it is built from stay the loaders' own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .._errors import ArgumentTypeError, InvalidArgument
from .._native import PinPool
from .settings import MAX_COPY_THREADS, check_choice, check_int, check_timeout, cuda_device
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
    #: ``"pin"``, ``"copy"`` or ``"error"``: a batch larger than the largest the arena takes.
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
        """The settings of these keywords (``pinpool.DataLoader``'s and ``pinpool.pinned``'s),
        checked: ``InvalidArgument`` for one out of range, or sizes given with a pool of the
        caller's. ``in_flight``: batches in flight at once; ``default_num_slots``: the slots
        when ``num_slots`` is not given (None: sized from the batches in flight). The pool's
        device is a given pool's, else the delivery device's, else torch's current CUDA
        device, else None."""
        if pool is not None and not isinstance(pool, PinPool):
            raise ArgumentTypeError(
                f"pool must be a pinpool.PinPool or None, not {pool!r} ({type(pool).__name__})"
            )
        check_choice("overflow", overflow, ("copy", "wait"))
        check_choice("oversize", oversize, ("pin", "copy", "error"))
        check_int("num_slots", num_slots, 1, 1 << 20, none_ok=True)
        check_int("slot_bytes", slot_bytes, 1, 1 << 50, none_ok=True)
        check_int("arena_bytes", arena_bytes, 1, 1 << 50, none_ok=True)
        check_int("max_batch_bytes", max_batch_bytes, 1, 1 << 50, none_ok=True)
        if slot_bytes is not None and (arena_bytes is not None or max_batch_bytes is not None):
            raise InvalidArgument(
                "slot_bytes= (with num_slots=) sizes the arena in equal slots; pass either it or "
                "arena_bytes=/max_batch_bytes=, not both"
            )
        if None not in (arena_bytes, max_batch_bytes) and max_batch_bytes > arena_bytes:
            raise InvalidArgument(
                f"max_batch_bytes ({max_batch_bytes}) is larger than arena_bytes ({arena_bytes})"
            )
        check_int("copy_threads", copy_threads, 1, MAX_COPY_THREADS, none_ok=True)
        check_timeout("slot_timeout", slot_timeout)
        if pool is not None:
            # The pool was made with its own sizes and copy threads: these would change nothing.
            given = {
                "arena_bytes": arena_bytes,
                "max_batch_bytes": max_batch_bytes,
                "slot_bytes": slot_bytes,
                "num_slots": num_slots,
                "copy_threads": copy_threads,
            }
            named = [f"{name}=" for name, value in given.items() if value is not None]
            if named:
                raise InvalidArgument(
                    f"{', '.join(named)} cannot apply with pool=: a pool of your own keeps the "
                    "sizes and copy threads it was made with; pass them to PinPool(...) instead"
                )
        out_device = cuda_device(device)
        if pool is not None:
            pool_device = pool.device
        elif out_device is not None:
            pool_device = out_device.index
        elif torch.cuda.is_available():
            pool_device = torch.cuda.current_device()
        else:
            pool_device = None
        sizing = Sizing(
            arena_bytes=arena_bytes,
            max_batch_bytes=max_batch_bytes,
            slot_bytes=slot_bytes,
            num_slots=num_slots if num_slots is not None else default_num_slots,
            in_flight=in_flight,
        )
        sizing.check()  # (an arena over the memory available: NotEnoughMemory, now)
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
