"""Worker processes keep the memory their items were made in, for the next batch's items.

A worker makes a batch's worth of fresh arrays (decoded images, say), collates them and frees
them. glibc hands blocks above its mmap threshold (128 KiB at first) straight back to the
kernel, and trims the top of its heap once more than twice that is free, so the next batch's
items land in fresh pages, each one faulted in on first write, an order of magnitude slower
than writing pages kept from the last batch (``docs/performance.md``, "Measurements behind the
code"). The same reason makes each worker reuse its shared-memory segments.

:func:`keep_freed_memory`, called by pinpool's collate in a worker, raises both thresholds so
that freed item memory stays in the heap, up to a bound that follows the largest batch seen
(twice it, at most :data:`MAX_KEPT`). Invariants: it only ever raises the bound; it touches
nothing outside glibc's malloc (other C libraries: it does nothing); it runs in DataLoader
worker processes only, never in the main process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

#: glibc's mallopt parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold on 64-bit: blocks above it are always mapped afresh.
_MMAP_THRESHOLD_MAX = 32 << 20
#: Free memory a worker keeps, at least and at most.
MIN_KEPT = 64 << 20
MAX_KEPT = 1 << 30

_lock = threading.Lock()
_state: dict[str, int] = {}  # pid -> the bound set in that process


def _mallopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        fn = libc.mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def keep_freed_memory(batch_nbytes: int) -> int:
    """Lets this process keep up to ``2 * batch_nbytes`` (within [MIN_KEPT, MAX_KEPT]) of
    freed memory for reuse. Returns the bound now in force (0 where it cannot be set)."""
    want = min(MAX_KEPT, max(MIN_KEPT, 2 * batch_nbytes))
    key = str(os.getpid())  # a forked worker starts afresh
    with _lock:
        have = _state.get(key)
        if have is not None and have >= want:
            return have
        fn = _mallopt()
        if fn is None or have == 0:
            _state[key] = 0
            return 0
        ok = fn(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
        ok = ok and fn(_M_TRIM_THRESHOLD, want) == 1
        _state[key] = want if ok else 0
        return _state[key]
