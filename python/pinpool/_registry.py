"""The main process's decoders (the loader side of each ``pinpool.DataLoader``), by token.

Handles sent by workers carry only their loader's token; they find its decoder here. This
module imports nothing of pinpool's, so every module may use it without an import circle.

Invariant: a decoder is found only in the process that made it: in a forked child, objects
inherited from the parent (and collected there) must not touch the parent's pool.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from ._errors import PinPoolError

_DECODERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register(token: str, decoder: Any) -> None:
    """Makes ``decoder`` (which has a ``pid`` attribute) the one for ``token``."""
    _DECODERS[token] = decoder


def lookup_or_none(token: str) -> Any:
    """The decoder of ``token`` in this process, or None."""
    decoder = _DECODERS.get(token) if isinstance(token, str) else None
    return decoder if decoder is not None and decoder.pid == os.getpid() else None


def lookup(token: str) -> Any:
    """The decoder of ``token`` in this process; ``PinPoolError`` if there is none."""
    decoder = lookup_or_none(token)
    if decoder is None:
        raise PinPoolError("this batch belongs to a pinpool.DataLoader that no longer exists")
    return decoder
