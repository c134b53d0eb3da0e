"""A model-based test of the slot life cycle on a tiny host pool.

The model tracks, for every Slot object the test ever got: whether the Python handle is still
held, whether ``release()`` was called, and how many views (numpy arrays, memoryviews, tensors
from ``Slot.view``) of it are alive. From that it predicts which slots are out of the pool:

- not released, and the handle or a view is alive -> checked out;
- released (explicitly), but a view is alive      -> still checked out (deferred release);
- otherwise                                       -> back in the pool.

After every step the prediction must match ``pool.stats()``. The pool is host-backed, so
releases take effect at once (no fences). Nothing blocks: checkouts use ``timeout=0.0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

import pinpool
from pinpool import PoolExhausted, SlotReleased

NUM_SLOTS = 3
SLOT_BYTES = 4096


@dataclass(eq=False)
class Handle:
    """The model of one checkout."""

    slot: Any  # the pinpool.Slot, or None once the test dropped its reference
    index: int
    generation: int
    released: bool = False
    views: list[Any] = field(default_factory=list)

    @property
    def out(self) -> bool:
        """Whether the model says this checkout still keeps its slot from the pool."""
        if self.views:
            return True
        return self.slot is not None and not self.released


class SlotLifecycle(RuleBasedStateMachine):
    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.pool = pinpool.PinPool(SLOT_BYTES, NUM_SLOTS, device="cpu", copy_threads=1)
        self.all: list[Handle] = []
        self.checkouts = 0
        self.releases = 0

    # ------------------------------------------------------------------ model helpers

    def expected_out(self) -> int:
        return sum(h.out for h in self.all)

    def _forget_finished(self) -> None:
        # A handle that is no longer out can never affect the counts again.
        self.all = [h for h in self.all if h.out]

    def _record_return(self, h: Handle, was_out: bool) -> None:
        # Every return to the pool counts as a release: explicit, deferred or automatic.
        if was_out and not h.out:
            self.releases += 1

    def _new_handle(self, slot: Any) -> Handle:
        h = Handle(slot=slot, index=slot.index, generation=slot.generation)
        assert 0 <= h.index < NUM_SLOTS
        live = {x.index for x in self.all if x.out}
        assert h.index not in live, f"slot {h.index} handed out while still out"
        self.all.append(h)
        self.checkouts += 1
        return h

    # ------------------------------------------------------------------ rules

    @initialize()
    def fresh_pool(self) -> None:
        assert self.pool.stats()["slots_free"] == NUM_SLOTS

    @rule(target=handles)
    def checkout(self) -> Any:
        free = NUM_SLOTS - self.expected_out()
        if free > 0:
            slot = self.pool.checkout(timeout=0.0)
            return self._new_handle(slot)
        try:
            self.pool.checkout(timeout=0.0)
        except PoolExhausted:
            pass
        else:
            raise AssertionError("checkout succeeded although the model has no free slot")
        return None

    @rule(target=handles)
    def try_checkout(self) -> Any:
        free = NUM_SLOTS - self.expected_out()
        slot = self.pool.try_checkout()
        if free > 0:
            assert slot is not None, "try_checkout returned None with a free slot"
            return self._new_handle(slot)
        assert slot is None, "try_checkout returned a slot although none is free"
        return None

    @rule(h=handles)
    def release(self, h: Handle | None) -> None:
        if h is None or h.slot is None:
            return
        was_out = h.out
        if h.released:
            try:
                h.slot.release()
            except SlotReleased:
                pass
            else:
                raise AssertionError("a second release() must raise SlotReleased")
            return
        h.slot.release()
        h.released = True
        assert h.slot.released
        self._record_return(h, was_out)

    @rule(h=handles)
    def double_release(self, h: Handle | None) -> None:
        if h is None or h.slot is None:
            return
        was_out = h.out
        if not h.released:
            h.slot.release()
            h.released = True
            self._record_return(h, was_out)
        try:
            h.slot.release()
        except SlotReleased:
            pass
        else:
            raise AssertionError("a second release() must raise SlotReleased")

    @rule(h=handles, kind=st.sampled_from(["numpy", "memoryview", "tensor", "numpy-slice"]))
    def make_view(self, h: Handle | None, kind: str) -> None:
        if h is None or h.slot is None:
            return
        if h.released:
            # No new view of a released slot, whatever its deferred state.
            try:
                if kind == "tensor":
                    h.slot.view(torch.uint8, (16,))
                else:
                    memoryview(h.slot)
            except (SlotReleased, BufferError):
                return
            raise AssertionError("made a view of a released slot")
        if kind == "numpy":
            view: Any = np.frombuffer(h.slot, dtype=np.uint8)
        elif kind == "memoryview":
            view = memoryview(h.slot)
        elif kind == "tensor":
            view = h.slot.view(torch.int32, (8,), offset=64)
        else:
            view = np.frombuffer(h.slot, dtype=np.uint8)[128:256]
        view[0] = h.index + 1
        h.views.append(view)

    @precondition(lambda self: any(h.views for h in self.all))
    @rule(data=st.data())
    def drop_view(self, data: st.DataObject) -> None:
        candidates = [h for h in self.all if h.views]
        h = data.draw(st.sampled_from(candidates))
        i = data.draw(st.integers(0, len(h.views) - 1))
        was_out = h.out
        view = h.views.pop(i)
        if isinstance(view, memoryview) and data.draw(st.booleans()):
            view.release()
        del view
        self._record_return(h, was_out)

    @rule(h=consumes(handles))
    def drop_slot(self, h: Handle | None) -> None:
        if h is None or h.slot is None:
            return
        was_out = h.out
        h.slot = None  # our only strong reference, besides the views
        self._record_return(h, was_out)

    # ------------------------------------------------------------------ checks

    @invariant()
    def counts_match_the_model(self) -> None:
        s = self.pool.stats()
        out = self.expected_out()
        assert s["slots_checked_out"] == out, (s, out)
        assert s["slots_free"] == NUM_SLOTS - out, (s, out)
        assert s["slots_fenced"] == 0
        assert s["checkouts"] == self.checkouts
        assert s["releases"] == self.releases, (s["releases"], self.releases)
        self._forget_finished()

    def teardown(self) -> None:
        for h in self.all:
            h.views.clear()
            h.slot = None
        self.all.clear()
        s = self.pool.stats()
        assert s["slots_free"] == NUM_SLOTS, s
        self.pool.close()


SlotLifecycle.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSlotLifecycle = SlotLifecycle.TestCase
