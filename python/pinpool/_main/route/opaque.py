"""Objects a batch holds that the tree walk cannot look into, and what becomes of them.

Anything but mappings, sequences, tuples, namedtuples and dataclasses without a ``pin_memory``
attribute (``_wire.tree``) travels whole, its tensors through torch's own pickling, outside
the pool. Objects that have a ``pin_memory`` attribute (torch's hook for custom batch types)
are treated as torch's DataLoader treats them: their ``pin_memory()`` is called where torch
would call it (an accelerator is present), a ``TypeError`` raised if it is not callable, and a
warning names their type, once per type and process (:func:`pinned_by_itself`); others, once
per loader and type (:func:`looked_past`), unless they are plain values (:data:`_PLAIN`).

Invariants: warnings are only queued here (this may be torch's pin thread) and given on the
consumer's thread (``notices``).
"""

from __future__ import annotations

import enum
import threading
from typing import Any

import numpy as np
import torch

from . import notices

#: Types whose ``pin_memory()`` was warned about in this process.
_warned: set[type] = set()
_warned_lock = threading.Lock()


def torch_would_pin() -> bool:
    """Whether torch's DataLoader, given ``pin_memory=True``, pins batches in this process (it
    does where an accelerator is present)."""
    return bool(torch.accelerator.is_available())


def pinned_by_itself(kind: type, called: bool) -> None:
    """Warns, once per type and process, that objects of ``kind`` did not go through the
    pool (and whether their ``pin_memory()`` was ``called``)."""
    with _warned_lock:
        if kind in _warned:
            return
        _warned.add(kind)
    what = (
        "it was pinned by its own pin_memory(), as torch's DataLoader would do"
        if called
        else "its pin_memory() was not called, as torch's DataLoader does not call it where "
        "no accelerator is present"
    )
    message = (
        f"pinpool: a batch holds a {kind.__module__}.{kind.__qualname__} object, which "
        "pinpool cannot look into: its tensors did not go through the loader's pool of "
        f"pinned slots; {what}. To have them pinned through the pool, make it a dataclass (without "
        "a pin_memory attribute), a namedtuple, or a dict, list or tuple of tensors (warned "
        "once per type)."
    )
    notices.queue(message)  # (this may be torch's pin thread)


#: What a batch may hold that has no arrays: kept whole, without a word.
_PLAIN = (np.generic, torch.dtype, torch.device, torch.Size, enum.Enum, range, slice)


def looked_past(kind: type) -> None:
    """Warns (once per loader and type: the caller keeps count) that objects of ``kind``, which
    pinpool cannot look into, went past the loader's pool with whatever arrays they hold."""
    message = (
        f"pinpool: a batch holds a {kind.__module__}.{kind.__qualname__} object, which pinpool "
        "cannot look into: tensors it holds did not go through the loader's arena of pinned "
        "memory (torch's DataLoader leaves them unpinned too). To have them in the arena, make "
        "it a dataclass, a namedtuple, or a dict, list or tuple of tensors (warned once per "
        "loader and type)."
    )
    notices.queue(message)


class OpaqueObjects:
    """What one loader's delivery makes of the objects its batches hold that the tree walk
    cannot look into (:meth:`pin`)."""

    def __init__(self, on_device: bool) -> None:
        # Whether objects that pin themselves are pinned (as torch would): known with a
        # device, else asked at the first such object.
        self._pinpool_others: bool | None = True if on_device else None
        #: The types of objects the batches held that pinpool cannot look into (warned about
        #: once per loader).
        self._looked_past: set[type] = set()

    def pin(self, obj: Any) -> Any:
        """What torch's ``pin_memory`` would make of ``obj``, an object the tree walk kept
        whole: itself, or (an object with a ``pin_memory`` attribute, not a tensor) what
        calling it returns, where torch would call it (a ``TypeError`` if it is not
        callable, as torch's call raises)."""
        if isinstance(obj, (torch.Tensor, type)):
            return obj
        if not hasattr(obj, "pin_memory"):
            if not isinstance(obj, _PLAIN) and type(obj) not in self._looked_past:
                self._looked_past.add(type(obj))
                looked_past(type(obj))
            return obj
        if self._pinpool_others is None:
            self._pinpool_others = torch_would_pin()
        if not self._pinpool_others:
            pinned_by_itself(type(obj), False)
            return obj
        pin = obj.pin_memory
        if not callable(pin):
            raise TypeError(
                f"the batch holds a {type(obj).__module__}.{type(obj).__qualname__} object "
                f"whose pin_memory attribute is not callable ({type(pin).__name__!r} object): "
                "torch's DataLoader calls it to pin the object"
            )
        pinned_by_itself(type(obj), True)
        return pin()
