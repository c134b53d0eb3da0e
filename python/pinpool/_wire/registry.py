"""The main process's receivers (the loader side of each ``pinpool.DataLoader``), by token.

A handle sent by a worker carries only its loader's token; it finds its receiver here. This
module imports nothing of pinpool's but the errors, so every module may use it without an
import circle.

Invariant: a receiver is found only in the process that made it: in a forked child, objects
inherited from the parent (and collected there) must not touch the parent's pool.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from .._errors import PinPoolError

_RECEIVERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register(token: str, receiver: Any) -> None:
    """Makes ``receiver`` (which has a ``pid`` attribute) the one for ``token``."""
    _RECEIVERS[token] = receiver


def lookup_or_none(token: str) -> Any:
    """The receiver of ``token`` in this process, or None."""
    receiver = _RECEIVERS.get(token) if isinstance(token, str) else None
    return receiver if receiver is not None and receiver.pid == os.getpid() else None


def lookup(token: str) -> Any:
    """The receiver of ``token`` in this process; ``PinPoolError`` if there is none."""
    receiver = lookup_or_none(token)
    if receiver is None:
        raise PinPoolError("this batch belongs to a pinpool.DataLoader that no longer exists")
    return receiver
