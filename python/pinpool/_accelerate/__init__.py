"""accelerate's ``prepare`` keeps pinpool's pool: the hook (this package) and the shard's
loader (:mod:`.shard`).

accelerate has no hook for a loader class: its ``prepare_data_loader`` rebuilds every loader
as torch's own ``DataLoader``, from the original's torch attributes, under its
``DataLoaderShard`` (or ``DataLoaderDispatcher``). pinpool wraps that function, and
``skip_first_batches``, in ``accelerate.data_loader`` (and where ``accelerate.accelerator``
and ``accelerate`` bound them by name): a call with a pinpool loader runs accelerate's own
function unchanged, then :func:`.shard.adopt` puts a ``pinpool.DataLoader`` in place of the
torch loader accelerate built.

Invariants:

- Importing pinpool imports neither torch nor accelerate. When ``accelerate.data_loader``
  is already imported, it is patched at once; otherwise a finder at the front of
  ``sys.meta_path`` patches it right after it executes (before ``accelerate.accelerator``
  imports its names) and removes itself. ``PINPOOL_ACCELERATE_HOOK=0`` leaves accelerate
  untouched.
- Patching is idempotent: a wrapper records the function it wraps, and a module whose
  function is already a wrapper is left as it is.
- A call whose loader is not a pinpool loader (nor an accelerate shard over one) goes to
  accelerate's function with the same arguments and returns its result, untouched.
- A module that is not the shape :mod:`.shard` knows (:func:`.shard.incompatible`: the
  functions' parameters, the shard classes) gets wrappers that only warn, once per process,
  when a pinpool loader goes through them; so does a call whose result cannot be adopted.
  The warning names ``pinpool.prepare``, which needs nothing of accelerate's internals.
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

#: The module whose functions are wrapped, and where else accelerate binds them by name.
TARGET = "accelerate.data_loader"
_REBOUND = ("accelerate.accelerator", "accelerate")
#: The wrapped functions.
FUNCTIONS = ("prepare_data_loader", "skip_first_batches")


def enabled() -> bool:
    return os.environ.get("PINPOOL_ACCELERATE_HOOK", "1").strip() != "0"


def install() -> None:
    """Patches accelerate now if it is imported, else as soon as it is (see the module)."""
    if not enabled():
        return
    module = sys.modules.get(TARGET)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def original(function: Any) -> Any:
    """The accelerate function a wrapper wraps (the function itself if it is none)."""
    return getattr(function, "__pinpool_wraps__", function)


def patch(module: ModuleType) -> None:
    """Wraps ``module``'s functions (once), and rebinds them where accelerate bound them."""
    from . import shard

    why = shard.incompatible(module)
    for name in FUNCTIONS:
        function = getattr(module, name, None)
        if function is None or hasattr(function, "__pinpool_wraps__"):
            continue
        wrapper = _wrap(function, name, why)
        setattr(module, name, wrapper)
        for other in _REBOUND:
            bound = sys.modules.get(other)
            if bound is not None and getattr(bound, name, None) is function:
                setattr(bound, name, wrapper)


def _wrap(function: Callable[..., Any], name: str, why: str | None) -> Callable[..., Any]:
    try:
        signature: inspect.Signature | None = inspect.signature(function)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # No pinpool loader exists before pinpool.loader is imported: nothing to look at.
        if "pinpool.loader" not in sys.modules:
            return function(*args, **kwargs)
        from . import shard

        return shard.call(function, name, signature, why, args, kwargs)

    wrapper.__pinpool_wraps__ = function  # type: ignore[attr-defined]
    return wrapper


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``accelerate.data_loader`` through the other finders and hands back its spec
    with a loader that patches the module once it has executed; one use only."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> Any:
        if fullname != TARGET:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and enabled():
            spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    """A module loader that patches the module after the real loader executed it; anything
    else (``get_source``, resources) is the real loader's."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        patch(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
