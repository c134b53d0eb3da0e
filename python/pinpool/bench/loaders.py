"""The loaders under comparison, and how each one's batches reach the device.

A loader is one line in :data:`LOADERS`: its name, its class, the keyword arguments that set
it apart, and how the consumer moves its batches (``"to"``: ``.to(device)``; ``"to_async"``:
``.to(device, non_blocking=True)``; ``"none"``: the batch is already there). A loader whose
constructor rejects one of its keyword arguments (a feature this pinpool build does not have
yet) is skipped with a note, as is one that needs CUDA on a machine without it. On such a
machine :data:`DEVICE` stands for None (pinned CPU batches).
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.data

from .workloads import MadeAndDropped, move

#: Stands for the run's CUDA device (None on a host-only run) in a loader's keyword arguments.
DEVICE = "<device>"


@dataclass(frozen=True)
class LoaderSpec:
    """One loader under comparison."""

    name: str
    kind: str  # "torch" or "pinpool"
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    transfer: str = "to_async"  # "to", "to_async" or "none"
    needs_cuda: bool = False
    in_default: bool = True  # run when --loaders is not given
    made_and_dropped: bool = False  # the workers drop each batch and send its size only


LOADERS: tuple[LoaderSpec, ...] = (
    LoaderSpec("torch", "torch", {"pin_memory": False}, "to"),
    LoaderSpec("torch-pinned", "torch", {"pin_memory": True}, "to_async"),
    LoaderSpec("pinpool", "pinpool", {"device": None}, "to_async"),
    LoaderSpec("pinpool-device", "pinpool", {"device": DEVICE}, "none", needs_cuda=True),
    LoaderSpec("pinpool-zerocopy", "pinpool", {"device": DEVICE, "zero_copy": True}, "none"),
    # The same two without streaming collation, to measure what it brings (by name only).
    LoaderSpec(
        "pinpool-device-unstreamed",
        "pinpool",
        {"device": DEVICE, "stream_samples": False},
        "none",
        needs_cuda=True,
        in_default=False,
    ),
    LoaderSpec(
        "pinpool-zerocopy-unstreamed",
        "pinpool",
        {"device": DEVICE, "zero_copy": True, "stream_samples": False},
        "none",
        in_default=False,
    ),
    # Zero-copy with pinned CPU batches, moved by the step as "pinpool"'s are: zero-copy
    # against copy mode with the same delivery (by name only).
    LoaderSpec(
        "pinpool-zerocopy-cpu",
        "pinpool",
        {"device": None, "zero_copy": True},
        "to_async",
        in_default=False,
    ),
)

#: Ratios are medians divided by this loader's median in the same scenario.
BASELINE = "torch-pinned"


class Unsupported(Exception):
    """This loader cannot run here (the message says why)."""


def spec_named(name: str) -> LoaderSpec:
    return next(s for s in LOADERS if s.name == name)


def build(
    spec: LoaderSpec,
    dataset: Any,
    *,
    batch_size: int,
    workers: int,
    prefetch_factor: int,
    device: str | None,
    sampler: Any = None,
    collate_fn: Any = None,
) -> torch.utils.data.DataLoader[Any]:
    """A fresh loader for ``spec``, over ``sampler``'s indices if given (a rank's shard),
    batches made by ``collate_fn`` if given (else torch's default); raises
    :class:`Unsupported` for an unknown kwarg."""
    if spec.needs_cuda and device is None:
        raise Unsupported("needs a CUDA device")
    if spec.kind == "pinpool":
        import pinpool

        cls: type[torch.utils.data.DataLoader[Any]] = pinpool.DataLoader
    else:
        cls = torch.utils.data.DataLoader
    kwargs: dict[str, Any] = {k: (device if v == DEVICE else v) for k, v in spec.kwargs.items()}
    if workers == 0:
        # (Settings of the workers' own: without workers they would only be warned about.)
        for name in ("zero_copy", "stream_samples"):
            kwargs.pop(name, None)
    if spec.made_and_dropped:
        collate_fn = MadeAndDropped(collate_fn)
    if collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
    try:
        return cls(
            dataset,
            batch_size=batch_size,
            shuffle=False,
            sampler=sampler,
            drop_last=True,
            num_workers=workers,
            prefetch_factor=prefetch_factor if workers > 0 else None,
            **kwargs,
        )
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc):
            raise Unsupported(f"{cls.__module__}.{cls.__name__} rejects it: {exc}") from exc
        raise


def check(spec: LoaderSpec, device: str | None) -> str | None:
    """Why ``spec`` cannot run here, or None: builds it once on an empty dataset."""
    try:
        loader = build(spec, [], batch_size=1, workers=0, prefetch_factor=2, device=device)
    except Unsupported as exc:
        return str(exc)
    del loader
    gc.collect()
    return None


def same_here(a: LoaderSpec, b: LoaderSpec, device: str | None) -> bool:
    """Whether ``a`` and ``b`` are the very same loader on this machine: without a device no
    batch is moved (the transfer makes no difference) and torch ignores ``pin_memory``, so
    there ``torch`` and ``torch-pinned`` run the same code."""

    def effective(spec: LoaderSpec) -> tuple[Any, ...]:
        kwargs = {k: (device if v == DEVICE else v) for k, v in spec.kwargs.items()}
        how = spec.transfer
        if device is None:
            how = "none"
            if spec.kind == "torch":
                kwargs.pop("pin_memory", None)
        return spec.kind, sorted(kwargs.items(), key=lambda kv: kv[0]), how

    return effective(a) == effective(b)


def transfer(spec: LoaderSpec, batch: Any, device: torch.device | None) -> Any:
    """The consumer's side: the batch on ``device`` (unchanged when there is no device)."""
    if device is None or spec.transfer == "none":
        return batch
    return move(batch, device, non_blocking=spec.transfer == "to_async")
