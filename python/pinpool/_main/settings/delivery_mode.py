"""A loader's delivery mode: who writes each batch into the arena (its worker, zero-copy; or
the main process's copy threads, copy mode), where the consumer gets it (pinned CPU views or a
CUDA device), and whether torch's pin thread runs ahead of the consumer. Resolved once, when
the loader is made (:meth:`DeliveryMode.resolve`, from the checked arguments and the
machine), and dispatched on by the receiver and the delivery: a new mode is a new case here.

Invariants: a mode is frozen; zero-copy only where it applies (a map-style dataset with
batching and workers); the adapter's batches (``pinpool.pinned``) are always copy mode.
"""

from __future__ import annotations

import dataclasses

import torch

from .arguments import Shape


@dataclasses.dataclass(frozen=True)
class DeliveryMode:
    """How a loader's batches reach the consumer: resolved once, from the arguments and the
    machine (:meth:`resolve`), and passed down to the receiver, the delivery and the workers'
    iterator, which dispatch on it (a new mode is a new case here, and where it differs).

    Two choices, each of two ways: who writes a batch into the arena (its worker, straight
    into a slot granted to it: zero-copy; or the main process's copy threads, from the
    worker's segment: copy), and where the consumer gets it (pinned CPU views into the arena,
    or on a CUDA device). Beside them, whether torch's pin step runs ahead of the consumer
    (its pin thread, with workers; where an accelerator is present), or the consumer's thread
    takes the batches itself, in turn (reading the result queue: ``results``)."""

    #: Workers write batches straight into arena slots granted to them (``zero_copy=True``,
    #: where it applies: a map-style dataset with batching and workers).
    zero_copy: bool
    #: The CUDA device batches are delivered on (None: pinned CPU batches).
    device: torch.device | None
    #: torch's pin step runs ahead of the consumer (an accelerator is present).
    pin_thread: bool

    @classmethod
    def resolve(cls, *, zero_copy: bool, device: torch.device | None, shape: Shape) -> DeliveryMode:
        """The mode of a loader of ``shape`` given ``zero_copy`` (checked) and ``device``
        (checked: ``cuda_device``), on this machine."""
        return cls(
            zero_copy=bool(zero_copy) and shape.batched_map_style,
            device=device,
            pin_thread=bool(torch.accelerator.is_available()),
        )

    @property
    def main_process_copies(self) -> bool:
        """Whether the main process copies each batch into the arena, out of its worker's
        segment (copy mode; in zero-copy mode, only batches that got no grant)."""
        return not self.zero_copy

    @property
    def on_device(self) -> bool:
        """Whether batches are delivered on a CUDA device (else as pinned CPU views)."""
        return self.device is not None


def copy_mode(device: torch.device | None) -> DeliveryMode:
    """The mode of batches copied in on the iterating thread (``pinpool.pinned``)."""
    return DeliveryMode(zero_copy=False, device=device, pin_thread=False)
