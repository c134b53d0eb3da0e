"""A batch in several slots: the batch the consumer waits for, in copy mode, when no one free
range of the arena holds it but the free ranges hold its arrays (``PinPool.claim_split``).

Batches taken ahead for later turns (zero-copy grants, the pin thread's claims) can leave the
arena's free bytes in ranges each too short for a batch larger than any before it, and none
of them comes back before the consumer has taken that batch. Rather than going to ordinary
memory, the batch is cut between its arrays (never inside one), one slot per piece, and its
leaves view the pieces they lie in.

Invariants:

- No leaf crosses a cut (:func:`cuts`): each leaf's bytes lie in one piece, at the same
  distance from the piece's start as from the batch's.
- Every piece's slot goes back when the last view of it dies. Only batches delivered on the
  CPU are split (a batch for the device goes to ordinary memory where no one range holds it).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

from ..._native import PinPool, SegmentCache, Slot
from ..._wire import leaves
from ..._wire.codec import LeafSpec

__all__ = ["SplitBatch", "cuts"]


def cuts(specs: list[LeafSpec], need: int) -> list[int]:
    """Where a batch of ``need`` bytes laid out as ``specs`` may be cut: 0, the start of each
    leaf that no leaf before it reaches into, and ``need``."""
    out = [0]
    reach = 0
    for offset, end in sorted((s.offset, s.offset + s.nbytes) for s in specs if s.nbytes):
        if offset >= reach and offset > out[-1]:
            out.append(offset)
        reach = max(reach, end)
    if need > out[-1]:
        out.append(need)
    return out


class SplitBatch:
    """One batch's slots: ``parts`` are ``(start, end, slot)``, the batch's bytes
    ``[start, end)`` at the start of ``slot``, in the batch's order."""

    __slots__ = ("_starts", "parts")

    def __init__(self, parts: list[tuple[int, int, Slot]]) -> None:
        self.parts = parts
        self._starts = [p[0] for p in parts]

    @classmethod
    def claimed(cls, pool: PinPool, specs: list[LeafSpec], need: int) -> SplitBatch | None:
        """The batch's pieces checked out of ``pool`` now, or None (nothing taken) when the
        free ranges cannot hold them, or the batch cannot be cut (one leaf)."""
        where = cuts(specs, need)
        if len(where) < 3:
            return None
        got = pool.claim_split(where)
        if got is None:
            return None
        ends = [start for start, _ in got[1:]] + [need]
        return cls([(start, end, slot) for (start, slot), end in zip(got, ends, strict=True)])

    def copy_in(self, cache: SegmentCache, key: tuple[int, int]) -> None:
        """Copies each piece's bytes from the segment ``key`` of ``cache`` into its slot."""
        for start, end, slot in self.parts:
            cache.copy(key, slot, [(start, 0, end - start)])

    def host_leaf(self, spec: LeafSpec) -> Any:
        """The array of ``spec`` over the piece it lies in (``leaves.host_leaf``)."""
        if not spec.nbytes:
            return leaves.host_leaf(b"", spec, 0)
        start, end, slot = self.parts[bisect_right(self._starts, spec.offset) - 1]
        return leaves.host_leaf(slot, spec._replace(offset=spec.offset - start), end - start)
