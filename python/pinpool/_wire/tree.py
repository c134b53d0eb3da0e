"""Walking nested batches: taking a batch apart into a skeleton, and putting it together again.

The one tree walker of the package. The worker takes a batch apart (:func:`take_apart`),
replacing its array leaves with markers; the main process puts it together again
(:func:`put_together`), replacing the markers with views into a slot. Containers are rebuilt
the way torch's ``pin_memory`` rebuilds them, so a batch comes back with the types torch
would give; and a user's constructor, ``update`` or ``__setitem__`` only ever sees the real
values, in the main process, as in torch, never the markers:

- exact ``dict``, ``list`` and ``tuple`` are rebuilt as they are, on both sides;
- any other container (a namedtuple, a torch structseq such as ``torch.sort``'s result, a
  dict or list subclass, a user ``Mapping`` or ``Sequence``) becomes a :class:`Node` in the
  skeleton: its type, or an emptied shallow copy of it (``copy.copy``, then ``clear()``),
  and its children. The main process makes it as torch's ``pin_memory`` would from the
  values: ``type(*values)`` for a namedtuple, ``type(values)`` for other tuples, the copy's
  ``update()`` / ``extend()`` for mutable mappings and sequences, ``type(values)`` for
  others; where that raises ``TypeError``, a plain ``dict`` or ``list``, as torch falls back;
- a dataclass instance (torch's ``pin_memory`` leaves them whole) is walked into too: a shallow
  copy with its fields set past any ``__setattr__`` (no ``__init__`` or ``__post_init__``
  runs), so that its arrays go through the arena; what it holds is never handed to ``kept``
  (torch calls no ``pin_memory()`` inside it);
- an object with a ``pin_memory`` attribute (torch calls it, before looking at what the object
  is: a ``PackedSequence`` too), and any object none of the above applies to, is kept whole:
  it travels as it is, and the main process hands it to ``kept``.

Streaming collation walks a worker's samples in ``exact`` mode (what torch's ``default_collate``
walks into): exact ``dict``, ``list``, ``tuple``, and namedtuples whose constructor only stores
its values (:func:`plain_namedtuple`); anything else is kept whole with what it holds.

Invariants: leaves are visited in a fixed order (mapping insertion order, positions, dataclass
field order), the same on both sides of a process boundary; :func:`put_together` walks into
nothing but exact builtins and :class:`Node` records, whatever else the skeleton holds.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from .._errors import OutOfBounds

#: Returned by a leaf function to say "not a leaf: recurse or keep as is".
KEEP: Any = object()

_ABSENT: Any = object()
#: Types of values that are never walked into (the most common leaves besides arrays).
_ATOMS = frozenset({int, float, complex, bool, type(None), str, bytes})

Leaf = Callable[[Any], Any]


class Node:
    """A container of a type other than exact ``dict``, ``list`` or ``tuple``, taken apart:
    ``how`` makes it again from ``children`` (made first) in the main process.

    ``kind`` is one of ``"namedtuple"``, ``"tuple"``, ``"mapping"`` (``how`` is the type,
    ``children`` a dict), ``"mutable_mapping"`` (``how`` an emptied copy, ``children`` a
    dict), ``"sequence"`` (the type, a list), ``"mutable_sequence"`` (an emptied copy, a list)
    or ``"dataclass"`` (a copy whose fields are None, ``children`` a dict by field name)."""

    __slots__ = ("children", "how", "kind")

    def __init__(self, kind: str, how: Any, children: Any) -> None:
        self.kind = kind
        self.how = how
        self.children = children

    def __reduce__(self) -> tuple[Any, ...]:
        return (Node, (self.kind, self.how, self.children))


def take_apart(data: Any, leaf: Leaf) -> Any:
    """The skeleton of ``data``: every object for which ``leaf(obj)`` is not ``KEEP``
    replaced by what it returns, containers other than exact builtins as :class:`Node`
    records, objects the walk does not look into as they are."""
    replaced = leaf(data)
    if replaced is not KEEP:
        return replaced
    kind = type(data)
    if kind in _ATOMS:
        return data
    if kind is dict:
        return {k: take_apart(v, leaf) for k, v in data.items()}
    if kind is list:
        return [take_apart(v, leaf) for v in data]
    if kind is tuple:
        return tuple(take_apart(v, leaf) for v in data)
    if isinstance(data, (str, bytes, bytearray, memoryview)) or hasattr(data, "pin_memory"):
        return data  # (torch calls pin_memory() before it looks at what the object is)
    if isinstance(data, tuple):
        named = "namedtuple" if hasattr(data, "_fields") else "tuple"
        return Node(named, kind, [take_apart(v, leaf) for v in data])
    if isinstance(data, collections.abc.Mapping):
        children = {k: take_apart(v, leaf) for k, v in data.items()}
        if not isinstance(data, collections.abc.MutableMapping):
            return Node("mapping", kind, children)
        emptied = _emptied(data)
        return data if emptied is _ABSENT else Node("mutable_mapping", emptied, children)
    if isinstance(data, collections.abc.Sequence):
        values = [take_apart(v, leaf) for v in data]
        if not isinstance(data, collections.abc.MutableSequence):
            return Node("sequence", kind, values)
        emptied = _emptied(data)
        return data if emptied is _ABSENT else Node("mutable_sequence", emptied, values)
    if hasattr(kind, "__dataclass_fields__"):  # an instance (a dataclass itself is a type)
        return _dataclass_node(data, leaf)
    return data


def _emptied(data: Any) -> Any:
    """A shallow copy of mutable container ``data``, emptied (its type and other state kept:
    a defaultdict's factory, a subclass's attributes); None where copying raises
    ``TypeError`` (the main process then makes a plain dict or list, as torch falls back);
    ``_ABSENT`` where copying or emptying it fails otherwise (it is kept whole)."""
    try:
        clone = copy.copy(data)
    except (TypeError, copy.Error):
        return None
    except Exception:
        return _ABSENT
    try:
        clone.clear()
    except Exception:
        return _ABSENT
    return clone if len(clone) == 0 else _ABSENT


def _dataclass_node(data: Any, leaf: Leaf) -> Any:
    try:
        clone = copy.copy(data)
    except Exception:  # (a field unset, a __reduce__ of its own that fails...)
        return data  # (kept whole, as torch keeps it)
    children = {}
    for field in dataclasses.fields(data):
        value = getattr(data, field.name, _ABSENT)  # (an init=False field may be unset)
        if value is not _ABSENT:
            children[field.name] = take_apart(value, leaf)
            object.__setattr__(clone, field.name, None)  # (frozen and slots dataclasses too)
    return Node("dataclass", clone, children)


def put_together(skeleton: Any, leaf: Leaf, kept: Leaf | None = None) -> Any:
    """The batch of ``skeleton``: every object for which ``leaf(obj)`` is not ``KEEP``
    replaced by what it returns, :class:`Node` records made as torch's ``pin_memory`` makes
    containers, and any other object but exact builtins handed to ``kept`` (if given)."""
    replaced = leaf(skeleton)
    if replaced is not KEEP:
        return replaced
    kind = type(skeleton)
    if kind in _ATOMS:
        return skeleton
    if kind is dict:
        return {k: put_together(v, leaf, kept) for k, v in skeleton.items()}
    if kind is list:
        return [put_together(v, leaf, kept) for v in skeleton]
    if kind is tuple:
        return tuple(put_together(v, leaf, kept) for v in skeleton)
    if kind is Node:
        return _made(skeleton, leaf, kept)
    return skeleton if kept is None else kept(skeleton)


def _made(node: Node, leaf: Leaf, kept: Leaf | None) -> Any:
    kind, how, children = node.kind, node.how, node.children
    if kind not in _KINDS or type(children) is not _KINDS[kind]:
        raise OutOfBounds(f"corrupt batch description: a {kind!r} node of {type(children)}")
    if kind in ("namedtuple", "tuple", "mapping", "sequence") and not isinstance(how, type):
        raise OutOfBounds(f"corrupt batch description: a {kind} node of {type(how)}")
    if kind == "dataclass":
        # torch's pin_memory leaves a dataclass whole: nothing in it goes to ``kept``.
        clone = copy.copy(how)
        for name, value in children.items():
            object.__setattr__(clone, name, put_together(value, leaf))
        return clone
    if type(children) is dict:
        items = {k: put_together(v, leaf, kept) for k, v in children.items()}
        return _filled(how, items, kind == "mapping", "update")
    values = [put_together(v, leaf, kept) for v in children]
    if kind in ("namedtuple", "tuple"):
        # (the worker made one of these from these values: only a corrupt node fails here)
        try:
            return how(*values) if kind == "namedtuple" else how(values)
        except TypeError as exc:
            raise OutOfBounds(
                f"corrupt batch description: a {how.__qualname__} of {len(values)} values ({exc})"
            ) from None
    return _filled(how, values, kind == "sequence", "extend")


def _filled(how: Any, made: Any, immutable: bool, fill: str) -> Any:
    """A mapping or sequence of ``made`` (a dict or list), as torch's ``pin_memory`` makes it:
    ``how(made)`` for an immutable type; else ``how``, the emptied copy, filled by its ``fill``
    method (``update``, ``extend``); ``made`` itself where ``how`` is None or raises
    ``TypeError``, as torch falls back to a plain dict or list."""
    try:
        if immutable:
            return how(made)
        if how is None:
            return made
        getattr(how, fill)(made)
        return how
    except TypeError:
        return made
    except AttributeError as exc:
        raise OutOfBounds(f"corrupt batch description: {exc}") from None


#: Each node kind, and the type of its children.
_KINDS: dict[str, type] = {
    "namedtuple": list,
    "tuple": list,
    "sequence": list,
    "mutable_sequence": list,
    "mapping": dict,
    "mutable_mapping": dict,
    "dataclass": dict,
}


def map_leaves(data: Any, leaf: Leaf, exact: bool = False, kept: Leaf | None = None) -> Any:
    """``data`` with every object for which ``leaf(obj)`` is not ``KEEP`` replaced, in one
    process: taken apart and put together again (see the module's doc; objects the walk does
    not look into are kept, or handed to ``kept``). With ``exact``, only exact ``dict``,
    ``list``, ``tuple`` and plain namedtuples are walked into (what torch's
    ``default_collate`` walks into, for streaming collation): anything else is kept whole,
    with what it holds (``kept`` is not used)."""
    if exact:
        return _map_exact(data, leaf)
    return put_together(take_apart(data, leaf), _unchanged, kept)


def _unchanged(obj: Any) -> Any:
    return KEEP


def plain_namedtuple(kind: type) -> bool:
    """Whether ``kind`` is a namedtuple whose making only stores its values: its ``__new__``
    is the one ``collections.namedtuple`` writes (``typing.NamedTuple`` too) and no
    ``__init__`` of its own looks at them. Such a tuple may be made with markers for values;
    another (``PackedSequence``, one whose constructor checks its fields) may not."""
    new = getattr(kind, "__new__", None)
    made = getattr(new, "__globals__", {}).get("__name__", "")
    return (
        hasattr(kind, "_fields")
        and isinstance(made, str)
        and made.startswith("namedtuple_")
        and kind.__init__ is object.__init__
    )


def _map_exact(data: Any, leaf: Leaf) -> Any:
    replaced = leaf(data)
    if replaced is not KEEP:
        return replaced
    kind = type(data)
    if kind is dict:
        return {key: _map_exact(value, leaf) for key, value in data.items()}
    if kind is list:
        return [_map_exact(value, leaf) for value in data]
    if kind is tuple:
        return tuple(_map_exact(value, leaf) for value in data)
    if isinstance(data, tuple) and plain_namedtuple(kind):
        return kind(*(_map_exact(value, leaf) for value in data))
    return data
