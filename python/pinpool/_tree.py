"""Walking nested batches: rebuild every container, replacing chosen leaves.

One function serves both directions: the worker replaces array leaves with markers, the main
process replaces markers with views into a slot. Containers are rebuilt the way torch's
``pin_memory`` rebuilds them, so a batch comes back with the same types torch would give.
"""

from __future__ import annotations

import collections.abc
import copy
from collections.abc import Callable
from typing import Any

#: Returned by a leaf function to say "not a leaf: recurse or keep as is".
KEEP: Any = object()


def map_leaves(data: Any, leaf: Callable[[Any], Any]) -> Any:
    """Returns ``data`` with every object for which ``leaf(obj)`` is not ``KEEP`` replaced.

    Mappings, namedtuples, tuples and sequences are rebuilt (copied, never mutated); strings,
    bytes and other objects are kept.
    """
    replaced = leaf(data)
    if replaced is not KEEP:
        return replaced
    if isinstance(data, (str, bytes, bytearray, memoryview)):
        return data
    if isinstance(data, collections.abc.Mapping):
        items = {k: map_leaves(v, leaf) for k, v in data.items()}
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
            return type(data)(*(map_leaves(v, leaf) for v in data))
        return type(data)(map_leaves(v, leaf) for v in data)
    if isinstance(data, collections.abc.Sequence):
        values = [map_leaves(v, leaf) for v in data]
        try:
            if isinstance(data, collections.abc.MutableSequence):
                clone = copy.copy(data)
                for i, v in enumerate(values):
                    clone[i] = v
                return clone
            return type(data)(values)  # type: ignore[call-arg]
        except TypeError:
            return values
    return data
