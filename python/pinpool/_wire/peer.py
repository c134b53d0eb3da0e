"""Reaching another process's shared memory: its memfds are opened through ``/proc``.

Both directions use it: the main process opens a worker's segment, a worker (zero-copy mode)
opens the main process's arena. The ordinary ptrace rules decide who may open whose: a
process may open its own children's, and a DataLoader worker its parent's.
"""

from __future__ import annotations

import errno
import os
import resource

from .._errors import PinPoolError


def open_fd_of(pid: int, fd: int) -> int:
    """A new descriptor (read-write, close-on-exec) for file ``fd`` of process ``pid``."""
    return os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie. Only a process that is known to
    be gone is dead: when this process cannot tell (out of file descriptors, say), the
    answer is True."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True


#: The errnos of a process (or system) that has no file descriptor left to open a file with.
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)


def out_of_fds(exc: OSError, pid: int) -> PinPoolError:
    """The error to raise when opening process ``pid``'s memory failed with ``exc``, whose
    errno is one of :data:`OUT_OF_FDS`: nothing says the process exited, and what must be
    raised is the limit."""
    if exc.errno == errno.ENFILE:
        where = "the system's open-file table is full (ENFILE; see /proc/sys/fs/file-max)"
    else:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        where = (
            f"the main process has used all {soft} file descriptors it may open (EMFILE): "
            f"raise its limit (ulimit -n, or resource.setrlimit(resource.RLIMIT_NOFILE, ...), "
            f"up to the hard limit {'unlimited' if hard == resource.RLIM_INFINITY else hard})"
        )
    return PinPoolError(
        f"cannot open the batch memory of DataLoader worker (pid {pid}): {where}; the "
        "worker is not known to have exited"
    )
