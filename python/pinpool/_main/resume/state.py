"""state: the saved state's format and validation (``checkpoint``: building a loader's
state and applying a loaded one).

A checkpoint state's format: what it records (the random states, the order its samples
come in) and the checks a loaded state passes before anything reads it.

Invariants: a state is plain data (see ``checkpoint``); every field that
``checkpoint.Resume.start`` and the workers read is checked by :func:`check_state` when the
state is loaded, so that a malformed state raises one ``InvalidArgument`` naming the field and
changes nothing; random states are checked on fresh generators (the process's own RNGs never
change here).
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _signals
from ..._errors import InvalidArgument

#: The version of the state dict's layout. Version 2 added the samples yielded and the record
#: of the order (``epoch["samples"]``, ``order``); version 1's states still load.
VERSION = 2
VERSIONS = (1, 2)

#: Where a loader's generators live (the same generator is recorded once, at its first path).
#: The last is a sampler under a batch sampler's batch sampler: accelerate's sharding one.
GENERATOR_PATHS = (
    "generator",
    "sampler.generator",
    "batch_sampler.generator",
    "batch_sampler.sampler.generator",
    "batch_sampler.batch_sampler.sampler.generator",
)

#: torch's global RNG state and the loader's generators' (by path).
States = tuple[torch.Tensor, dict[str, torch.Tensor]]


def generators_of(loader: Any) -> dict[str, torch.Generator]:
    found: dict[str, torch.Generator] = {}
    for path in GENERATOR_PATHS:
        obj = loader
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if isinstance(obj, torch.Generator) and all(obj is not g for g in found.values()):
            found[path] = obj
    return found


def capture(loader: Any) -> States:
    return torch.get_rng_state(), {p: g.get_state() for p, g in generators_of(loader).items()}


def restore(loader: Any, states: States) -> None:
    rng, generators = states
    torch.set_rng_state(rng)
    own = generators_of(loader)
    if set(own) != set(generators):
        raise ValueError(
            f"the state's generators {sorted(generators)} are not this loader's {sorted(own)}: "
            "make the loader with the same arguments as the one the state was taken from"
        )
    for path, state in generators.items():
        own[path].set_state(state)


def uncaptured() -> tuple[Any, ...]:
    """What the random generators a state does not capture are at now: Python's ``random``
    and numpy's global one (where numpy is loaded). A sampler that draws its order from them
    (:func:`drawn_from`) cannot be resumed: the order a resumed epoch draws differs."""
    import random
    import sys

    now: list[Any] = [random.getstate()]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
        now.append((kind, keys.tobytes(), pos, has_gauss, gauss))
    return tuple(now)


def drawn_from(before: tuple[Any, ...], after: tuple[Any, ...]) -> str | None:
    """The generator :func:`uncaptured` saw move between ``before`` and ``after``, if one did."""
    names = ("Python's random module", "numpy's global random generator (np.random)")
    for name, was, now in zip(names, before, after, strict=False):
        if was != now:
            return name
    return None


def type_name(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _length(obj: Any) -> int | None:
    try:
        n = len(obj)
    except (TypeError, NotImplementedError, AttributeError):
        return None
    return n if type(n) is int else None


#: A sampler's attributes that decide its order, recorded (when it has them, as ints or
#: bools) and compared: torch's ``RandomSampler``, ``WeightedRandomSampler``,
#: ``DistributedSampler``; a sampler of the caller's with such attributes too.
ORDER_ATTRIBUTES = ("num_samples", "replacement", "shuffle", "seed", "num_replicas", "rank")

#: What the torch samplers that ``shuffle=`` picks are, for error messages.
_SHUFFLE = {
    "torch.utils.data.sampler.RandomSampler": " (shuffle=True)",
    "torch.utils.data.sampler.SequentialSampler": " (shuffle=False)",
}


def _describe(sampler: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"class": type_name(sampler), "length": _length(sampler)}
    for name in (*ORDER_ATTRIBUTES, "drop_last", "epoch"):
        try:
            value = getattr(sampler, name)
        except Exception:  # (a property that cannot say)
            continue
        if type(value) in (int, bool):
            out[name] = value
    return out


def order_of(loader: Any) -> dict[str, Any]:
    """What decides the order of a map-style loader's samples, as plain data: the dataset's
    length, and the sampler whose order the batches are cut from (``by="samples"``: torch's
    ``BatchSampler`` or no batching) or the caller's batch sampler (``by="batches"``)."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        by, sampler = "samples", loader.sampler
    elif type(batch_sampler) is torch.utils.data.BatchSampler:
        by, sampler = "samples", batch_sampler.sampler
    else:
        by, sampler = "batches", batch_sampler
    return {"dataset_length": _length(loader.dataset), "by": by, "sampler": _describe(sampler)}


def order_differs(taken: dict[str, Any], now: dict[str, Any]) -> str | None:
    """How the order a state was taken with differs from a loader's (None: it does not).
    The samplers' epochs are left out: the caller sets it after loading (``set_epoch``)."""
    if taken["dataset_length"] != now["dataset_length"]:
        return (
            f"the state was taken over a dataset of {taken['dataset_length']} samples, this "
            f"loader's has {now['dataset_length']}"
        )
    what = {"samples": "sampler", "batches": "batch sampler"}
    was, is_ = taken["sampler"], now["sampler"]
    if taken["by"] != now["by"] or was["class"] != is_["class"]:
        return (
            f"the state's order came from the {what[taken['by']]} {was['class']}"
            f"{_SHUFFLE.get(was['class'], '')}, this loader's from the {what[now['by']]} "
            f"{is_['class']}{_SHUFFLE.get(is_['class'], '')}"
        )
    for key in sorted((set(was) | set(is_)) - {"class", "epoch"}):
        if was.get(key) != is_.get(key):
            return (
                f"the state's {what[taken['by']]}'s {key} was {was.get(key)!r}, this loader's "
                f"is {is_.get(key)!r}"
            )
    return None


def _bad(name: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"malformed DataLoader state: {name} {why}")


def checked_field(mapping: dict[str, Any], key: str, kind: Any, where: str = "") -> Any:
    """``mapping[key]``, checked to be a ``kind`` (ints and bools kept apart)."""
    name = f"{where}[{key!r}]"
    if key not in mapping:
        raise _bad(name, "is missing")
    value = mapping[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        names = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
        raise _bad(name, f"must be {names}, not {type(value).__name__} {value!r:.80}")
    return value


def _check_generator_state(name: str, value: Any, like: torch.Generator) -> None:
    """``value`` must be a state ``like``'s kind of generator accepts (checked on a fresh
    generator: nothing of the process's own RNGs changes)."""
    if not isinstance(value, torch.Tensor):
        raise _bad(name, f"must be a generator state (a uint8 tensor), not {type(value).__name__}")
    try:
        torch.Generator(device=like.device).set_state(value)
    except (RuntimeError, TypeError, ValueError) as exc:
        if _signals.signal_of(exc) is not None:
            raise  # (torch's SIGCHLD handler raises a RuntimeError too)
        raise _bad(name, f"is not a state of a {like.device} generator: {exc}") from None


def _check_states(where: str, states: Any, generators: dict[str, torch.Generator] | None) -> None:
    """One set of random states: ``rng`` (torch's global CPU generator's) and
    ``generators`` (the loader's, by path)."""
    _check_generator_state(f"{where}['rng']", checked_field(states, "rng", object, where), _CPU)
    found = checked_field(states, "generators", dict, where)
    for path, value in found.items():
        name = f"{where}['generators'][{path!r}]"
        if path not in GENERATOR_PATHS:
            raise _bad(name, f"is not one of a loader's generators {list(GENERATOR_PATHS)}")
        own = generators.get(path) if generators is not None else None
        _check_generator_state(name, value, own if own is not None else _CPU)
    if generators is not None and set(found) != set(generators):
        raise InvalidArgument(
            f"this loader cannot resume the state: {where}['generators'] has {sorted(found)}, "
            f"this loader's are {sorted(generators)} (a generator= given to one loader and "
            "not to the other, or to another sampler): make the loader with the same "
            "arguments as the one the state was taken from"
        )


def check_state(state: dict[str, Any], iterable: bool, num_workers: int, loader: Any) -> None:
    """Every field :meth:`Resume.start` (and the workers) will read, checked now."""
    generators = generators_of(loader) if loader is not None else None
    _check_states("", state, generators)
    checked_field(state, "iterator_kept", bool)
    epoch = checked_field(state, "epoch", (dict, type(None)))
    if epoch is None:
        return
    _check_states(
        "['epoch']['at_iter']", checked_field(epoch, "at_iter", dict, "['epoch']"), generators
    )
    at_pull = checked_field(epoch, "at_pull", (dict, type(None)), "['epoch']")
    if at_pull is not None:
        _check_states("['epoch']['at_pull']", at_pull, generators)
    if checked_field(epoch, "yielded", int, "['epoch']") < 0:
        raise _bad("['epoch']['yielded']", f"must not be negative, not {epoch['yielded']}")
    if state["version"] >= 2:
        samples = checked_field(epoch, "samples", (int, type(None)), "['epoch']")
        if samples is not None and (iterable or samples < 0):
            why = "must be None for an iterable dataset" if iterable else "must not be negative"
            raise _bad("['epoch']['samples']", f"{why}, not {samples}")
        order = checked_field(state, "order", type(None) if iterable else dict)
        if order is not None:
            _check_order(order)
    if not iterable:
        return
    if num_workers == 0:
        checked_field(state, "dataset", dict)  # the dataset's own state_dict() (torch's Stateful)
        return
    workers = checked_field(state, "workers", dict)
    states = checked_field(workers, "states", dict, "['workers']")
    for worker, worker_state in states.items():
        name = f"['workers']['states'][{worker!r}]"
        if isinstance(worker, bool) or not isinstance(worker, int):
            raise _bad(name, "is not a worker id (an int)")
        if not 0 <= worker < num_workers:
            raise _bad(name, f"is not a worker of this loader's {num_workers}")
        if not isinstance(worker_state, dict):
            raise _bad(
                name,
                "must be the worker's dataset state_dict() (a dict, torch's Stateful "
                f"protocol), not {type(worker_state).__name__} {worker_state!r:.80}",
            )
    following = checked_field(workers, "next", int, "['workers']")
    if not 0 <= following < num_workers:
        raise _bad("['workers']['next']", f"is not a worker of this loader's {num_workers}")


def _check_order(order: dict[str, Any]) -> None:
    """A state's record of its order (:func:`order_of`), as :func:`order_differs` reads it."""
    checked_field(order, "dataset_length", (int, type(None)), "['order']")
    by = checked_field(order, "by", str, "['order']")
    if by not in ("samples", "batches"):
        raise _bad("['order']['by']", f"must be 'samples' or 'batches', not {by!r:.80}")
    sampler = checked_field(order, "sampler", dict, "['order']")
    checked_field(sampler, "class", str, "['order']['sampler']")
    checked_field(sampler, "length", (int, type(None)), "['order']['sampler']")
    for key, value in sampler.items():
        if key not in ("class", "length", "drop_last", "epoch", *ORDER_ATTRIBUTES):
            raise _bad(f"['order']['sampler'][{key!r:.80}]", "is not a sampler attribute")
        if key not in ("class", "length") and type(value) not in (int, bool):
            raise _bad(
                f"['order']['sampler'][{key!r}]",
                f"must be int or bool, not {type(value).__name__} {value!r:.80}",
            )


def check_sampler_epoch(order: dict[str, Any], loader: Any) -> None:
    """A mid-epoch state's sampler epoch (a ``DistributedSampler``'s, set by ``set_epoch``)
    must be the loader's sampler's as the resumed epoch starts: its order depends on it."""
    taken = order["sampler"].get("epoch")
    now = order_of(loader)["sampler"].get("epoch")
    if taken != now:
        raise InvalidArgument(
            f"this loader cannot resume the state: it was taken in epoch {taken} of its "
            f"sampler ({order['sampler']['class']}), and this loader's sampler is at epoch "
            f"{now}; call its set_epoch({taken}) before iterating, as the run the state "
            "was taken from did"
        )


#: A generator of the kind torch's global RNG is (states are checked on a fresh one).
_CPU = torch.Generator()


class Shared:
    """Hands out one tensor for equal random states: a state names each distinct one once
    (``torch.save`` stores a tensor that several places name once)."""

    def __init__(self) -> None:
        self._seen: list[torch.Tensor] = []

    def __call__(self, state: torch.Tensor) -> torch.Tensor:
        for seen in self._seen:
            if seen.dtype == state.dtype and seen.shape == state.shape and torch.equal(seen, state):
                return seen
        own = state.clone()
        self._seen.append(own)
        return own


def plain(states: States | None, shared: Shared) -> dict[str, Any] | None:
    if states is None:
        return None
    rng, generators = states
    return {"rng": shared(rng), "generators": {p: shared(g) for p, g in generators.items()}}
