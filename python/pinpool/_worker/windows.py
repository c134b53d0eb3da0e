"""A zero-copy worker's windows onto the main process's arena: which ones it keeps, and the
thread that opens and closes the big ones off the worker's path.

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

Opening and closing a window of hundreds of megabytes costs milliseconds each (4.2 and 4.4 ms
for 268 MB on the H200), a fifth of what writing the batch costs the worker. So a window of
:data:`OFF_PATH_BYTES` or more is opened and closed by this process's window thread
(``pinpool-windows``): :func:`ahead` starts opening a reservation's slot as its indices
arrive, while the dataset makes the batch's first sample, and :func:`close` starts closing a
window as the batch's handle is made, and returns what the handle waits for before it is
sent (torch's result queue pickles it on its feeder thread, so the worker goes on to its next
batch meanwhile).

Invariants:

- The main process never receives the handle of a batch whose window is still writable: a
  handle is pickled only after its window's close is done (or the window given up, below).
- A window's opens and closes happen in the order they were asked for: a big window's run one
  at a time on the window thread, in order; anything done on the caller's thread waits first
  until the window thread has done everything asked of it.
- At most one reservation is opened ahead; an ahead not taken by the batch it was made for is
  closed again (on the window thread) when the next one is asked for, or when that batch goes
  into a segment instead.
- A window that cannot be closed (a view of it is still alive, held by a traceback, or
  ``mprotect`` failed) is no longer kept: it is unmapped when the last reference to it goes.
- The kept windows are changed under :data:`_LOCK` only; a process forked from this one keeps
  none of them (they are not mapped there) and starts its own window thread.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import mmap
import os
import queue
import stat
import threading
from collections.abc import Callable
from typing import Any

from .._errors import PinPoolError
from .._native import ArenaWindow
from .._wire import peer
from .._wire.handle import WINDOW_BYTES_KEPT, WINDOWS_KEPT, SlotReservation

#: Windows at least this long are opened and closed on the window thread.
OFF_PATH_BYTES = 8 << 20

_LOCK = threading.Lock()
#: This process's kept windows, the latest used first: ``((main pid, inode), window)``.
_WINDOWS: list[tuple[tuple[int, int], ArenaWindow]] = []
_PID = os.getpid()
_THREAD: _WindowThread | None = None
#: The reservation opened ahead, and its open: ``(reservation, future of open_window)``.
_AHEAD: tuple[SlotReservation, concurrent.futures.Future[Any]] | None = None


class _WindowThread:
    """One daemon thread running the jobs given to it one at a time, in order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._jobs = queue.SimpleQueue()
        self._last: concurrent.futures.Future[Any] | None = None
        threading.Thread(target=self._run, name="pinpool-windows", daemon=True).start()

    def submit(self, job: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((job, done))
        self._last = done
        return done

    def wait_idle(self) -> None:
        """Returns once every job given so far has run (they run in order)."""
        last = self._last
        if last is not None:
            concurrent.futures.wait([last])

    def _run(self) -> None:
        while True:
            job, done = self._jobs.get()
            try:
                done.set_result(job())
            except BaseException as exc:
                done.set_exception(exc)
            del job, done  # (a window given up is unmapped here, off the worker's path)


def _here() -> None:
    """Forgets what this process inherited from the one it was forked from."""
    global _PID, _THREAD, _AHEAD
    if _PID != os.getpid():
        _WINDOWS.clear()
        _THREAD = None
        _AHEAD = None
        _PID = os.getpid()


def _thread() -> _WindowThread:
    global _THREAD
    if _THREAD is None:
        _THREAD = _WindowThread()
    return _THREAD


def _wait_idle() -> None:
    if _THREAD is not None:
        _THREAD.wait_idle()


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


def _open(reservation: SlotReservation) -> tuple[ArenaWindow, int, bool]:
    """A window holding the reservation's slot, opened for writing the slot's bytes, where the
    slot starts in it, and whether it was mapped now: a kept one if one holds the slot (in the
    same file: its inode, which cannot name another file while the window keeps this one
    mapped), else a new one, kept in place of the least recently used."""
    key = (reservation.arena_pid, reservation.arena_ino)
    offset, nbytes = reservation.offset, reservation.nbytes
    window = None
    with _LOCK:
        for i, (k, kept) in enumerate(_WINDOWS):
            if k == key and nbytes > 0 and kept.contains(offset, nbytes):
                _WINDOWS.insert(0, _WINDOWS.pop(i))
                window = kept
                break
    new = window is None
    if window is None:
        window = map_window(reservation)
        with _LOCK:
            _WINDOWS.insert(0, (key, window))
            mapped = sum(w.length for _, w in _WINDOWS)
            gone = []  # the least recently used go (unmapped as they die), the new one stays
            while len(_WINDOWS) > 1 and (
                len(_WINDOWS) > WINDOWS_KEPT or mapped > WINDOW_BYTES_KEPT
            ):
                gone.append(_WINDOWS.pop())
                mapped -= gone[-1][1].length
        del gone
    window.open(offset, nbytes)
    return window, offset - window.offset, new


def _close(window: ArenaWindow) -> None:
    """Makes ``window`` inaccessible again; one that cannot be is no longer kept."""
    try:
        window.close()
    except (BufferError, OSError, PinPoolError):
        with _LOCK:
            _WINDOWS[:] = [(k, w) for k, w in _WINDOWS if w is not window]


def _drop_ahead() -> None:
    """Closes again, on the window thread, what was opened ahead and not taken."""
    global _AHEAD
    if _AHEAD is None:
        return
    opened = _AHEAD[1]
    _AHEAD = None

    def undo() -> None:
        try:
            window, _, _ = opened.result()  # (run before this job: done)
        except BaseException:
            return  # nothing was opened
        _close(window)

    _thread().submit(undo)


def ahead(reservation: SlotReservation | None) -> None:
    """Starts opening the reservation's slot on the window thread, if it is big, as the batch's
    indices arrive (the batch that takes it calls :func:`open_for`)."""
    global _AHEAD
    _here()
    _drop_ahead()
    if reservation is not None and reservation.nbytes >= OFF_PATH_BYTES:
        _AHEAD = (reservation, _thread().submit(lambda: _open(reservation)))


def drop_ahead(reservation: SlotReservation | None) -> None:
    """The batch of ``reservation`` does not go into its slot: what was opened ahead for it is
    closed again."""
    _here()
    if _AHEAD is not None and _AHEAD[0] is reservation:
        _drop_ahead()


def open_for(reservation: SlotReservation) -> tuple[ArenaWindow, int, bool]:
    """The window to write the reservation's batch in, open over its slot: ``(window, where the
    slot starts in it, whether it was mapped now)``. Raises ``PinPoolError`` if the slot
    cannot be reached (see :func:`map_window`)."""
    global _AHEAD
    _here()
    if _AHEAD is not None and _AHEAD[0] is reservation:
        opened = _AHEAD[1]
        _AHEAD = None
        result: tuple[ArenaWindow, int, bool] = opened.result()
        return result
    _drop_ahead()
    if reservation.nbytes >= OFF_PATH_BYTES:
        result = _thread().submit(lambda: _open(reservation)).result()
        return result
    _wait_idle()
    return _open(reservation)


def close(window: ArenaWindow) -> Callable[[], None] | None:
    """Makes ``window`` inaccessible again (its views released). A big one is closed on the
    window thread: returns what waits for that (a batch written there must not be sent
    before); None when it is closed already."""
    _here()
    if window.length >= OFF_PATH_BYTES:
        closing = _thread().submit(lambda: _close(window))

        def closed() -> None:
            concurrent.futures.wait([closing])

        return closed
    _wait_idle()
    _close(window)
    return None


def let_go() -> list[ArenaWindow]:
    """The kept windows, no longer kept (a worker's last task: their page tables are dropped);
    none in a process forked from the one that kept them (the windows are not mapped there)."""
    _here()
    with _LOCK:
        windows = [w for _, w in _WINDOWS]
        _WINDOWS.clear()
    return windows


def kept() -> list[ArenaWindow]:
    """The windows this process keeps, the latest used first."""
    _here()
    with _LOCK:
        return [w for _, w in _WINDOWS]
