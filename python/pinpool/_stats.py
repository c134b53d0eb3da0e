"""The counters ``PinPool.stats()`` and ``pinpool.DataLoader.stats()`` return, as typed dicts,
so that a type checker knows each key and its type (at run time they are plain dicts).

Invariants: :class:`PoolStats` has exactly the keys the Rust pool's ``stats()`` sets
(``src/python/pool/reporting.rs``, ``stats_dict``) and :class:`LoaderStats` the loader's own
keys plus those; ``tests/package/test_typing.py`` compares both with real ``stats()`` results.
"""

from __future__ import annotations

from typing import TypedDict


class PoolStats(TypedDict):
    """``PinPool.stats()``: the slot table's counts, the pool's counters since it was made,
    and the arena's bytes by state."""

    slots_free: int
    slots_checked_out: int
    slots_fenced: int
    slots_preparing: int
    checkouts: int
    waits: int
    wait_seconds: float
    releases: int
    bytes_copied: int
    copies: int
    segments_mapped: int
    segments_unmapped: int
    pending_unmaps: int
    fence_errors: int
    arena_bytes: int
    bytes_free: int
    bytes_checked_out: int
    bytes_fenced: int
    bytes_preparing: int
    largest_free: int
    free_ranges: int


class _LoaderCounters(TypedDict):
    batches: int
    bytes: int
    batches_ahead: int
    overflow_batches: int
    split_batches: int
    oversize_batches: int
    zero_copy_batches: int
    zero_copy_fallbacks: int
    zero_copy_no_grant: int
    zero_copy_outgrown: int
    segments_cached: int


class LoaderStats(_LoaderCounters, total=False):
    """``pinpool.DataLoader.stats()``: the loader's own counters, always there, and its
    pool's (:class:`PoolStats`), there once the pool exists (a loader sized from its first
    batch makes it then)."""

    slots_free: int
    slots_checked_out: int
    slots_fenced: int
    slots_preparing: int
    checkouts: int
    waits: int
    wait_seconds: float
    releases: int
    bytes_copied: int
    copies: int
    segments_mapped: int
    segments_unmapped: int
    pending_unmaps: int
    fence_errors: int
    arena_bytes: int
    bytes_free: int
    bytes_checked_out: int
    bytes_fenced: int
    bytes_preparing: int
    largest_free: int
    free_ranges: int
