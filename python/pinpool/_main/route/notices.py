"""What a user must know reaches them as a warning (``warnings.warn``, shown by default), given
on the consumer's thread: the events that lose a loader its speed-up (a batch larger than the
arena takes, a batch that got no slot, zero-copy falling back for more than a quarter of an
epoch's batches, an object pinpool cannot look into), each once per loader.

Invariants: a notice is only queued where it happens (this may be torch's pin thread, or a
copy thread's callback) and given by :func:`give_due` on the consumer's thread
(``delivery.hand_to_consumer``, and the epoch's end), naming the first frame outside pinpool
and torch; a notice queued is given once.
"""

from __future__ import annotations

import os
import sys
import threading
import types
import warnings

import torch

#: Where frames of pinpool and of torch come from (a warning names the first frame outside).
_INSIDE = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)
#: Notices queued, not yet given.
due: list[str] = []
_lock = threading.Lock()


def queue(message: str) -> None:
    """Has ``message`` given to the user, as a ``UserWarning``, on the consumer's thread."""
    with _lock:
        due.append(message)


def give_due() -> None:
    """Gives every notice queued (a no-op when none is)."""
    if not due:
        return
    with _lock:
        messages = due[:]
        due.clear()
    for message in messages:
        # Name the first frame outside pinpool and torch (the loop taking batches), if any.
        level = 1
        outside: types.FrameType | None = sys._getframe(0)
        while outside is not None and outside.f_code.co_filename.startswith(_INSIDE):
            level, outside = level + 1, outside.f_back
        warnings.warn(message, UserWarning, stacklevel=level if outside is not None else 1)
