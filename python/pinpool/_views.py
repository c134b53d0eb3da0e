"""Typed views of slot memory: torch tensors when torch is installed, numpy arrays otherwise."""

from __future__ import annotations

import importlib.util
import math
import operator
from collections.abc import Sequence
from typing import Any

from ._errors import InvalidArgument, OutOfBounds

_HAVE_TORCH = importlib.util.find_spec("torch") is not None

#: The torch dtypes whose elements are plain bytes in memory, one or more bytes each: the only
#: ones a view of raw slot memory (or a batch leaf) may have. Quantized dtypes (``quint8``...)
#: carry a quantizer that ``torch.frombuffer`` does not set (using such a view crashes the
#: interpreter), and sub-byte and ``bits`` dtypes have no arithmetic.
PLAIN_TORCH_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
)


def _integer(value: Any) -> int | None:
    """``value`` as an int if it is one (a numpy integer too; not a bool, a float or a string,
    which a view would have to guess at), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    if _integer(shape) is not None:
        dims: tuple[Any, ...] = (shape,)
    elif isinstance(shape, (str, bytes)):
        raise InvalidArgument(f"shape must be an int or a sequence of ints, not {shape!r}")
    else:
        try:
            dims = tuple(shape)
        except TypeError:
            raise InvalidArgument(
                f"shape must be an int or a sequence of ints, not {shape!r}"
            ) from None
    out = tuple(_integer(d) for d in dims)
    if any(d is None for d in out):
        raise InvalidArgument(f"shape {shape!r} holds something other than integers")
    if any(d < 0 for d in out):  # type: ignore[operator]
        raise InvalidArgument(f"negative dimension in shape {out}")
    return out  # type: ignore[return-value]


def _offset(offset: Any) -> int:
    found = _integer(offset)
    if found is None or found < 0:
        raise InvalidArgument(f"offset must be a non-negative integer, not {offset!r}")
    return found


def _torch_dtype(torch: Any, dtype: Any) -> Any:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:  # (numpy reads None as float64)
        raise InvalidArgument("a slot view needs a dtype, not None")
    try:  # numpy dtypes, numpy scalar types and their names ("float32", np.float32, "<f4")
        import numpy as np

        found = np.dtype(dtype)
        if not found.isnative:
            # A torch tensor has no byte order: a view would read the bytes swapped.
            raise InvalidArgument(
                f"a slot view cannot have dtype {dtype!r}: torch tensors are in this "
                "machine's byte order; view the bytes with the native dtype and swap them "
                "(or use numpy on memoryview(slot))"
            )
        name = found.name
    except InvalidArgument:
        raise
    except (TypeError, ImportError, ValueError, SyntaxError):
        # (numpy parses strings, and raises what it meets: "0:", "01")
        name = getattr(dtype, "name", None) or str(dtype)
    found = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(found, torch.dtype):
        raise InvalidArgument(f"unknown dtype {dtype!r}")
    return found


def _plain_torch_dtype(torch: Any, dtype: Any) -> Any:
    found = _torch_dtype(torch, dtype)
    if str(found).removeprefix("torch.") not in PLAIN_TORCH_DTYPE_NAMES:
        raise InvalidArgument(
            f"a slot view cannot have dtype {found}: only plain numeric dtypes "
            f"({', '.join(PLAIN_TORCH_DTYPE_NAMES)}), not quantized, sub-byte or bits dtypes"
        )
    return found


def _plain_numpy_dtype(dtype: Any) -> Any:
    import numpy as np

    try:
        found = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError):
        raise InvalidArgument(f"unknown dtype {dtype!r}") from None
    if dtype is None:  # (numpy reads None as float64)
        raise InvalidArgument("a slot view needs a dtype, not None")
    if found.hasobject or found.itemsize == 0:
        raise InvalidArgument(f"a slot view cannot have dtype {found}: it holds no plain bytes")
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
    offset = _offset(offset)
    count = math.prod(dims)
    if _HAVE_TORCH:
        import torch

        tdtype = _plain_torch_dtype(torch, dtype)
        itemsize = tdtype.itemsize
        if offset % itemsize:
            raise InvalidArgument(f"offset {offset} is not a multiple of {tdtype}'s size")
        if count == 0:
            return torch.empty(dims, dtype=tdtype)
        mem = bytes_view(owner, offset, count * itemsize)
        return torch.frombuffer(mem, dtype=tdtype, count=count).view(dims)
    import numpy as np

    ndtype = _plain_numpy_dtype(dtype)
    if offset % ndtype.itemsize:
        raise InvalidArgument(f"offset {offset} is not a multiple of {ndtype}'s size")
    mem = bytes_view(owner, offset, count * ndtype.itemsize)
    return np.frombuffer(mem, dtype=ndtype, count=count).reshape(dims)
