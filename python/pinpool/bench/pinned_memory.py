"""Pinned host memory a run's loader holds: torch's caching host allocator's counters (reset
before a loader is made) and pinpool's arena (``measure``'s ``pinned_mib`` and
``pinned_held_*`` figures).

Invariants: without CUDA torch pins nothing, and its figures are None (said so, never 0);
nothing here allocates pinned memory.
"""

from __future__ import annotations

from typing import Any

import torch

MIB = 1 << 20


def reset_host_pinned() -> None:
    """Empties torch's pinned host cache and resets its peak, so each run starts at zero."""
    if not torch.cuda.is_available():
        return
    empty = getattr(torch._C, "_host_emptyCache", None)
    reset = getattr(torch.cuda.memory, "reset_peak_host_memory_stats", None)
    for fn in (empty, reset):
        if fn is not None:
            fn()


def host_pinned() -> dict[str, int] | None:
    """torch's pinned host allocator: peak and current bytes, or None where not available."""
    fn = getattr(torch.cuda, "host_memory_stats", None) or getattr(
        torch.cuda.memory, "host_memory_stats", None
    )
    if fn is None or not torch.cuda.is_available():
        return None
    stats = fn()
    keys = ("allocated_bytes.peak", "allocated_bytes.current", "active_bytes.peak")
    if not all(k in stats for k in keys):
        return None
    return {k.replace(".", "_"): int(stats[k]) for k in keys}


#: The key of ``torch.cuda.host_memory_stats()`` read as the pinned bytes torch's caching host
#: allocator holds: "bytes of pinned blocks owned by the allocator (active + cached)", at the
#: power-of-two sizes it asked CUDA for (torch 2.11 to 2.15, CachingHostAllocator.h's
#: HostStats::allocated_bytes; its host stats have no reserved_bytes, which is the device
#: allocator's name for the same thing and is read if a later torch has it instead).
HOST_HELD_KEYS = ("allocated_bytes.current", "reserved_bytes.current")


def host_pinned_held() -> int | None:
    """The pinned bytes torch's caching host allocator holds now (in use and cached), or None
    without CUDA (or where torch does not say)."""
    fn = getattr(torch.cuda, "host_memory_stats", None) or getattr(
        torch.cuda.memory, "host_memory_stats", None
    )
    if fn is None or not torch.cuda.is_available():
        return None
    stats = fn()
    if not stats:  # CUDA not initialised yet in this process: nothing pinned
        return 0
    for key in HOST_HELD_KEYS:
        if key in stats:
            return int(stats[key])
    return None


def pinned_held(stats: Any, pool: dict[str, Any] | None, torch_held: int | None) -> dict[str, Any]:
    """What a loader holds at the end: ``pinned_held_bytes``, ``pinned_held`` (where the
    figure comes from, or why there is none), and pinpool's ``overflow_batches``,
    ``zero_copy_fallbacks`` and ``zero_copy_in_place`` (the share of zero-copy batches the
    workers wrote in place; None for torch's loaders and pinpool's copy modes)."""
    if pool is not None:
        held: int | None = int(pool["arena_bytes"]) + (torch_held or 0)
        how = f"pool.arena_bytes (backend {pool['backend']})"
        if torch_held:
            how += " + torch host allocator's allocated_bytes.current"
        elif torch_held is None:
            how += ": no CUDA, not pinned"
    elif torch_held is None:
        held, how = None, "n/a (no CUDA)"
    else:
        held, how = torch_held, "torch.cuda.host_memory_stats()['allocated_bytes.current']"
    stats = stats or {}
    in_place = None
    if pool is not None:
        written = stats.get("zero_copy_batches", 0) + stats.get("zero_copy_fallbacks", 0)
        in_place = stats.get("zero_copy_batches", 0) / written if written else None
    return {
        "pinned_held_bytes": held,
        "pinned_held_mib": None if held is None else held / MIB,
        "pinned_held": how,
        "overflow_batches": stats.get("overflow_batches") if pool is not None else None,
        "zero_copy_fallbacks": stats.get("zero_copy_fallbacks") if pool is not None else None,
        "zero_copy_in_place": in_place,
    }
