"""Walking nested batches: rebuild every container, replacing chosen leaves.

The one tree walker of the package. The worker replaces array leaves with markers, the main
process replaces markers with views into a slot, and streaming collation marks each sample's
big arrays. Containers are rebuilt (copied, never mutated) the way torch's ``pin_memory``
rebuilds them, so a batch comes back with the same types torch would give. Dataclass instances
are walked into too (torch's ``pin_memory`` leaves them alone, unpinned): a copy of each, with
its fields replaced; except one with a ``pin_memory`` attribute, which torch's ``pin_memory``
calls: like any other object the walk cannot look into, it is kept whole (``kept``), so that its
own method runs, as in torch.

Invariant: leaves are visited in a fixed order (mapping insertion order, positions, dataclass
field order), the same on both sides of a process boundary.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
from collections.abc import Callable
from typing import Any

#: Returned by a leaf function to say "not a leaf: recurse or keep as is".
KEEP: Any = object()

_ABSENT: Any = object()
#: Types of values that are never walked into (the most common leaves besides arrays).
_ATOMS = frozenset({int, float, complex, bool, type(None), str, bytes})


def map_leaves(
    data: Any,
    leaf: Callable[[Any], Any],
    exact: bool = False,
    kept: Callable[[Any], Any] | None = None,
) -> Any:
    """Returns ``data`` with every object for which ``leaf(obj)`` is not ``KEEP`` replaced.

    By default mappings, namedtuples, tuples, sequences and dataclass instances (those without
    a ``pin_memory`` attribute) are rebuilt; numbers, None, strings and bytes are kept, and so
    is any other object, or, with ``kept``,
    replaced by ``kept(obj)`` (objects the walk cannot look into). With ``exact``, only exact
    ``dict``, ``list``, ``tuple`` and namedtuples are walked into (what torch's
    ``default_collate`` walks into, for streaming collation): anything else is kept whole,
    with what it holds (``kept`` is not used).
    """
    replaced = leaf(data)
    if replaced is not KEEP:
        return replaced
    if exact:
        return _map_exact(data, leaf)
    if type(data) in _ATOMS or isinstance(data, (str, bytes, bytearray, memoryview)):
        return data
    if isinstance(data, collections.abc.Mapping):
        items = {k: map_leaves(v, leaf, False, kept) for k, v in data.items()}
        try:
            if isinstance(data, collections.abc.MutableMapping):
                clone = copy.copy(data)
                clone.update(items)
                return clone
            return type(data)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(data, tuple):
        if hasattr(data, "_fields"):  # namedtuple
            return type(data)(*(map_leaves(v, leaf, False, kept) for v in data))
        return type(data)(map_leaves(v, leaf, False, kept) for v in data)
    if isinstance(data, collections.abc.Sequence):
        values = [map_leaves(v, leaf, False, kept) for v in data]
        try:
            if isinstance(data, collections.abc.MutableSequence):
                seq = copy.copy(data)
                for i, v in enumerate(values):
                    seq[i] = v
                return seq
            return type(data)(values)  # type: ignore[call-arg]
        except TypeError:
            return values
    # A dataclass instance (not a dataclass itself: the attribute is looked up on its type),
    # unless it has torch's pinning hook: torch calls that, and so does ``kept``.
    if hasattr(type(data), "__dataclass_fields__") and not hasattr(data, "pin_memory"):
        clone = _copy_or_none(data)
        if clone is not None:
            for field in dataclasses.fields(data):
                value = getattr(data, field.name, _ABSENT)  # (an init=False field may be unset)
                if value is not _ABSENT:
                    # Works on frozen and slots dataclasses alike.
                    object.__setattr__(clone, field.name, map_leaves(value, leaf, False, kept))
            return clone
    return data if kept is None else kept(data)


def _copy_or_none(data: Any) -> Any:
    """A shallow copy of a dataclass instance, or None if it cannot be copied (then it is
    kept whole, as before it was walked into)."""
    try:
        return copy.copy(data)
    except (TypeError, copy.Error):
        return None


def _map_exact(data: Any, leaf: Callable[[Any], Any]) -> Any:
    kind = type(data)
    if kind is dict:
        return {key: map_leaves(value, leaf, True) for key, value in data.items()}
    if kind is list:
        return [map_leaves(value, leaf, True) for value in data]
    if kind is tuple:
        return tuple(map_leaves(value, leaf, True) for value in data)
    if isinstance(data, tuple) and hasattr(kind, "_fields"):  # namedtuple
        return kind(*(map_leaves(value, leaf, True) for value in data))
    return data
