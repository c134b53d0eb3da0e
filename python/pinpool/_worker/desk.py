"""A zero-copy worker's side of the grant desk: asking the main process for room in its arena
once the batch's size is known, and giving back room it will not use.

The main process answers at once, from a thread of its own (``pinpool._native.Grants``; the
protocol: ``src/transport/grant_desk.rs``): a :class:`~pinpool._wire.handle.SlotGrant` of
exactly the bytes asked for, or none (the batch then goes into one of the worker's segments,
copy mode). A worker connects once per process and loader's desk and keeps the connection.

Invariants: a worker never waits long here: an answer that has not come within
:data:`ANSWER_WITHIN_S` (the main process is busy or gone) is no grant, and the connection is
dropped, so a late answer cannot be taken for the next one's (each answer also names its
request's sequence number; one for an earlier request is given back); nothing raises out of
here: every failure is "no grant". A process forked from the one that connected connects
afresh (the connection is never shared between processes).
"""

from __future__ import annotations

import itertools
import os
import socket
import struct

from .._wire.handle import SlotGrant, ZeroCopyTask, grant_from_words

#: How long a worker waits for the desk's answer (at once, or as soon as room held by batches
#: before its own comes back, at most 5 s later) before it writes the
#: batch into a segment of its own instead.
ANSWER_WITHIN_S = 10.0

_ASK = 1
_GIVE_BACK = 2
_REQUEST = struct.Struct("<7Q")
#: The longest answer: the sequence number, a grant and eight likely slots.
_ANSWER_BYTES = 8 * (1 + 11 + 8 * 5)

#: This process's connections, by desk address.
_CONNECTIONS: dict[bytes, socket.socket] = {}
_PID = os.getpid()
_SEQ = itertools.count(1)


def _connection(address: bytes) -> socket.socket | None:
    global _PID
    if _PID != os.getpid():  # (forked: the parent's connections are not ours to use)
        _CONNECTIONS.clear()
        _PID = os.getpid()
    conn = _CONNECTIONS.get(address)
    if conn is not None:
        return conn
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.settimeout(ANSWER_WITHIN_S)
        conn.connect(b"\0" + address)
    except OSError:
        conn.close()
        return None
    _CONNECTIONS[address] = conn
    return conn


def _drop(address: bytes) -> None:
    conn = _CONNECTIONS.pop(address, None)
    if conn is not None:
        conn.close()


def ask(desk: tuple[bytes, int], task: ZeroCopyTask, worker: int, nbytes: int) -> SlotGrant | None:
    """A slot of ``nbytes`` for ``task``'s batch, collated by worker ``worker``, from the main
    process's desk ``desk`` (its address and this loader's table); None for none."""
    address, table = desk
    conn = _connection(address)
    if conn is None:
        return None
    seq = next(_SEQ)
    try:
        conn.send(_REQUEST.pack(_ASK, seq, table, task.owner, worker, task.task, nbytes))
        while True:
            answer = conn.recv(_ANSWER_BYTES)
            if len(answer) < 16 or len(answer) % 8:
                raise OSError("the grant desk closed the connection")
            words = struct.unpack(f"<{len(answer) // 8}Q", answer)
            grant = grant_from_words(words[1:])
            if words[0] == seq:
                return grant
            if grant is not None:  # (an answer that came too late for an earlier request)
                give_back(desk, grant)
    except (OSError, struct.error):
        _drop(address)
        return None


def disconnect() -> None:
    """Closes this process's connections (a worker's close as it exits; a test that asks in
    the main process closes its own)."""
    for address in list(_CONNECTIONS):
        _drop(address)


def give_back(desk: tuple[bytes, int], grant: SlotGrant) -> None:
    """Tells the desk ``desk`` that the slot of ``grant`` will not be written."""
    address, table = desk
    conn = _connection(address)
    if conn is None:
        return  # (taken back with the iterator, then)
    try:
        conn.send(_REQUEST.pack(_GIVE_BACK, 0, table, *grant.key, 0))
    except OSError:
        _drop(address)
