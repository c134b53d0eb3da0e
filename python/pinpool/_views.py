"""Typed views of slot memory: torch tensors when torch is installed, numpy arrays otherwise."""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Sequence
from typing import Any

from ._errors import InvalidArgument, OutOfBounds

_HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(int(d) < 0 for d in dims):
        raise InvalidArgument(f"negative dimension in shape {dims}")
    return tuple(int(d) for d in dims)


def _torch_dtype(torch: Any, dtype: Any) -> Any:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:  # numpy dtypes, numpy scalar types and their names ("float32", np.float32, "<f4")
        import numpy as np

        name = np.dtype(dtype).name
    except (TypeError, ImportError):
        name = getattr(dtype, "name", None) or str(dtype)
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise InvalidArgument(f"unknown dtype {dtype!r}")
    return found


def bytes_view(owner: Any, offset: int, nbytes: int) -> memoryview:
    """``nbytes`` bytes of ``owner``'s buffer from ``offset``, checked (no silent truncation)."""
    whole = memoryview(owner)
    if offset < 0 or nbytes < 0 or offset + nbytes > whole.nbytes:
        size = whole.nbytes
        whole.release()
        raise OutOfBounds(f"view [{offset}, {offset}+{nbytes}) lies outside the {size} bytes")
    return whole[offset : offset + nbytes]


def slot_view(owner: Any, dtype: Any, shape: int | Sequence[int], offset: int = 0) -> Any:
    """A tensor (or numpy array) of ``dtype``/``shape`` over ``owner``'s bytes from ``offset``.

    The view holds a buffer export of ``owner``, so a slot cannot return to its pool while the
    view lives.
    """
    dims = _shape(shape)
    count = math.prod(dims)
    if _HAVE_TORCH:
        import torch

        tdtype = _torch_dtype(torch, dtype)
        itemsize = tdtype.itemsize
        if offset % itemsize:
            raise InvalidArgument(f"offset {offset} is not a multiple of {tdtype}'s size")
        if count == 0:
            return torch.empty(dims, dtype=tdtype)
        mem = bytes_view(owner, offset, count * itemsize)
        return torch.frombuffer(mem, dtype=tdtype, count=count).view(dims)
    import numpy as np

    ndtype = np.dtype(dtype)
    if offset % ndtype.itemsize:
        raise InvalidArgument(f"offset {offset} is not a multiple of {ndtype}'s size")
    mem = bytes_view(owner, offset, count * ndtype.itemsize)
    return np.frombuffer(mem, dtype=ndtype, count=count).reshape(dims)


def torch_loaded() -> bool:
    """Whether torch has been imported by this process."""
    return "torch" in sys.modules
