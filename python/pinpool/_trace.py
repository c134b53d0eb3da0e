"""The trace hook: what the library tells a probe about the steps a batch takes, and costs
nothing while nobody listens.

A probe (``benchmarks/first_batch.py``, ``next_profile.py``, ``stall_trace.py``) sets a hook
(:func:`set_hook`, or :func:`recording`); the library then calls it with an :class:`Event`
for each step listed in :data:`EVENTS`, on the thread that took the step. Nothing else of the
library is patched or read, so probes do not rot as the code behind the names moves.

How the library marks a step (each mark is one line, plus an ``if``, so that it moves easily
with the code around it)::

    t0 = _trace.on and _trace.now()         # False while no hook is set: nothing is made
    ...                                      # the step
    if t0:
        _trace.span("slot.claim", t0, nbytes=need)  # one event, from t0 to now

    if _trace.on:
        _trace.event("pool.ensure", nbytes=nbytes)  # an instant: start == end

Invariants:

- With no hook set, a mark costs a module attribute load and a truth test: no call, no
  allocation (the details' dict is built only inside the ``if``).
- The hook is called on the thread that took the step, right after it (a span's end),
  possibly under one of the library's locks: it must not call into pinpool. A step that
  raised is not reported.
- An exception the hook raises never reaches the library's caller: the hook is removed (the
  trace is then incomplete) and one ``RuntimeWarning`` says so. (A ``BaseException`` that is
  not an ``Exception``, a signal handler's ``KeyboardInterrupt`` say, goes on.)
- The hook is a module global: a worker process forked after it was set has it too (its
  events stay in that process); a spawned one has none unless its ``worker_init_fn`` sets
  one.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple


class Event(NamedTuple):
    """One step: ``name`` (one of :data:`EVENTS`), its start and end in
    ``time.perf_counter_ns()`` (equal for an instant), the name of the thread that took it,
    and what the library knew of it (``details``: keys listed in :data:`EVENTS`)."""

    name: str
    start_ns: int
    end_ns: int
    thread: str
    details: dict[str, Any]


#: Every event the library reports: name -> what it measures (and its details). A span runs
#: from the step's start to its end; an instant has ``start_ns == end_ns``.
EVENTS: dict[str, str] = {
    # A loader's life, main process.
    "loader.iter": "iter(loader): the epoch's iterator made, its workers started (span)",
    "workers.start": "torch's worker iterator made: workers started, first indices sent "
    "(span; num_workers > 0)",
    "loader.next": "one next() of the loader's iterator, from the call to the batch returned "
    "(span)",
    "workers.shutdown": "the loader's workers told to exit, joined, reaped (span; background: "
    "at an epoch's natural end, only begun here, and finished by workers.end; pids: the "
    "workers')",
    "workers.end": "an ended epoch's workers shut down on a thread of their own, and what they "
    "held taken back (span)",
    "loader.close": "the loader's receiver closed: grants and segments taken back, its own "
    "pool closed (span)",
    # The pool.
    "pool.ensure": "the pool is needed and not made yet (instant; nbytes: the batch's size, "
    "hinted: sized from a worker's hint)",
    "pool.make": "the loader's pool made (span; nbytes, hinted, arena_bytes, largest, "
    "as_needed: the first batches' room ready, the rest made ready as claims need it)",
    # A batch, main process (the consumer's thread, or torch's pin thread).
    "index.put": "a batch's indices pickled and handed to the Rust writer of a worker's pipe "
    "(span; nbytes)",
    "batch.take": "a batch handle taken: its memory found, copied, delivered (span; ahead: on "
    "torch's pin thread, ahead of the consumer)",
    "batch.receive": "a copy-mode handle's fields checked and its segment held (opened and "
    "mapped the first time) (span; first: the segment's first batch)",
    "batch.adopt": "zero-copy: the batch's slot adopted and its specs checked (span; nbytes)",
    "slot.claim": "a slot of the batch's size claimed, waiting without the GIL if the arena is "
    "full (span; nbytes, ahead, got: 'slot', 'later' or 'overflow')",
    "batch.copy": "the batch's bytes put in its slot (span; nbytes, how: 'slot' copied now, "
    "'background' started on a copy thread, 'buffer' copied into ordinary memory, 'pieces' "
    "copied into several slots, 'local' written from this process with num_workers=0; a "
    "batch copied on its way to the device has batch.send instead)",
    "batch.deliver": "the batch rebuilt over its memory: CPU views, or started on its way to "
    "the device (span; nbytes)",
    "batch.send": "a slot's bytes (a segment's, copied in on the way) sent to the device in "
    "one call without the GIL, or that copy and send started on a copy thread (span; nbytes, "
    "background: True then)",
    "batch.wait": "the consumer waits for its batch: a background copy into the slot, the "
    "copy to the device handed to its stream, or a small batch sent to the device on its "
    "stream (span; what: 'landing', 'device' or 'send')",
    "batch.finish": "the consumer's turn for an item torch produced: a handle taken, a copy "
    "waited for (span)",
    # A batch, worker process (events stay in the worker: see the module's doc).
    "worker.grant": "zero-copy: a slot of the batch's size asked for at the main process's "
    "grant desk (span; nbytes, got: whether one was granted)",
    "worker.destination": "the memory a batch is written into: its zero-copy slot's window "
    "opened, or a segment of the worker's ring claimed (span; nbytes, slot: a zero-copy slot, "
    "mapped: its window mapped now rather than kept from an earlier batch)",
    "worker.stream": "samples made and their big arrays streamed into the batch's memory "
    "(span; count)",
    "worker.write": "a planned batch (or its rest, after streaming) written into its memory "
    "(span; nbytes)",
}

#: The hook, or None. Set it with :func:`set_hook`.
hook: Callable[[Event], None] | None = None
#: Whether a hook is set (read by every mark: see the module's doc).
on = False

_lock = threading.Lock()
now = time.perf_counter_ns


def set_hook(new: Callable[[Event], None] | None) -> Callable[[Event], None] | None:
    """Has ``new`` called with every :class:`Event` from now on (None: no more events);
    returns the hook it replaces. The hook runs on the library's threads, between its steps:
    keep it short (append to a list), and thread-safe."""
    global hook, on
    with _lock:
        old, hook = hook, new
        on = new is not None
    return old


@contextlib.contextmanager
def recording() -> Iterator[list[Event]]:
    """Records every event in the ``with`` block into the list it yields; the hook set before
    is set again at the end (events are not passed on to it meanwhile)."""
    events: list[Event] = []
    old = set_hook(events.append)
    try:
        yield events
    finally:
        set_hook(old)


def span(name: str, start_ns: int, **details: Any) -> None:
    """Reports step ``name``, from ``start_ns`` (``now()`` when it began) to now. Call it only
    where a hook was set at the start (``t0 = _trace.on and _trace.now()``; ``if t0:``)."""
    _call(Event(name, start_ns, now(), threading.current_thread().name, details))


def event(name: str, **details: Any) -> None:
    """Reports instant ``name`` (call it only under ``if _trace.on:``)."""
    t = now()
    _call(Event(name, t, t, threading.current_thread().name, details))


def _call(e: Event) -> None:
    h = hook
    if h is None:
        return  # (removed meanwhile)
    try:
        h(e)
    except Exception as exc:
        with _lock:
            if hook is not h:
                return  # (replaced or removed meanwhile: warned once, by whoever removed it)
            _remove()
        warnings.warn(
            f"pinpool.trace: the trace hook {h!r} raised {type(exc).__name__}: {exc} (at event "
            f"{e.name!r}); it was removed, and no more events are reported",
            RuntimeWarning,
            stacklevel=2,
        )


def _remove() -> None:
    global hook, on
    hook, on = None, False
