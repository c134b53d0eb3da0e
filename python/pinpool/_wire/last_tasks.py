"""The end of an epoch, told to each worker with its last task.

When an epoch ends, torch's iterator tells its workers to exit (non-persistent workers) and
waits for each in turn on the training thread. A worker's exit tears down every page it has
mapped, its ring of segments included (tens to hundreds of MB it wrote batches into), and that
walk is what the main process waits for. A worker that knows a task is its last of the epoch
drops those page tables as soon as the task's batch is sent, while the main process is still
taking the epoch's last batches, so its exit has little left to do.

The main process knows which tasks are the last ones: the final ``num_workers`` index lists
of a sized epoch (torch deals tasks to the workers in turn, so each worker gets one of them;
one that gets two just faults its pages back in). It pickles such a task as a
:class:`LastTask`, which unpickles in the worker, inside torch's ``index_queue.get()``, into
the very same ``(index, indices)`` message, after :func:`arrived` has noted it. The worker
asks :func:`take` once the batch's handle is made.

Invariants: a :class:`LastTask` unpickles into exactly the message it wraps (torch's worker
loop sees nothing new); the note is per process and is taken at most once per task; nothing
here waits or fails: a task wrongly taken for a last one costs page faults, never a byte of
a batch.
"""

from __future__ import annotations

from typing import Any

#: Whether a last task arrived in this process since the last :func:`take`.
_arrived = False


class LastTask:
    """A worker's message ``(index, indices)`` that is its last of the epoch: pickled as a
    call of :func:`arrived` with the message (the worker's unpickling makes the call)."""

    __slots__ = ("message",)

    def __init__(self, message: Any) -> None:
        self.message = message

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return arrived, (self.message,)


def arrived(message: Any) -> Any:
    """Notes, in the worker unpickling it, that a last task arrived; returns the message."""
    global _arrived
    _arrived = True
    return message


def take() -> bool:
    """Whether a last task arrived since the last call (the note is cleared)."""
    global _arrived
    was, _arrived = _arrived, False
    return was
