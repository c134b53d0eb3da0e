"""What pinpool relies on in torch's and multiprocessing's private internals.

torch's DataLoader has no public way to change how its workers are fed, what they return or
how they are shut down: pinpool subclasses its multi-process iterator, reads and sets some of
its attributes, collates with torch's own collate functions, and writes the workers' index
queues itself. Any torch release may change these. This module is where all of it is named.

Invariants:

- Every private name of torch's or multiprocessing's that pinpool's package uses is reached
  through this module: the other modules import the objects below from here and never spell
  a private torch or multiprocessing path themselves
  (``tests/package/test_torch_contract.py`` scans for them). The one exception is
  ``_cuda_stream``, which reads ``torch._C``'s ``_cuda_getCurrentRawStream`` itself, as
  :data:`cuda_raw_stream` does here: it runs when any slot is released, and importing
  pinpool must not import torch. ``pinpool.bench`` keeps its own.
- Attributes read or set on torch's iterator, on the DataLoader or on a multiprocessing queue
  are named in :data:`ITERATOR_ATTRIBUTES`, :data:`LOADER_ATTRIBUTES` and
  :data:`QUEUE_ATTRIBUTES` (each name with what pinpool uses it for); the modules keep using
  them as attributes.
- Every entry was checked on torch 2.6.0 and 2.15.0, the ends of the tested range
  (``_torch_versions``), with Python 3.11's multiprocessing (3.12's and 3.13's set the same
  queue attributes); an entry that differs between them says so (only ``_pin_memory``, in
  how torch sets it). The test suite's ``tests/package/torch_contract_check.py`` tells what
  is missing or changed on the torch installed, and runs on both ends.
- Importing this module costs little: it imports torch (whose import loads its DataLoader
  modules already) and ``multiprocessing.queues``, nothing of pinpool's, and makes nothing (no
  iterator, queue or process); only the check, in the test suite, reads sources (and opens
  one pipe).
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.queues
import threading
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch
import torch.utils.data
import torch.utils.data._utils as _utils
import torch.utils.data._utils.signal_handling
import torch.utils.data.dataloader
from torch.utils.data._utils import collate as torch_collate

__all__ = [
    "COLLATE_ATTRIBUTES",
    "ITERATOR_ATTRIBUTES",
    "LEADING_PARAMETERS",
    "LOADER_ATTRIBUTES",
    "METHOD_SIGNATURES",
    "QUEUE_ATTRIBUTES",
    "RERAISE_CODE",
    "MultiProcessingIter",
    "MultiprocessingQueue",
    "cuda_raw_stream",
    "dataset_kind",
    "default_convert",
    "get_spawning_popen",
    "mp_status_check_interval",
    "profiler_enabled",
    "python_exit_status",
    "remove_worker_pids",
    "serialize_polls",
    "torch_collate",
    "unflatten_dense_tensors",
]

# -- torch.utils.data ------------------------------------------------------------------------

#: torch's multi-process iterator (``dataloader._MultiProcessingDataLoaderIter``):
#: ``_main.epochs.workers.WorkersIter`` subclasses it (see :data:`ITERATOR_ATTRIBUTES` for what
#: it uses).
MultiProcessingIter = torch.utils.data.dataloader._MultiProcessingDataLoaderIter


def dataset_kind() -> Any:
    """``torch.utils.data._DatasetKind``: its ``create_fetcher(kind, dataset, auto_collation,
    collate_fn, drop_last)``, which a worker calls once its ``worker_init_fn`` has run, is
    where a streaming worker's fetcher is made (``_worker.fetcher.stream_in_this_worker``,
    in the worker only), and ``Map``."""
    return torch.utils.data._DatasetKind


# torch_collate, imported above (``torch.utils.data._utils.collate``): the workers collate the
# way ``default_collate`` does with its ``collate(batch, collate_fn_map=...)``,
# ``collate_tensor_fn`` and ``default_collate_fn_map``, tensors' stacks deferred
# (``_wire.codec``) or streamed (``_worker.streaming``).

#: ``torch_collate.default_convert`` (the same object as ``torch.utils.data.default_convert``):
#: a batch without automatic batching is converted as torch converts it (``_worker.collate``).
default_convert = torch_collate.default_convert

#: What pinpool uses in :data:`torch_collate`.
COLLATE_ATTRIBUTES: dict[str, str] = {
    "collate": "collates a batch with a table of per-type functions (keyword collate_fn_map)",
    "collate_tensor_fn": "torch's tensor stack, for stacks pinpool does not defer",
    "default_collate_fn_map": "default_collate's table, copied with tensors deferred",
    "default_convert": "the conversion without automatic batching",
}


def mp_status_check_interval() -> float:
    """``_utils.MP_STATUS_CHECK_INTERVAL``: how long torch waits for a worker to exit before
    it gives up (5 s); pinpool waits as long before it kills one
    (``_main.epochs.shutdown.reap_workers``). Read at each call."""
    return float(_utils.MP_STATUS_CHECK_INTERVAL)


def python_exit_status() -> Any:
    """``_utils.python_exit_status``: True once the interpreter is exiting, when torch's
    shutdown does nothing and neither does pinpool's
    (``_main.epochs.shutdown.shutting_down_python``); None if torch no longer has it (or its
    module is gone at exit)."""
    return getattr(_utils, "python_exit_status", None)


def remove_worker_pids(iterator_id: int) -> None:
    """``_utils.signal_handling._remove_worker_pids(id(iterator))``: unregisters an iterator's
    workers from torch's SIGCHLD handler, which then no longer raises for them (pinpool reaps
    the workers torch's shutdown left, ``_main.epochs.shutdown.reap_workers``)."""
    _utils.signal_handling._remove_worker_pids(iterator_id)


#: The names pinpool reads, sets or overrides on ``_MultiProcessingDataLoaderIter`` (and its
#: base ``_BaseDataLoaderIter``), and what for.
ITERATOR_ATTRIBUTES: dict[str, str] = {
    # methods overridden or called
    "_reset": "overridden: the index queues are turned to direct writes before the first "
    "epoch's indices go out (first_iter=True)",
    "_next_data": "called by the profiler-free __next__",
    "_try_get_data": "overridden: a batch is received as it leaves the result queue when "
    "there is no pin thread; returns (success, (index, batch))",
    "_shutdown_workers": "overridden and called: pinpool completes what torch's shutdown "
    "left, and shuts an iterator down when its epoch ends",
    # attributes torch sets on the iterator
    "_index_queues": "each worker's multiprocessing queue of indices: written directly, "
    "sent the exit message and closed after shutdown",
    "_worker_queue_idx_cycle": "set afresh by _reset each epoch: a property turns the first "
    "one on to the worker a resumed epoch starts at",
    "_workers": "the worker processes: reaped (or killed) after shutdown",
    "_workers_done_event": "set before the workers are told to exit",
    "_worker_pids_set": "whether the workers are registered with torch's SIGCHLD handler",
    "_pin_memory": "whether torch's pin thread runs (else batches are received in "
    "_try_get_data, as each leaves the result queue): torch sets it from loader.pin_memory, which "
    "_get_iterator shows torch as the delivery mode has it",
    "_pin_memory_thread": "the pin thread, started by torch's __init__ (torch's shutdown joins it)",
    "_pin_memory_thread_done_event": "set by torch's shutdown to stop the pin thread",
    "_data_queue": "the pin thread's output queue, emptied at shutdown (its batches hold slots); "
    "without one, the workers' result queue itself (pinpool's reads it whole: "
    "_main.epochs.results)",
    "_worker_result_queue": "the workers' results: its feeder is not waited for at exit once "
    "the workers are shut down (torch's shutdown may be cut short before it says so)",
    "_task_info": "batches held out of order, dropped at shutdown",
    "_rcvd_idx": "how many index lists the epoch has passed on (checkpoints); when it reaches "
    "_send_idx, no task is in flight: an ended epoch's shutdown goes to the ending thread",
    "_shutdown": "set by torch's shutdown: an iterator not yet shut down ends in the background",
    "_index_sampler": "the loader's index sampler as the iterator started (zero-copy: the task "
    "tagger, told the consumer's next task)",
    "_sampler_iter": "None before the first __next__ (torch's own __next__ then)",
    "_IterableDataset_len_called": "set for an iterable dataset's length check (torch's own "
    "__next__ then)",
    "_num_yielded": "counted by the profiler-free __next__, as torch's does",
    "_send_idx": "the number of the next index list, sent to a worker as (number, indices): "
    "every task sent is answered once _rcvd_idx reaches it",
    "_persistent_workers": "persistent workers do not exit at the epoch's end: their shutdown "
    "is not handed to the ending thread",
}

#: The names pinpool reads or overrides on ``torch.utils.data.DataLoader``, and what for.
LOADER_ATTRIBUTES: dict[str, str] = {
    "_get_iterator": "overridden: the workers get pinpool's collate (and a worker_init_fn that "
    "has them stream) as the iterator starts",
    "_index_sampler": "overridden property: records each epoch, tags each index list with its "
    "zero-copy task",
    "_iterator": "a persistent loader's iterator, shut down before a resumed iterable epoch",
    "_auto_collation": "whether torch batches samples (checkpoints)",
}

#: The torch methods whose parameters pinpool's overrides and calls rely on: (class, name,
#: parameter names).
METHOD_SIGNATURES: tuple[tuple[type, str, tuple[str, ...]], ...] = (
    (MultiProcessingIter, "_reset", ("self", "loader", "first_iter")),
    (MultiProcessingIter, "_try_get_data", ("self", "timeout")),
    (MultiProcessingIter, "_shutdown_workers", ("self",)),
    (MultiProcessingIter, "_next_data", ("self",)),
    (MultiProcessingIter, "__next__", ("self",)),
    (MultiProcessingIter, "__del__", ("self",)),
    (torch.utils.data.DataLoader, "_get_iterator", ("self",)),
)

#: Those whose leading parameters are all pinpool relies on (the rest is passed on as it comes).
LEADING_PARAMETERS: tuple[tuple[type, str, tuple[str, ...]], ...] = ()

# -- torch's other private parts ---------------------------------------------------------------


def serialize_polls(process: Any) -> None:
    """Makes the ``poll`` of a multiprocessing ``Process``'s ``_popen`` (what ``join``,
    ``is_alive`` and ``exitcode`` reach) one thread at a time. Two threads that poll a child
    at once (the ending thread reaping an epoch's workers, the caller joining them) race in
    multiprocessing: the one whose ``waitpid`` finds the child reaped already gets no status,
    and ``is_alive()`` answers True for a child that has exited."""
    popen = getattr(process, "_popen", None)
    poll = getattr(popen, "poll", None)
    if poll is None or getattr(poll, "_pinpool", False):
        return
    lock = threading.Lock()

    def serialized(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return poll(*args, **kwargs)

    serialized._pinpool = True  # type: ignore[attr-defined]
    popen.poll = serialized


#: The code of ``torch._utils.ExceptionWrapper.reraise`` (None without it): its frame keeps a
#: worker's exception alive in a cycle, and pinpool clears that frame's locals
#: (``_main.epochs.loader_iter._unkeep``).
RERAISE_CODE: CodeType | None = getattr(
    getattr(getattr(torch._utils, "ExceptionWrapper", None), "reraise", None), "__code__", None
)


def profiler_enabled() -> bool:
    """``torch._C._autograd._profiler_enabled()``: whether a torch profiler (or NVTX/ITT range
    emitter) is recording; the iterator opens a profiler range per batch only then. True if
    torch no longer has it (torch's own ``__next__`` then)."""
    enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    return True if enabled is None else bool(enabled())


#: ``torch._C._cuda_getCurrentRawStream(device_index)``: torch's current stream as a raw
#: handle, without making a Stream object (``_main.route.delivery``); None without it (a build
#: without CUDA), where ``torch.cuda.current_stream(...).cuda_stream`` serves.
cuda_raw_stream: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)

#: ``torch._C._nn.unflatten_dense_tensors(flat, like)``, what ``torch._utils.
#: _unflatten_dense_tensors`` (DDP's bucketing) calls: in one native call, consecutive views of
#: the 1-D tensor ``flat``, one per tensor of ``like``, each of its numel and shape (only those
#: are read of ``like``: meta tensors serve). A batch on the device whose leaves share one dtype
#: is viewed so (``_wire.leaves.DeviceLayout``); None without it (one view per leaf then).
unflatten_dense_tensors: Callable[[torch.Tensor, list[torch.Tensor]], list[torch.Tensor]] | None = (
    getattr(getattr(torch._C, "_nn", None), "unflatten_dense_tensors", None)
)

# -- multiprocessing ----------------------------------------------------------------------------

#: ``multiprocessing.queues.Queue``, the class of torch's index queues:
#: ``_main.epochs.index_queue`` subclasses it and swaps a queue's ``__class__`` for that subclass
#: before anything is put.
MultiprocessingQueue = multiprocessing.queues.Queue

#: The names pinpool reads on a ``multiprocessing.queues.Queue``, and what for.
QUEUE_ATTRIBUTES: dict[str, str] = {
    "_thread": "the feeder thread, None until the first put(): only such a queue is turned",
    "_writer": "the pipe's writing end: its descriptor is handed to the Rust writer, which "
    "frames messages as Connection.send_bytes does; closed with the queue",
    "_reader": "the pipe's reading end (the workers' copy reads): closed with the queue",
    "_sem": "the bounded semaphore put() acquires and the worker's get() releases",
    "_closed": "whether close() was called: put() refuses, and no exit message is sent",
}

#: ``multiprocessing.context.get_spawning_popen()`` (undocumented): not None while a process
#: is being started by spawn or a forkserver, the only time a pool hint pickles its pipe
#: (``_wire.pool_hint``).
get_spawning_popen: Callable[[], Any] = multiprocessing.context.get_spawning_popen
