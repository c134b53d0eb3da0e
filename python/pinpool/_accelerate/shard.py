"""The loader under accelerate's shard: what the hook does with a pinpool loader, and
``pinpool.prepare``.

accelerate's ``prepare_data_loader`` keeps everything that makes a shard a shard (the
``BatchSamplerShard`` or ``IterableDatasetShard``, the ``SeedableRandomSampler``, the RNG
synchronisation at each ``iter()``, the look-ahead that finds the last batch, device
placement) in its ``DataLoaderShard``/``DataLoaderDispatcher``, an adapter that iterates a
``base_dataloader`` it built as torch's ``DataLoader(dataset, batch_sampler=..., **kwargs)``
from the original's torch attributes. :func:`adopt` replaces that base loader, never iterated,
with a ``pinpool.DataLoader`` made from the base's own attributes (dataset, samplers, workers,
collate function: what accelerate chose) and the original's pinpool settings.

Invariants:

- The adopted shard yields what accelerate's own would (same index lists, drawn from the
  same sampler objects, the same RNG states), from the pinpool loader; each rank's loader,
  made inside ``prepare``, has an arena of its own on the rank's device. A pool the caller
  gave (``pool=``) is shared, as a rebuilt pinpool loader shares it.
- Where accelerate places batches on a CUDA device (``device_placement``, its default), the
  pinpool loader delivers them there itself unless its ``device`` names a GPU by index; the
  tensors accelerate's ``send_to_device`` then gets are already on its device, and it copies
  nothing.
- ``use_stateful_dataloader``: accelerate is asked for a plain base loader (no torchdata
  needed), and the adopted shard says it is stateful: its ``state_dict()`` is the pinpool
  loader's, which ``Accelerator.save_state``/``load_state`` then keep.
- A result that cannot be adopted is returned as accelerate made it, after one warning per
  process naming :func:`prepare`, which in that case goes through accelerate's public
  methods only (its shard of a torch copy, wrapped by ``pinpool.pinned``).
- The original pinpool loader is not kept alive by the shard.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import sys
import threading
import types
import warnings
from typing import Any

import torch
import torch.utils.data

from . import original

#: The oldest accelerate whose ``DataLoaderAdapter`` this module knows.
MIN_VERSION = (1, 0)

#: Parameters the wrapped functions must take (they are read or set by name).
_PARAMETERS = {
    "prepare_data_loader": ("dataloader", "device", "put_on_device", "use_stateful_dataloader"),
    "skip_first_batches": ("dataloader", "num_batches"),
}

_warned = False
_warned_lock = threading.Lock()


def version() -> str:
    try:
        return importlib.metadata.version("accelerate")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown version)"


def _release(text: str) -> tuple[int, ...]:
    numbers = []
    for part in text.split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def incompatible(module: types.ModuleType) -> str | None:
    """Why :func:`adopt` cannot work with this ``accelerate.data_loader`` (None: it can)."""
    found = version()
    release = _release(found)
    if release and release < MIN_VERSION:
        oldest = ".".join(map(str, MIN_VERSION))
        return f"accelerate {found} is older than {oldest}, the oldest pinpool knows"
    for name, needs in _PARAMETERS.items():
        function = getattr(module, name, None)
        if function is None:
            return f"accelerate {found} has no {name}"
        try:
            parameters = inspect.signature(original(function)).parameters
        except (TypeError, ValueError):
            return f"accelerate {found}'s {name} has no signature to read"
        missing = [p for p in needs if p not in parameters]
        if missing:
            return f"accelerate {found}'s {name} takes no {', '.join(missing)}"
    adapter = getattr(module, "DataLoaderAdapter", None)
    for name in ("DataLoaderShard", "DataLoaderDispatcher"):
        cls = getattr(module, name, None)
        if not (isinstance(adapter, type) and isinstance(cls, type) and issubclass(cls, adapter)):
            return f"accelerate {found} has no {name} over a DataLoaderAdapter"
    return None


def template_of(obj: Any) -> Any:
    """The pinpool loader whose settings a loader made from ``obj`` takes: ``obj`` itself,
    or the base loader of an accelerate shard over one (None: neither)."""
    from ..loader import DataLoader

    if issubclass(type(obj), DataLoader):  # type(): a shard's __class__ is its base's
        return obj
    base = getattr(obj, "__dict__", {}).get("base_dataloader")
    return base if issubclass(type(base), DataLoader) else None


def call(
    function: Any,
    name: str,
    signature: inspect.Signature | None,
    why: str | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """A call of a wrapped accelerate function (``name``); ``why``: why the module cannot be
    adopted from (see :func:`incompatible`)."""
    first = args[0] if args else kwargs.get("dataloader")
    template = template_of(first)
    if template is None:
        return function(*args, **kwargs)
    if why is not None or signature is None:
        warn(why or f"accelerate {version()}'s {name} has no signature to read")
        return function(*args, **kwargs)
    stateful = False
    if name == "prepare_data_loader":
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return function(*args, **kwargs)  # accelerate's own error
        stateful = bool(bound.arguments.get("use_stateful_dataloader", False))
        # The pinpool loader is the stateful one: accelerate need not make torchdata's.
        bound.arguments["use_stateful_dataloader"] = False
        result = function(*bound.args, **bound.kwargs)
    else:
        result = function(*args, **kwargs)
    adopted, why = adopt(result, template)
    if why is None:
        if stateful:
            adopted.use_stateful_dataloader = True
        return adopted
    warn(why)
    return function(*args, **kwargs) if stateful else result


def adopt(result: Any, template: Any) -> tuple[Any, str | None]:
    """``result`` (what accelerate returned) with a pinpool loader, made with
    ``template``'s settings, in place of the torch loader accelerate made; or ``result``
    and why not."""
    from ..loader import DataLoader

    module = sys.modules.get("accelerate.data_loader")
    kind = type(result)
    try:
        if kind is torch.utils.data.DataLoader:  # skip_first_batches of a plain loader
            return rebuild(result, template, None), None
        adapter = getattr(module, "DataLoaderAdapter", None)
        if not (isinstance(adapter, type) and issubclass(kind, adapter)):
            return result, f"accelerate {version()} returned a {kind.__name__}"
        base = result.__dict__.get("base_dataloader")
        if type(base) is DataLoader:
            return result, None  # adopted already
        if type(base) is not torch.utils.data.DataLoader:
            return result, f"accelerate {version()}'s {kind.__name__} loads from a {type(base)}"
        if kind.__name__ == "DataLoaderDispatcher":
            placement = result.state.device  # where the dispatcher sends every batch
        else:
            placement = result.__dict__.get("device")  # None: no device placement
        loader = rebuild(base, template, placement)
    except Exception as exc:  # anything unforeseen: accelerate's loader, still working
        return result, f"pinpool could not rebuild accelerate {version()}'s loader ({exc!r})"
    result.base_dataloader = loader
    if placement is not None and torch.device(placement).type == "cpu" and "device" in vars(result):
        # The batches are CPU tensors already, in the arena; accelerate's CPU placement
        # would copy each one out of it (torch's ``.to("cpu:0")``, the device of CPU ranks,
        # copies a tensor on "cpu").
        result.device = None
    # The pinpool loader's state counts the batches it yielded; accelerate's adapter takes it
    # right before its look-ahead, when that is what its consumer was given (accelerate 1.15's
    # own shard takes no correction either). An older accelerate's correction reads
    # torchdata's keys, absent here, in any distributed run.
    result.adjust_state_dict_for_prefetch = _as_taken
    _seed_generator(module, result)
    if hasattr(loader, "state_dict"):  # (False where the loader cannot resume)
        result.dl_state_dict = loader.state_dict()
    return result, None


def _as_taken() -> None:
    """A shard's ``adjust_state_dict_for_prefetch``: the state stays as the loader gave it."""


def _seed_generator(module: Any, shard: Any) -> None:
    """Makes the generator a ``SeedableRandomSampler`` would make at its first ``iter()``,
    now: a loader's state names the generators it has, and one made only at the first epoch
    would be missing from a fresh loader's, which then refuses the state. The sampler seeds
    it again at every ``iter()`` (from its seed and epoch), so the order is the same."""
    seedable = getattr(module, "SeedableRandomSampler", None)
    get_sampler = getattr(module, "get_sampler", None)
    if not isinstance(seedable, type) or get_sampler is None:
        return
    try:
        found = get_sampler(shard)
    except AttributeError:
        return
    if not isinstance(found, seedable):
        return
    sampler: Any = found
    if sampler.generator is None:
        device = torch.get_default_device() if hasattr(torch, "get_default_device") else "cpu"
        sampler.generator = torch.Generator(device=device)
        sampler.generator.manual_seed(sampler.initial_seed)


def sampling(loader: Any) -> dict[str, Any]:
    """The sampling arguments that make a loader draw as ``loader`` does (its own sampler
    objects)."""
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return {"batch_size": loader.batch_size, "drop_last": loader.drop_last}
    if loader.batch_size is None and loader.batch_sampler is not None:
        return {"batch_sampler": loader.batch_sampler}
    return {
        "batch_size": loader.batch_size,
        "sampler": loader.sampler,
        "drop_last": loader.drop_last,
    }


def torch_arguments(loader: Any) -> dict[str, Any]:
    """``loader``'s other torch arguments (all but sampling and pinning)."""
    out = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
    }
    if hasattr(loader, "in_order"):
        out["in_order"] = loader.in_order
    return out


def delivery_device(own: Any, placement: Any) -> Any:
    """The device the pinpool loader delivers on: accelerate's CUDA ``placement`` unless
    the loader's own ``device`` names a GPU by index."""
    if placement is None or torch.device(placement).type != "cuda":
        return own
    if own is not None and torch.device(own).type == "cuda" and torch.device(own).index is not None:
        return own
    return placement


def rebuild(base: Any, template: Any, placement: Any) -> Any:
    """A pinpool loader drawing as ``base`` (a torch loader accelerate made), with
    ``template``'s pinpool settings."""
    from ..loader import PINPOOL_ARGUMENTS, DataLoader

    settings = {name: template.__dict__[name] for name in PINPOOL_ARGUMENTS}
    settings["device"] = delivery_device(settings["device"], placement)
    return DataLoader(base.dataset, **sampling(base), **torch_arguments(base), **settings)


def prepare(accelerator: Any, loader: Any, *, device_placement: bool | None = None) -> Any:
    """``accelerator.prepare_data_loader(loader, device_placement=...)``, keeping the pool
    of ``loader`` (a ``pinpool.DataLoader``; any other loader goes to accelerate as it is).

    With a pinpool loader, ``accelerator.prepare(loader)`` already does this (pinpool patches
    accelerate's ``prepare_data_loader`` as accelerate is imported): accelerate's shard, with
    a ``pinpool.DataLoader`` of the same settings under it. This call does the same where
    that patch is off (``PINPOOL_ACCELERATE_HOOK=0``), and where accelerate is not the shape
    pinpool knows (a warning says so when ``prepare`` drops the pool) it uses accelerate's
    public methods only: accelerate's shard of a torch copy of ``loader``, without device
    placement, wrapped by ``pinpool.pinned`` (batches copied into the pool on the iterating
    thread, onto ``accelerator.device`` where accelerate would place them; no zero-copy, and
    ``state_dict`` only as accelerate's shard has one).

    >>> model, optimizer = accelerator.prepare(model, optimizer)
    >>> loader = pinpool.prepare(accelerator, pinpool.DataLoader(dataset, batch_size=64))
    """
    template = template_of(loader)
    if template is None:
        return accelerator.prepare_data_loader(loader, device_placement=device_placement)
    module = importlib.import_module("accelerate.data_loader")
    why = incompatible(module)
    if why is None:
        result = accelerator.prepare_data_loader(loader, device_placement=device_placement)
        adopted, why = adopt(result, template)
        if why is not None:
            warn(why)
        return adopted
    # accelerate's public methods only: its shard of a torch loader drawing as this one,
    # without device placement, and pinpool.pinned over it.
    from ..adapter import pinned

    plain = torch.utils.data.DataLoader(
        template.dataset, **sampling(template), **torch_arguments(template), pin_memory=False
    )
    shard = accelerator.prepare_data_loader(plain, device_placement=False)
    place = getattr(accelerator, "device_placement", True)
    place = place if device_placement is None else device_placement
    own = template.__dict__
    return pinned(
        shard,
        device=delivery_device(own["device"], accelerator.device if place else None),
        pool=own["pool"],
        slot_bytes=own["slot_bytes"],
        num_slots=own["num_slots"],
        copy_threads=own["copy_threads"],
        slot_timeout=own["slot_timeout"],
        overflow=own["overflow"],
        oversize=own["oversize"],
    )


def warn(why: str) -> None:
    """Warns, once per process, that a pinpool loader went through accelerate without its
    pool (``why``)."""
    global _warned
    with _warned_lock:
        if _warned:
            return
        _warned = True
    inside = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep]
    where = getattr(sys.modules.get("accelerate"), "__file__", None)
    if where:
        inside.append(os.path.dirname(os.path.abspath(where)) + os.sep)
    level = 1
    frame: types.FrameType | None = sys._getframe(0)
    while frame is not None and frame.f_code.co_filename.startswith(tuple(inside)):
        level, frame = level + 1, frame.f_back
    warnings.warn(
        f"pinpool: {why}; the loader accelerate prepared from a pinpool.DataLoader loads "
        "without pinpool's pool. loader = pinpool.prepare(accelerator, loader) keeps the pool "
        "(see the user guide, 'Lightning and accelerate'). Warned once per process.",
        UserWarning,
        stacklevel=level if frame is not None else 1,
    )
