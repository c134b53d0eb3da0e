"""A loader's arguments: each of pinpool's ``DataLoader`` arguments declared once
(:data:`ARGUMENTS`: its default, its check, its one-line doc, where it applies), checked when
the loader is made (not at the first batch, where an error would come out of the middle of an
epoch). The delivery mode they resolve to on this machine is ``delivery_mode``'s.

Boundary: this module is about the arguments as given (each one's check, whether it
applies); ``pool_settings`` is the one object the pool's arguments become, checked together
(the sizes against each other and against a pool of the caller's), passed down whole.

Invariants: a setting out of range raises ``InvalidArgument`` here, and one of the wrong type
``ArgumentTypeError`` (an ``InvalidArgument`` and a ``TypeError``), naming it; a setting given
that cannot apply to the loader it was given to never does nothing silently: one that
contradicts another (sizes given with a pool of the caller's) raises, one that only has nothing
to act on in this loader (``zero_copy=True`` without workers) is named by :func:`ignored`, whose
reasons the loader warns about once; ``DataLoader.__init__``'s pinpool keywords, their
defaults and the user guide's options table are these declarations (``tests/package``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..._errors import ArgumentTypeError, InvalidArgument
from ..._native import PinPool

#: The most copy threads a pool or a worker may have (the Rust core's limit).
MAX_COPY_THREADS = 64
#: The largest size in bytes an argument may give.
MAX_BYTES = 1 << 50


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
    """Raises InvalidArgument unless ``value`` is one of ``choices`` (``ArgumentTypeError``
    for one that is not a string)."""
    if value not in choices:
        wanted = f"{name} must be {' or '.join(repr(c) for c in choices)}, not {value!r}"
        raise (InvalidArgument if isinstance(value, str) else ArgumentTypeError)(wanted)


def check_timeout(name: str, value: Any) -> None:
    """Raises InvalidArgument unless ``value`` is None or a finite number of seconds, at
    least 0."""
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
    its time; the figures behind the range: ``docs/performance.md``, "Measurements behind the
    code")."""
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


def check_pool(name: str, value: Any) -> None:
    """Raises ``ArgumentTypeError`` unless ``value`` is a :class:`~pinpool.PinPool` or None."""
    if value is not None and not isinstance(value, PinPool):
        raise ArgumentTypeError(
            f"{name} must be a pinpool.PinPool or None, not {value!r} ({type(value).__name__})"
        )


# -- the declarations -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """What about a loader decides whether a setting given to it can apply."""

    #: The dataset is an ``IterableDataset`` (its batches' indices are not drawn here).
    iterable: bool
    num_workers: int
    #: Batches are collated (``batch_size`` or ``batch_sampler`` given).
    auto_collation: bool
    #: The caller's own collate function (None: torch's default).
    collate_fn: Any
    #: A pool of the caller's (None: the loader makes its own).
    pool: Any

    @property
    def batched_map_style(self) -> bool:
        """Map-style batches made by workers: what zero-copy and streamed collation need."""
        return self.auto_collation and self.num_workers > 0 and not self.iterable


@dataclasses.dataclass(frozen=True)
class Argument:
    """One of pinpool's ``DataLoader`` arguments (beside torch's), declared once."""

    name: str
    #: Its default (``DataLoader.__init__``'s; ``pinpool.pinned``'s too where it takes it).
    default: Any
    #: Raises ``InvalidArgument`` (``ArgumentTypeError`` for a wrong type) naming the argument
    #: for a value it does not take; called with the name and the value.
    check: Callable[[str, Any], Any]
    #: What it does, in one line.
    doc: str
    #: The default as the user guide's options table shows it (None: the value, in code).
    shown: str | None = None
    #: ``pinpool.pinned`` takes it too (with the same meaning and default).
    pinned: bool = False
    #: Why a value given does nothing in a loader of this shape (None: it applies, or it is
    #: a value that never warns, such as the default).
    unused: Callable[[Any, Shape], str | None] | None = None

    @property
    def shown_default(self) -> str:
        """The default as the user guide's options table shows it."""
        if self.shown is not None:
            return self.shown
        value = f'"{self.default}"' if isinstance(self.default, str) else repr(self.default)
        return f"`{value}`"


def _int_from(low: int, high: int) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        check_int(name, value, low, high, none_ok=True)

    return check


def _bool(name: str, value: Any) -> None:
    check_bool(name, value)


def _bool_or_none(name: str, value: Any) -> None:
    check_bool(name, value, none_ok=True)


def _choice(*choices: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        check_choice(name, value, choices)

    return check


def _zero_copy_unused(value: Any, shape: Shape) -> str | None:
    if not value:
        return None
    if shape.num_workers == 0:
        why = "num_workers=0 (the batches are made in this process)"
    elif shape.iterable:
        why = "an IterableDataset (its batches' indices are not drawn here)"
    elif not shape.auto_collation:
        why = "batch_size=None (no batches to grant slots to)"
    elif shape.pool is not None and shape.pool.backend == "cuda-hostalloc":
        why = "a pool with backend='cuda-hostalloc' (workers cannot map it)"
    else:
        return None
    return (
        f"zero_copy=True does nothing with {why}: every batch is copied into the arena as "
        "with zero_copy=False; zero-copy needs a map-style dataset with batching, "
        "num_workers > 0 and a memfd arena"
    )


def _stream_samples_unused(value: Any, shape: Shape) -> str | None:
    if not value:
        return None  # (None, the default, means "where it applies")
    if shape.num_workers == 0:
        why = "num_workers=0"
    elif shape.iterable:
        why = "an IterableDataset"
    elif shape.collate_fn is not None:
        why = "a collate_fn of your own (streaming collates as torch's default_collate)"
    elif not shape.auto_collation:
        why = "batch_size=None"
    else:
        return None
    return f"stream_samples=True does nothing with {why}: samples are made first and collated after"


def _worker_copy_threads_unused(value: Any, shape: Shape) -> str | None:
    if value is None or shape.num_workers > 0:
        return None
    return (
        f"worker_copy_threads={value} does nothing with num_workers=0: there are no workers "
        "(copy_threads= sets this process's copy threads)"
    )


#: pinpool's own ``DataLoader`` arguments, beside torch's, in the signature's order.
ARGUMENTS: tuple[Argument, ...] = (
    Argument(
        "pool",
        None,
        check_pool,
        "a PinPool of the caller's to load into (it stays theirs: the loader does not close it)",
        pinned=True,
    ),
    Argument(
        "arena_bytes",
        None,
        _int_from(1, MAX_BYTES),
        "the arena's total size, made as given (rounded up to a page)",
        shown="sized for you",
    ),
    Argument(
        "max_batch_bytes",
        None,
        _int_from(1, MAX_BYTES),
        "the largest batch the arena takes, to the byte (larger ones go where oversize= says)",
        shown="half the arena, at most 128 MiB (or the first batch, if larger)",
    ),
    Argument(
        "slot_bytes",
        None,
        _int_from(1, MAX_BYTES),
        "the older sizing: the largest batch of an arena of num_slots batches",
        pinned=True,
    ),
    Argument(
        "num_slots",
        None,
        _int_from(1, 1 << 20),
        "the older sizing: the arena's batches (alone: the most batches out at once)",
        pinned=True,
    ),
    Argument(
        "device",
        None,
        lambda name, value: cuda_device(value),
        "None or 'cpu': pinned CPU batches; a CUDA device: batches already on it",
        pinned=True,
    ),
    Argument(
        "copy_threads",
        None,
        _int_from(1, MAX_COPY_THREADS),
        "threads copying batches into the arena in the main process",
        shown="cores, up to 8",
        pinned=True,
    ),
    Argument(
        "slot_timeout",
        60.0,
        check_timeout,
        'seconds overflow="wait" waits for room (None: forever)',
        pinned=True,
    ),
    Argument(
        "overflow",
        "copy",
        _choice("copy", "wait"),
        "a batch that finds the arena held by live batches: ordinary memory, or wait",
        pinned=True,
    ),
    Argument(
        "oversize",
        "pin",
        _choice("pin", "copy", "error"),
        "a batch larger than the largest the arena takes: memory of its own, or an error",
        pinned=True,
    ),
    Argument(
        "zero_copy",
        False,
        _bool,
        "workers write each batch straight into an arena slot granted to them",
        unused=_zero_copy_unused,
    ),
    Argument(
        "keep_worker_memory",
        True,
        _bool,
        "workers keep the memory their items were made in for the next batch's items",
    ),
    Argument(
        "worker_copy_threads",
        None,
        _int_from(1, MAX_COPY_THREADS),
        "threads each worker copies a batch's big arrays with, without the GIL",
        shown="2 to 4",
        unused=_worker_copy_threads_unused,
    ),
    Argument(
        "stream_samples",
        None,
        _bool_or_none,
        "workers copy each sample's arrays into the batch as soon as it is made",
        shown="where it applies",
        unused=_stream_samples_unused,
    ),
)

#: The declarations by name.
BY_NAME: dict[str, Argument] = {a.name: a for a in ARGUMENTS}


def given(values: Mapping[str, Any]) -> dict[str, Any]:
    """The declared arguments' values out of ``values`` (``DataLoader.__init__``'s locals),
    in the declarations' order."""
    return {a.name: values[a.name] for a in ARGUMENTS}


def check_given(values: Mapping[str, Any]) -> None:
    """Checks each of ``values`` (declared arguments, by name) by its declaration."""
    for name, value in values.items():
        BY_NAME[name].check(name, value)


def argument_docs() -> str:
    """The declarations as lines of a docstring: name, default and what each does."""
    lines = [f"- ``{a.name}`` (default ``{a.default!r}``): {a.doc}." for a in ARGUMENTS]
    return "\n".join(lines)


def ignored(
    *,
    dataset: Any,
    num_workers: int,
    auto_collation: bool,
    collate_fn: Any,
    pin_memory: bool,
    **values: Any,
) -> list[str]:
    """What the settings given to ``pinpool.DataLoader`` would not do in this loader, each
    with why (empty: every setting given applies): ``values``, pinpool's arguments by name (as
    their declarations' ``unused`` say; with ``pin_memory=False``, each one given). Defaults
    are never named: only a value the caller chose (``stream_samples=True``, not the default
    None, which means "where it applies")."""
    shape = Shape(
        iterable=isinstance(dataset, torch.utils.data.IterableDataset),
        num_workers=num_workers,
        auto_collation=auto_collation,
        collate_fn=collate_fn,
        pool=values.get("pool"),
    )
    out = []
    for name, value in values.items():
        if not pin_memory:
            if not _is_default(name, value):
                out.append(f"{name}={value!r} does nothing with pin_memory=False{UNPINNED}")
            continue
        unused = BY_NAME[name].unused
        why = unused(value, shape) if unused is not None else None
        if why is not None:
            out.append(why)
    return out


#: What ``pin_memory=False`` means (the end of the sentences that say so).
UNPINNED = (
    ": batches are torch's own, unpinned and outside the arena, as torch's DataLoader gives them"
)


def check_unpinned(values: Mapping[str, Any]) -> None:
    """Refuses what contradicts ``pin_memory=False``: a ``device=`` to deliver batches on
    (from pinned memory)."""
    if values.get("device") is not None:
        raise ValueError(
            f"pinpool.DataLoader: device={values['device']!r} delivers batches on a GPU from "
            f"pinned memory, and pin_memory=False asks for none{UNPINNED}: drop one of the two"
        )


def _is_default(name: str, value: Any) -> bool:
    default = BY_NAME[name].default
    return value is default or (type(value) is type(default) and value == default)
