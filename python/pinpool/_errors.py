"""The exceptions pinpool raises. The Rust core maps each of its errors onto one of these."""

from __future__ import annotations

import re


class PinPoolError(Exception):
    """Base class of every pinpool error."""


class PoolExhausted(PinPoolError, TimeoutError):
    """No slot became free before the timeout."""


class PoolClosed(PinPoolError):
    """The pool was closed."""


class SlotReleased(PinPoolError):
    """The slot was already released; the handle can no longer be used."""


class BatchTooLarge(PinPoolError, ValueError):
    """A batch needs more bytes than one slot holds (``needed``, ``slot_bytes``)."""

    def __init__(
        self, message: str, needed: int | None = None, slot_bytes: int | None = None
    ) -> None:
        super().__init__(message)
        if needed is None or slot_bytes is None:
            # Rebuilt from its message alone (torch re-raises a pin-thread error that way).
            found = _SIZES.search(message)
            needed, slot_bytes = (int(found[1]), int(found[2])) if found else (0, 0)
        self.needed = needed
        self.slot_bytes = slot_bytes


_SIZES = re.compile(r"needs (\d+) bytes but (?:a slot holds|the pool's slots hold) (\d+)")


class CudaError(PinPoolError):
    """A CUDA driver call failed; ``name`` is the driver's error name."""

    def __init__(self, message: str, name: str = "", code: int = 0) -> None:
        super().__init__(message)
        self.name = name
        self.code = code


class WorkerLost(PinPoolError, RuntimeError):
    """A DataLoader worker exited before the main process could take its batch."""


class InvalidArgument(PinPoolError, ValueError):
    """An argument makes no sense (zero sizes, unknown backend, ...)."""


class ArgumentTypeError(InvalidArgument, TypeError):
    """An argument of the wrong type (a string where a size goes): an ``InvalidArgument`` that
    is also the ``TypeError`` Python raises for one."""


class NotEnoughMemory(PinPoolError, MemoryError):
    """More memory was asked for (an arena, by its sizes) than this process may take."""


class OutOfBounds(PinPoolError, ValueError):
    """A byte range lies outside the memory it names (a corrupt or hostile description)."""
