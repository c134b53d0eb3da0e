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

A fresh worker (each epoch's, unless workers persist) would map each of its first slots anew,
on the path of its first batches. Its first reservation names where its next slots will
likely be (``SlotReservation.ahead``): where the worker of the same id in the iterator before
had its slots, or, in a loader's first epoch, this worker's share of the arena's slot places.
The main process offers those slots first (``_main.reservations``), and a thread of the
worker's own maps them while it collates (:func:`map_ahead`), checked as a reservation's slot
is, and inaccessible as every kept window is between batches: a hint lets the worker write nothing.

Where the machine has memory protection keys (``src/pkeys.rs``), a window has a key of its
own, and a slot is opened *keyed* when only this thread (and pinpool's copy threads, which take
its rights for a copy) writes it: torch runs one thread per operation here
(``torch.get_num_threads() == 1``, as torch sets in its workers). Its pages then stay writable
under the key between batches, and no thread may touch them but between ``Place.allow`` and
``Place.deny`` (or the close) on the thread that writes: reopening the same slot changes no
page-table entry, where ``mprotect`` rewrites every page's entry twice a batch. Elsewhere a slot
is opened as before, writable by every thread until the close.

Invariants:

- A window covers only slots the main process handed this worker or named as its next ones
  (hints: never opened but for a reservation that lies in them), is checked against the file
  it maps (inode and range) each time it is reused, and is writable only between
  :func:`open_for` and :func:`close` (one range at a time: ``src/window.rs``); opened keyed,
  only by the thread that opened it, while its access is switched on (``Place.allow``).
- A window that cannot be closed (a view of it is still alive, held by a traceback, or
  ``mprotect`` failed) is no longer kept: it is unmapped when the last reference to it goes.
- A process forked from this one keeps none of these windows (they are not mapped there), and
  runs no map-ahead thread.
- ``_WINDOWS`` and ``_PENDING`` change only under ``_LOCK``; a slot a hint still pending covers
  is waited for, never mapped twice. The map-ahead thread starts at most once per process,
  before any range is opened (where a window has a key, a new thread inherits its starter's
  access).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import threading

import torch

from .._errors import PinPoolError
from .._native import ArenaWindow
from .._wire import peer
from .._wire.handle import WINDOW_BYTES_KEPT, WINDOWS_KEPT, SlotReservation, WindowHint

#: This process's kept windows, the latest used first: ``((main pid, inode), window)``.
_WINDOWS: list[tuple[tuple[int, int], ArenaWindow]] = []
#: Guards ``_WINDOWS`` and ``_PENDING`` (the map-ahead thread adds to them); notified as a
#: hint's window is kept.
_LOCK = threading.Condition()
#: The hints the map-ahead thread has yet to map: ``((main pid, inode), hint)``.
_PENDING: list[tuple[tuple[int, int], WindowHint]] = []
#: Whether the map-ahead thread ran (once per process: the hints come with its first slot).
_AHEAD_STARTED = False
_PID = os.getpid()


def _start_afresh() -> None:
    """In a process forked from this one: no window is mapped there, no thread maps ahead."""
    global _LOCK, _AHEAD_STARTED, _PID
    _LOCK = threading.Condition()
    _WINDOWS.clear()
    _PENDING.clear()
    _AHEAD_STARTED = False
    _PID = os.getpid()


os.register_at_fork(after_in_child=_start_afresh)


def _here() -> None:
    """Forgets the windows a process this one was forked from kept (not mapped here)."""
    if _PID != os.getpid():  # (a fork the hook above missed)
        _start_afresh()


def _refuse(reservation: SlotReservation | WindowHint, why: str) -> PinPoolError:
    return PinPoolError(
        f"the slot handed out with this batch's indices (fd {reservation.arena_fd} of process "
        f"{reservation.arena_pid}) cannot be written: {why}"
    )


def _check_part(fd: int, reservation: SlotReservation | WindowHint) -> None:
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


def map_window(reservation: SlotReservation | WindowHint) -> ArenaWindow:
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
    mapped), else one the map-ahead thread is mapping (waited for), else a new one, kept in
    place of the least recently used. Raises ``PinPoolError`` if the slot cannot be reached
    (see :func:`map_window`)."""
    _here()
    if reservation.ahead:
        map_ahead(reservation.ahead, reservation.arena_pid)  # (before any range is opened)
    key = (reservation.arena_pid, reservation.arena_ino)
    offset, nbytes = reservation.offset, reservation.nbytes
    with _LOCK:
        window = _kept(key, offset, nbytes)
        while window is None and any(k == key and _covers(h, offset, nbytes) for k, h in _PENDING):
            _LOCK.wait()
            window = _kept(key, offset, nbytes)
    new = window is None
    if window is None:
        window = map_window(reservation)  # (without the lock: tens of milliseconds)
        with _LOCK:
            _WINDOWS.insert(0, (key, window))
            mapped = sum(w.length for _, w in _WINDOWS)
            # The least recently used go (unmapped as they die), the new one stays.
            while len(_WINDOWS) > 1 and (
                len(_WINDOWS) > WINDOWS_KEPT or mapped > WINDOW_BYTES_KEPT
            ):
                mapped -= _WINDOWS.pop()[1].length
    window.open(offset, nbytes, keyed=window.has_key and _one_writer())
    return window, offset - window.offset, new


def _kept(key: tuple[int, int], offset: int, nbytes: int) -> ArenaWindow | None:  # (locked)
    """The kept window holding those bytes, now the latest used, if one does."""
    for i, (k, kept_window) in enumerate(_WINDOWS):
        if k == key and nbytes > 0 and kept_window.contains(offset, nbytes):
            _WINDOWS.insert(0, _WINDOWS.pop(i))
            return kept_window
    return None


def _covers(hint: WindowHint, offset: int, nbytes: int) -> bool:
    return hint.offset <= offset and offset + nbytes <= hint.offset + hint.nbytes


def map_ahead(hints: tuple[WindowHint, ...], main_pid: int) -> None:
    """Maps the hinted extents on a thread of this process's own (once per process), each kept
    as a window (inaccessible until a reservation there opens it) while the limits
    (``handle.WINDOWS_KEPT``, ``handle.WINDOW_BYTES_KEPT``) leave room. Called while the caller
    has no range open: where windows have protection keys, a thread started while its starter
    has access to a key would have it too.

    A hint that cannot be mapped (the main process's pool changed, the descriptor names
    another file) is skipped: it only ever saved time."""
    global _AHEAD_STARTED
    with _LOCK:
        if _AHEAD_STARTED:
            return
        _AHEAD_STARTED = True
        for hint in hints:
            if isinstance(hint, WindowHint) and hint.arena_pid == main_pid:
                _PENDING.append(((hint.arena_pid, hint.arena_ino), hint))
        if not _PENDING:
            return
    threading.Thread(target=_map_pending, name="pinpool-map-ahead", daemon=True).start()


def _map_pending() -> None:
    while True:
        with _LOCK:
            if not _PENDING:
                return
            key, hint = _PENDING[0]
            room = len(_WINDOWS) < WINDOWS_KEPT and (
                sum(w.length for _, w in _WINDOWS) + hint.nbytes <= WINDOW_BYTES_KEPT
            )
            held = _kept_quietly(key, hint.offset, hint.nbytes)
        window = None
        if room and not held:
            try:
                window = map_window(hint)  # (without the lock; the native call drops the GIL)
            except (OSError, PinPoolError, ValueError, TypeError):
                window = None
        with _LOCK:
            if _PENDING and _PENDING[0] == (key, hint):
                _PENDING.pop(0)
                if window is not None and not _kept_quietly(key, hint.offset, hint.nbytes):
                    _WINDOWS.append((key, window))  # (the least recently used: first to go)
            # (else let_go() ran meanwhile: the window is not kept, unmapped as it dies)
            _LOCK.notify_all()


def _kept_quietly(key: tuple[int, int], offset: int, nbytes: int) -> bool:  # (locked)
    return any(k == key and w.contains(offset, nbytes) for k, w in _WINDOWS)


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
        with _LOCK:
            _WINDOWS[:] = [(k, w) for k, w in _WINDOWS if w is not window]


def let_go() -> list[ArenaWindow]:
    """The kept windows, no longer kept (a worker's last task: their page tables are dropped);
    none in a process forked from the one that kept them (the windows are not mapped there)."""
    _here()
    with _LOCK:
        _PENDING.clear()  # (a hint the thread is mapping now is kept, and dropped at exit)
        windows = [w for _, w in _WINDOWS]
        _WINDOWS.clear()
    return windows


def kept() -> list[ArenaWindow]:
    """The windows this process keeps, the latest used first."""
    _here()
    with _LOCK:
        return [w for _, w in _WINDOWS]
