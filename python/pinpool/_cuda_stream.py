"""Which CUDA stream is current: what a slot's fence is recorded on when no stream is given.

This runs each time a slot is released without a stream (the last view of a batch dying,
``Slot.release()``), so once torch has initialised CUDA it is one call of torch's raw getter.

Invariants: the getter is kept only after torch said CUDA is initialised in this process; a
forked child forgets it (``os.register_at_fork``) and asks torch again, which says no there
(torch's CUDA cannot be used in a child forked after it started), so the child fences nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

#: torch's ``_cuda_getCurrentRawStream`` once torch has initialised CUDA in this process.
_getter: Callable[[int], int] | None = None


def current_stream(device: int) -> int | None:
    """The raw handle of torch's current stream on ``device``, or None if torch has not
    initialised CUDA (then no GPU work can be reading a slot)."""
    getter = _getter
    if getter is not None:
        return getter(device)
    return _ask_torch(device)


def _ask_torch(device: int) -> int | None:
    """:func:`current_stream` until torch has initialised CUDA: keeps torch's getter then."""
    global _getter
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return int(torch.cuda.current_stream(device).cuda_stream)
    _getter = raw
    return int(raw(device))


def _forget_in_child() -> None:
    global _getter
    _getter = None


os.register_at_fork(after_in_child=_forget_in_child)
