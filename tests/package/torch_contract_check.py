"""Whether the installed torch (and multiprocessing) still keeps ``_torch_contract``: each
private name, attribute, signature and framing that module declares, checked against torch's
sources and objects.

Invariants: :func:`check_installed_torch` never raises (a part that cannot run is a finding
too) and makes no iterator or process (it reads sources and opens one pipe); it is run by the
test suite on both ends of the tested torch range (it is the suite's, not the package's).
Like ``_torch_contract``, and alone with it, it spells torch's private paths.
"""

from __future__ import annotations

import ast
import inspect
import multiprocessing
import os
import struct
import textwrap

import torch
import torch.utils.data
import torch.utils.data._utils as _utils

from pinpool._torch_contract import (
    COLLATE_ATTRIBUTES,
    ITERATOR_ATTRIBUTES,
    LEADING_PARAMETERS,
    METHOD_SIGNATURES,
    QUEUE_ATTRIBUTES,
    RERAISE_CODE,
    MultiProcessingIter,
    MultiprocessingQueue,
    cuda_raw_stream,
    get_spawning_popen,
    torch_collate,
    unflatten_dense_tensors,
)

__all__ = ["assigned_attributes", "check_installed_torch"]


def check_installed_torch() -> list[str]:
    """What is missing or changed on the installed torch (and multiprocessing), one line each;
    empty when everything above is as pinpool expects. Reads torch's sources (no iterator is
    made); never raises."""
    problems: list[str] = []
    for part in (_check_utils, _check_collate, _check_classes, _check_queue, _check_others):
        try:
            problems.extend(part())
        except Exception as exc:  # (a check that cannot run is a finding too)
            problems.append(f"{part.__name__[1:]} could not run: {exc!r}")
    return problems


def _check_utils() -> list[str]:
    out = []
    interval = getattr(_utils, "MP_STATUS_CHECK_INTERVAL", None)
    if not isinstance(interval, (int, float)) or isinstance(interval, bool) or interval <= 0:
        out.append(f"torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL is {interval!r}")
    if not isinstance(getattr(_utils, "python_exit_status", None), bool):
        out.append("torch.utils.data._utils.python_exit_status is missing or not a bool")
    if not callable(getattr(_utils.signal_handling, "_remove_worker_pids", None)):
        out.append("torch.utils.data._utils.signal_handling._remove_worker_pids is missing")
    return out


def _check_collate() -> list[str]:
    out = []
    for name in COLLATE_ATTRIBUTES:
        if not hasattr(torch_collate, name):
            out.append(f"torch.utils.data._utils.collate.{name} is missing")
    for name in ("collate", "collate_tensor_fn"):
        function = getattr(torch_collate, name, None)
        if function is None:
            continue
        parameter = inspect.signature(function).parameters.get("collate_fn_map")
        if parameter is None or parameter.kind is not inspect.Parameter.KEYWORD_ONLY:
            out.append(f"torch.utils.data._utils.collate.{name} takes no keyword collate_fn_map")
    table = getattr(torch_collate, "default_collate_fn_map", None)
    if not isinstance(table, dict) or torch.Tensor not in table:
        out.append("torch.utils.data._utils.collate.default_collate_fn_map has no torch.Tensor")
    if getattr(torch_collate, "default_convert", None) is not torch.utils.data.default_convert:
        out.append("torch.utils.data._utils.collate.default_convert is not torch's public one")
    return out


def _parameters(cls: type, name: str) -> tuple[str, ...] | None:
    """The parameter names of ``cls.name``, or None where it is missing."""
    function = inspect.getattr_static(cls, name, None)
    return tuple(inspect.signature(function).parameters) if callable(function) else None


def _check_classes() -> list[str]:
    out = []
    iterator, loader = MultiProcessingIter, torch.utils.data.DataLoader
    for cls, name, expected in METHOD_SIGNATURES:
        found = _parameters(cls, name)
        if found is None:
            out.append(f"{cls.__name__}.{name} is missing")
        elif found != expected:
            out.append(f"{cls.__name__}.{name} takes {found}, not {expected}")
    for cls, name, leading in LEADING_PARAMETERS:
        found = _parameters(cls, name)
        if found is None:
            out.append(f"{cls.__name__}.{name} is missing")
        elif found[: len(leading)] != leading:
            out.append(f"{cls.__name__}.{name} takes {found}, not {leading} first")
    methods = {
        name for cls, name, _ in (*METHOD_SIGNATURES, *LEADING_PARAMETERS) if cls is iterator
    }
    assigned = assigned_attributes(iterator)
    for name in ITERATOR_ATTRIBUTES:
        if name not in methods and name not in assigned:
            out.append(f"{iterator.__name__} no longer sets self.{name}")
    if "_worker_queue_idx_cycle" not in assigned_attributes(iterator, "_reset"):
        out.append(f"{iterator.__name__}._reset no longer sets self._worker_queue_idx_cycle")
    for name in ("_index_sampler", "_auto_collation"):
        if not isinstance(inspect.getattr_static(loader, name, None), property):
            out.append(f"DataLoader.{name} is not a property")
    if "_iterator" not in assigned_attributes(loader, "__init__"):
        out.append("DataLoader.__init__ no longer sets self._iterator")
    return out


def _check_queue() -> list[str]:
    out = []
    queue = MultiprocessingQueue
    assigned = assigned_attributes(queue)
    for name in QUEUE_ATTRIBUTES:
        if name not in assigned:
            out.append(f"multiprocessing.queues.Queue no longer sets self.{name}")
    if "__slots__" in vars(queue):
        out.append("multiprocessing.queues.Queue has __slots__ (its __class__ is swapped)")
    if not callable(get_spawning_popen):
        out.append("multiprocessing.context.get_spawning_popen is missing")
    # The Rust writer frames a message as Connection.send_bytes does: the reader must take it.
    reader, writer = multiprocessing.Pipe(duplex=False)
    try:
        os.write(writer.fileno(), struct.pack("!i", 3) + b"abc")
        if not reader.poll(1.0) or reader.recv_bytes() != b"abc":
            out.append("multiprocessing.connection.Connection reads another framing")
    finally:
        reader.close()
        writer.close()
    return out


def _check_others() -> list[str]:
    out = []
    kind = getattr(torch.utils.data, "_DatasetKind", None)
    fetcher = getattr(kind, "create_fetcher", None)
    if fetcher is None or tuple(inspect.signature(fetcher).parameters) != (
        "kind",
        "dataset",
        "auto_collation",
        "collate_fn",
        "drop_last",
    ):
        out.append("torch.utils.data._DatasetKind.create_fetcher is missing or changed")
    if getattr(kind, "Map", None) is None:
        out.append("torch.utils.data._DatasetKind.Map is missing")
    if RERAISE_CODE is None:
        out.append("torch._utils.ExceptionWrapper.reraise is missing")
    if not callable(getattr(torch._C._autograd, "_profiler_enabled", None)):
        out.append("torch._C._autograd._profiler_enabled is missing")
    if cuda_raw_stream is None and torch.backends.cuda.is_built():
        out.append("torch._C._cuda_getCurrentRawStream is missing (a build with CUDA)")
    if unflatten_dense_tensors is None:
        out.append("torch._C._nn.unflatten_dense_tensors is missing")
    else:
        flat = torch.arange(6)
        like = [torch.empty(2, device="meta"), torch.empty((2, 2), device="meta")]
        views = unflatten_dense_tensors(flat, like)
        if [v.shape for v in views] != [(2,), (2, 2)] or views[1].storage_offset() != 2:
            out.append("torch._C._nn.unflatten_dense_tensors gives other views")
    return out


def assigned_attributes(cls: type, method: str | None = None) -> set[str]:
    """The attribute names ``self.NAME = ...`` assigns (in a plain, annotated, augmented or
    tuple assignment) in the methods of ``cls`` and of its bases with Python source, or only
    in ``method`` of the class that defines it."""

    if method is not None:
        owner = next(c for c in cls.__mro__ if method in vars(c))
        sources = [inspect.getsource(vars(owner)[method])]
    else:
        sources = []
        for c in cls.__mro__:
            try:
                sources.append(inspect.getsource(c))
            except (OSError, TypeError):  # (object, and any class written in C)
                pass
    found: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(textwrap.dedent(source))):
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            else:
                continue
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets.extend(target.elts)
                elif (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    found.add(target.attr)
    return found
