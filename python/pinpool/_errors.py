"""The exceptions pinpool raises. The Rust core maps each of its errors onto one of these."""

from __future__ import annotations


class PinPoolError(Exception):
    """Base class of every pinpool error."""


class PoolExhausted(PinPoolError, TimeoutError):
    """No slot became free before the timeout."""


class PoolClosed(PinPoolError):
    """The pool was closed."""


class SlotReleased(PinPoolError):
    """The slot was already released; the handle can no longer be used."""


class BatchTooLarge(PinPoolError, ValueError):
    """A batch needs more bytes than one slot holds."""

    def __init__(self, message: str, needed: int = 0, slot_bytes: int = 0) -> None:
        super().__init__(message)
        self.needed = needed
        self.slot_bytes = slot_bytes


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


class OutOfBounds(PinPoolError, ValueError):
    """A byte range lies outside the memory it names (a corrupt or hostile description)."""
