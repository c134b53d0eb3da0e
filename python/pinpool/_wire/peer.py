"""Reaching another process's shared memory: its memfds are opened through ``/proc``.

Both directions use it: the main process opens a worker's segment, a worker (zero-copy mode)
opens the main process's arena. The ordinary ptrace rules decide who may open whose: a
process may open its own children's, and a DataLoader worker its parent's.
"""

from __future__ import annotations

import os


def open_fd_of(pid: int, fd: int) -> int:
    """A new descriptor (read-write, close-on-exec) for file ``fd`` of process ``pid``."""
    return os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
