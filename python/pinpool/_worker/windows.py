"""A zero-copy worker's windows onto the main process's arena: which ones it keeps, opened only
while a batch is written.

A reservation's slot is reached through ``/proc/<main pid>/fd/<fd>``, checked before anything
is mapped: the file is the one the reservation names (its inode), sealed against shrinking
(nothing can truncate it under the mapping) and of the announced length, and the slot lies
inside it. Only the slot's own pages are mapped (an ``ArenaWindow``, ``src/window.rs``), and
the descriptor is closed at once. A window is writable only while a batch is written into it,
so a stray write in a worker cannot reach a batch the consumer holds (the trust model in
``docs/design.md``). It is kept, page tables and all, for the worker's next batches: the main
process hands a worker, first, the slots it had before (``_main.reservations``), and reopening
a kept window costs one ``mprotect`` where mapping the slot afresh faults in every page (about
54 ms per 256 MB). A worker keeps at most ``handle.WINDOWS_KEPT`` windows, and at most
``handle.WINDOW_BYTES_KEPT`` bytes of them, the latest used first.

Where the machine has memory protection keys (``src/pkeys.rs``), a window has a key of its
own, and a slot is opened *keyed* when only this thread (and pinpool's copy threads, which take
its rights for a copy) writes it: torch runs one thread per operation here
(``torch.get_num_threads() == 1``, as torch sets in its workers). Its pages then stay writable
under the key between batches, and no thread may touch them but between ``Place.allow`` and
``Place.deny`` (or the close) on the thread that writes: reopening the same slot changes no
page-table entry, where ``mprotect`` rewrites every page's entry twice a batch. Elsewhere a slot
is opened as before, writable by every thread until the close.

Invariants:

- A window covers only slots the main process handed this worker, is checked against the file
  it maps (inode and range) each time it is reused, and is writable only between
  :func:`open_for` and :func:`close` (one range at a time: ``src/window.rs``); opened keyed,
  only by the thread that opened it, while its access is switched on (``Place.allow``).
- A window that cannot be closed (a view of it is still alive, held by a traceback, or
  ``mprotect`` failed) is no longer kept: it is unmapped when the last reference to it goes.
- A process forked from this one keeps none of these windows (they are not mapped there).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat

import torch

from .._errors import PinPoolError
from .._native import ArenaWindow
from .._wire import peer
from .._wire.handle import WINDOW_BYTES_KEPT, WINDOWS_KEPT, SlotReservation

#: This process's kept windows, the latest used first: ``((main pid, inode), window)``.
_WINDOWS: list[tuple[tuple[int, int], ArenaWindow]] = []
_PID = os.getpid()


def _here() -> None:
    """Forgets the windows a process this one was forked from kept (not mapped here)."""
    global _PID
    if _PID != os.getpid():
        _WINDOWS.clear()
        _PID = os.getpid()


def _refuse(reservation: SlotReservation, why: str) -> PinPoolError:
    return PinPoolError(
        f"the slot handed out with this batch's indices (fd {reservation.arena_fd} of process "
        f"{reservation.arena_pid}) cannot be written: {why}"
    )


def _check_part(fd: int, reservation: SlotReservation) -> None:
    """Raises unless ``fd`` is the arena part ``reservation`` names and its slot lies inside."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_ino != reservation.arena_ino:
        raise _refuse(
            reservation, "that descriptor no longer names the arena the reservation was made for"
        )
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # (not a memfd)
    if not seals & fcntl.F_SEAL_SHRINK:
        raise _refuse(reservation, "the file is not sealed against shrinking")
    if info.st_size != reservation.arena_len:
        raise _refuse(
            reservation, f"the file holds {info.st_size} bytes, not {reservation.arena_len}"
        )
    offset, nbytes = reservation.offset, reservation.nbytes
    if not (0 <= offset and 0 < nbytes and offset + nbytes <= info.st_size):
        raise _refuse(reservation, f"bytes {offset}..{offset + nbytes} lie outside the file")


def map_window(reservation: SlotReservation) -> ArenaWindow:
    """A window over the pages holding the reservation's slot (mapped, faulted in, and
    inaccessible until opened). The descriptor opened to make it is closed before this
    returns."""
    fd = peer.open_fd_of(reservation.arena_pid, reservation.arena_fd)
    try:
        _check_part(fd, reservation)
        start = reservation.offset - reservation.offset % mmap.PAGESIZE
        end = reservation.offset + reservation.nbytes
        end += -end % mmap.PAGESIZE
        return ArenaWindow(fd, start, end - start)
    finally:
        os.close(fd)


def open_for(reservation: SlotReservation) -> tuple[ArenaWindow, int, bool]:
    """A window holding the reservation's slot, opened for writing the slot's bytes, where the
    slot starts in it, and whether it was mapped now: a kept one if one holds the slot (in the
    same file: its inode, which cannot name another file while the window keeps this one
    mapped), else a new one, kept in place of the least recently used. Raises
    ``PinPoolError`` if the slot cannot be reached (see :func:`map_window`)."""
    _here()
    key = (reservation.arena_pid, reservation.arena_ino)
    offset, nbytes = reservation.offset, reservation.nbytes
    for i, (k, kept_window) in enumerate(_WINDOWS):
        if k == key and nbytes > 0 and kept_window.contains(offset, nbytes):
            _WINDOWS.insert(0, _WINDOWS.pop(i))
            window, new = kept_window, False
            break
    else:
        window, new = map_window(reservation), True
        _WINDOWS.insert(0, (key, window))
        mapped = sum(w.length for _, w in _WINDOWS)
        # The least recently used go (unmapped as they die), the new one stays.
        while len(_WINDOWS) > 1 and (len(_WINDOWS) > WINDOWS_KEPT or mapped > WINDOW_BYTES_KEPT):
            mapped -= _WINDOWS.pop()[1].length
    window.open(offset, nbytes, keyed=window.has_key and _one_writer())
    return window, offset - window.offset, new


def _one_writer() -> bool:
    """Whether a batch is written by the calling thread alone: torch runs its operations on one
    thread (as torch sets in its workers; a ``worker_init_fn`` may change that)."""
    return bool(torch.get_num_threads() == 1)


def close(window: ArenaWindow) -> None:
    """Makes ``window`` inaccessible again (its views released); one that cannot be is no
    longer kept."""
    _here()
    try:
        window.close()
    except (BufferError, OSError, PinPoolError):
        _WINDOWS[:] = [(k, w) for k, w in _WINDOWS if w is not window]


def let_go() -> list[ArenaWindow]:
    """The kept windows, no longer kept (a worker's last task: their page tables are dropped);
    none in a process forked from the one that kept them (the windows are not mapped there)."""
    _here()
    windows = [w for _, w in _WINDOWS]
    _WINDOWS.clear()
    return windows


def kept() -> list[ArenaWindow]:
    """The windows this process keeps, the latest used first."""
    _here()
    return [w for _, w in _WINDOWS]
