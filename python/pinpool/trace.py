"""``pinpool.trace``: a hook that tells probes and profilers the steps each batch takes.

>>> import pinpool.trace
>>> with pinpool.trace.recording() as events:
...     pass  # make and iterate a pinpool.DataLoader here
>>> [e.name for e in events]
[]

Each :class:`Event` is ``(name, start_ns, end_ns, thread, details)``; the names, what each
measures and its details are in :data:`EVENTS` (and ``docs/development.md``). With no hook set
the library does no work for it. Invariants: see ``pinpool._trace``.
"""

from __future__ import annotations

from ._trace import EVENTS, Event, recording, set_hook

__all__ = ["EVENTS", "Event", "recording", "set_hook"]
