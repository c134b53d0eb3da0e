"""One loader's pool settings, as one object: built once from the pool's arguments of
``pinpool.DataLoader`` or ``pinpool.pinned`` and passed down whole (to the receiver, the lazy
pool, the delivery), instead of the same keyword list in every signature.

Boundary: ``arguments`` declares and checks each argument alone, and resolves the delivery
mode; this module checks the pool's arguments together (the sizes against each other and
against a pool of the caller's) and keeps what they make.

Invariants: a :class:`PoolSettings` exists only checked (:meth:`PoolSettings.checked` checks
the arguments before it is made: a setting out of range, or sizes given with a pool of the
caller's, raise ``InvalidArgument`` there), and never changes afterwards (frozen); the
public keywords it is built from stay the loaders' own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from ..._errors import InvalidArgument
from ..._native import PinPool
from .arguments import BY_NAME, check_given, cuda_device
from .sizing import Sizing

#: The arguments a pool is made with (``arguments.ARGUMENTS``); ``pinpool.pinned`` takes them
#: too, but for ``arena_bytes`` and ``max_batch_bytes``.
POOL_ARGUMENTS = (
    "pool",
    "arena_bytes",
    "max_batch_bytes",
    "slot_bytes",
    "num_slots",
    "device",
    "copy_threads",
    "slot_timeout",
    "overflow",
    "oversize",
)


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
        given: Mapping[str, Any],
        *,
        in_flight: int = 1,
        default_num_slots: int | None = None,
    ) -> PoolSettings:
        """The settings of ``given``, the pool's arguments of ``pinpool.DataLoader`` or
        ``pinpool.pinned`` by name (those not given: their defaults), checked, each by its
        declaration (``arguments.ARGUMENTS``), then together: ``InvalidArgument`` for sizes
        given with a pool of the caller's. ``in_flight``: batches in flight at once;
        ``default_num_slots``: the slots when ``num_slots`` is not given (None: sized from the
        batches in flight). The pool's device is a given pool's, else the delivery device's,
        else torch's current CUDA device, else None."""
        values = {name: given.get(name, BY_NAME[name].default) for name in POOL_ARGUMENTS}
        check_given(values)
        pool = values["pool"]
        arena_bytes, max_batch_bytes = values["arena_bytes"], values["max_batch_bytes"]
        slot_bytes, num_slots = values["slot_bytes"], values["num_slots"]
        copy_threads, device = values["copy_threads"], values["device"]
        if slot_bytes is not None and (arena_bytes is not None or max_batch_bytes is not None):
            raise InvalidArgument(
                "slot_bytes= (with num_slots=) sizes the arena in equal slots; pass either it or "
                "arena_bytes=/max_batch_bytes=, not both"
            )
        if None not in (arena_bytes, max_batch_bytes) and max_batch_bytes > arena_bytes:
            raise InvalidArgument(
                f"max_batch_bytes ({max_batch_bytes}) is larger than arena_bytes ({arena_bytes})"
            )
        if pool is not None:
            # The pool was made with its own sizes and copy threads: these would change nothing.
            sizes = ("arena_bytes", "max_batch_bytes", "slot_bytes", "num_slots", "copy_threads")
            named = [f"{name}=" for name in sizes if values[name] is not None]
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
            slot_timeout=values["slot_timeout"],
            overflow=values["overflow"],
            oversize=values["oversize"],
        )

    @property
    def known(self) -> bool:
        """Whether the pool can be made before any batch is seen (a pool given, or sizes)."""
        return self.pool is not None or self.sizing.known
