"""A zero-copy worker's windows onto the main process's arena: which ones it keeps, opened only
while a batch is written.

A granted slot is reached through ``/proc/<main pid>/fd/<fd>``, checked before anything is
mapped: the file is the one the grant names (its inode), sealed against shrinking
(nothing can truncate it under the mapping) and of the announced length, and the slot lies
inside it. Only the slot's own pages are mapped (an ``ArenaWindow``, ``src/memory/window/``),
and the descriptor is closed at once. A window is writable only while a batch is written into
it, so a stray write in a worker cannot reach a batch the consumer holds (the trust model in
``docs/design.md``). It is kept, page tables and all, for the worker's next batches: the main
process grants a worker, first, the slots it had before (``pinpool._native.Grants``), and
reopening a kept window costs one ``mprotect`` where mapping the slot afresh faults in every
page. A worker keeps at most ``handle.WINDOWS_KEPT`` windows, and at most
``handle.WINDOW_BYTES_KEPT`` bytes of them, the latest used first.

A fresh worker (each epoch's, unless workers persist) would fault in each of its first slots'
windows on the path of its first batches. Its first big grant names where its next slots will
likely be (``SlotGrant.likely``): where the worker of the same id in the iterator before had its
slots, or, in a loader's first epoch, this worker's share of the arena's slot places (the
grants offer those slots first). Where windows have keys, the
worker maps them while it holds the descriptor for its first slot (checked as a grant's
slot is, and mapped inaccessible and not yet faulted in), and a thread of its own faults them in
while it collates (:func:`premap`): their pages are writable meanwhile under each window's
key, which only that thread switches on, so no other thread of the worker can reach them, and
it holds no descriptor. Without keys nothing is pre-mapped: faulting pages in needs them
writable, and every thread could write them then.

Where the machine has memory protection keys (``src/system/pkeys.rs``), a window has a key of its
own, and a slot is opened *keyed* when only this thread (and pinpool's copy threads, which take
its rights for a copy) writes it: torch runs one thread per operation here
(``torch.get_num_threads() == 1``, as torch sets in its workers). Its pages then stay writable
under the key between batches, and no thread may touch them but between ``Destination.allow`` and
``Destination.deny`` (or the close) on the thread that writes: reopening the same slot changes no
page-table entry, where ``mprotect`` rewrites every page's entry twice a batch. Elsewhere a slot
is opened as before, writable by every thread until the close.

Invariants:

- A window covers only slots the main process handed this worker or named as its next ones
  (likely slots: opened only for a grant that lies in them), is checked against the file it
  maps (inode and range) each time it is reused, and is writable only between
  :func:`open_for` and :func:`close` (one range at a time: ``src/memory/window/``); opened keyed,
  only by the thread that opened it, while its access is switched on (``Destination.allow``); and,
  for a likely slot's, while the pre-map thread faults it in, by that thread alone, under its key.
- No descriptor of the arena stays open past :func:`open_for`; ``_WINDOWS`` changes only on
  the thread that calls it (the pre-map thread is handed its windows). The pre-map thread
  starts at most once per process, before any range is opened (a new thread inherits its
  starter's access to keys).
- A window that cannot be closed (a view of it is still alive, held by a traceback, or
  ``mprotect`` failed) is no longer kept: it is unmapped when the last reference to it goes.
- A process forked from this one keeps none of these windows (they are not mapped there), and
  runs no pre-map thread.
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
from .._wire.handle import WINDOW_BYTES_KEPT, WINDOWS_KEPT, LikelySlot, SlotGrant

#: This process's kept windows, the latest used first: ``((main pid, inode, start, end),
#: window)``, where ``[start, end)`` are the file offsets the window maps (kept here as plain
#: ints: finding the window of a slot asks no native call per window).
_WINDOWS: list[tuple[tuple[int, int, int, int], ArenaWindow]] = []
_PID = os.getpid()
#: The process that started its pre-map thread, if this one did (once per process).
_PREMAP_IN: int | None = None


def _start_afresh() -> None:
    """Forgets every kept window and that a pre-map thread ran (a process forked from the one
    that kept them: they are not mapped here)."""
    global _PID, _PREMAP_IN
    _WINDOWS.clear()
    _PREMAP_IN = None
    _PID = os.getpid()


def _here() -> None:
    """Forgets the windows a process this one was forked from kept (not mapped here)."""
    if _PID != os.getpid():
        _start_afresh()


def _refuse(grant: SlotGrant | LikelySlot, why: str) -> PinPoolError:
    return PinPoolError(
        f"the slot granted for this batch (fd {grant.arena_fd} of process "
        f"{grant.arena_pid}) cannot be written: {why}"
    )


def _check_part(fd: int, grant: SlotGrant | LikelySlot) -> None:
    """Raises unless ``fd`` is the arena part ``grant`` names and its slot lies inside."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_ino != grant.arena_ino:
        raise _refuse(grant, "that descriptor no longer names the arena the grant was made for")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # (not a memfd)
    if not seals & fcntl.F_SEAL_SHRINK:
        raise _refuse(grant, "the file is not sealed against shrinking")
    if info.st_size != grant.arena_len:
        raise _refuse(grant, f"the file holds {info.st_size} bytes, not {grant.arena_len}")
    offset, nbytes = grant.offset, grant.nbytes
    if not (0 <= offset and 0 < nbytes and offset + nbytes <= info.st_size):
        raise _refuse(grant, f"bytes {offset}..{offset + nbytes} lie outside the file")


def _pages(extent: SlotGrant | LikelySlot) -> tuple[int, int]:
    """The file offset and length of the whole pages holding ``extent``'s bytes."""
    start = extent.offset - extent.offset % mmap.PAGESIZE
    end = extent.offset + extent.nbytes
    end += -end % mmap.PAGESIZE
    return start, end - start


def map_window(grant: SlotGrant) -> ArenaWindow:
    """A window over the pages holding the grant's slot (mapped, faulted in, and
    inaccessible until opened). The descriptor opened to make it is closed before this
    returns."""
    fd = peer.open_fd_of(grant.arena_pid, grant.arena_fd)
    try:
        _check_part(fd, grant)
        return ArenaWindow(fd, *_pages(grant))
    finally:
        os.close(fd)


def open_for(grant: SlotGrant) -> tuple[ArenaWindow, int, bool]:
    """A window holding the grant's slot, opened for writing the slot's bytes, where the
    slot starts in it, and whether it was mapped now: a kept one if one holds the slot (in the
    same file: its inode, which cannot name another file while the window keeps this one
    mapped), else a new one, kept in place of the least recently used. A kept window still
    being faulted in by the pre-map thread is waited for. With a process's first likely slots
    (``grant.likely``), maps them and starts the thread that faults them in
    (:func:`premap`). Raises ``PinPoolError`` if the slot cannot be reached (see
    :func:`map_window`)."""
    _here()
    key = (grant.arena_pid, grant.arena_ino)
    offset, nbytes = grant.offset, grant.nbytes
    window = _kept(key, offset, nbytes)
    new = window is None
    if window is None:
        window = map_window(grant)
        _keep(key, window, latest=True)
    if grant.likely and _PREMAP_IN != os.getpid() and window.has_key:
        premap(grant.likely, grant.arena_pid)  # (before any range is opened)
    window.open(offset, nbytes, keyed=window.has_key and _one_writer())
    return window, offset - window.offset, new


def _kept(key: tuple[int, int], offset: int, nbytes: int, use: bool = True) -> ArenaWindow | None:
    """The kept window holding those bytes, if one does (with ``use``, now the latest used)."""
    if nbytes <= 0:
        return None
    pid, ino = key
    end = offset + nbytes
    for i, (k, kept_window) in enumerate(_WINDOWS):
        if k[1] == ino and k[0] == pid and k[2] <= offset and end <= k[3]:
            if use and i:
                _WINDOWS.insert(0, _WINDOWS.pop(i))
            return kept_window
    return None


def _keep(key: tuple[int, int], window: ArenaWindow, latest: bool) -> bool:
    """Keeps ``window``: as the latest used, the least recently used going (unmapped as they
    die) while over the limits; else (a likely slot's) as the least recently used, only if the
    limits leave room for it. Whether it is kept."""
    mapped = sum(k[3] - k[2] for k, _ in _WINDOWS)
    start, length = window.offset, window.length
    entry = ((key[0], key[1], start, start + length), window)
    if not latest:
        if len(_WINDOWS) >= WINDOWS_KEPT or mapped + length > WINDOW_BYTES_KEPT:
            return False
        _WINDOWS.append(entry)
        return True
    _WINDOWS.insert(0, entry)
    mapped += length
    while len(_WINDOWS) > 1 and (len(_WINDOWS) > WINDOWS_KEPT or mapped > WINDOW_BYTES_KEPT):
        k, _ = _WINDOWS.pop()
        mapped -= k[3] - k[2]
    return True


def premap(likely: tuple[LikelySlot, ...], main_pid: int) -> list[ArenaWindow]:
    """Maps the likely slots' extents (once per process) as kept windows, inaccessible and not yet
    faulted in, while the limits (``handle.WINDOWS_KEPT``, ``handle.WINDOW_BYTES_KEPT``) leave
    room, and starts a thread that faults them in (``ArenaWindow.fault_in_privately``: out of
    every other thread's reach, under each window's key); the windows mapped. Called while the
    caller has no range open: a thread started while its starter has access to a key would
    have it too. The descriptors opened here are closed before it returns.

    A likely slot that cannot be mapped (the main process's pool changed, the descriptor names
    another file) is skipped: it only ever saved time. Where a window gets no key (the machine
    has none, or none is left), nothing more is pre-mapped."""
    global _PREMAP_IN
    if _PREMAP_IN == os.getpid():
        return []
    _PREMAP_IN = os.getpid()
    fds: dict[int, int] = {}
    mapped: list[ArenaWindow] = []
    try:
        for spot in likely:
            if not isinstance(spot, LikelySlot) or spot.arena_pid != main_pid:
                continue
            key = (spot.arena_pid, spot.arena_ino)
            if _kept(key, spot.offset, spot.nbytes, use=False) is not None:
                continue
            try:
                if spot.arena_fd not in fds:
                    fds[spot.arena_fd] = peer.open_fd_of(main_pid, spot.arena_fd)
                fd = fds[spot.arena_fd]
                _check_part(fd, spot)
                window = ArenaWindow(fd, *_pages(spot), fault_in=False)
            except (OSError, PinPoolError, ValueError, TypeError):
                continue
            if not window.has_key:
                break  # (unmapped as it dies here)
            if not _keep(key, window, latest=False):
                break
            mapped.append(window)
    finally:
        for fd in fds.values():
            os.close(fd)
    if mapped:
        threading.Thread(
            target=_fault_in, args=(mapped,), name="pinpool-premap", daemon=True
        ).start()
    return mapped


def _fault_in(mapped: list[ArenaWindow]) -> None:
    """The pre-map thread: faults each window in, in order (one a grant opens first is
    faulted in by the opener, which this waits for)."""
    for window in mapped:
        try:
            window.fault_in_privately()
        except (OSError, PinPoolError, ValueError):
            pass  # (its opener faults it in, or reports why it cannot)


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


def kept() -> list[ArenaWindow]:
    """The windows this process keeps, the latest used first."""
    _here()
    return [w for _, w in _WINDOWS]
