"""epoch: one epoch as a checkpoint records it and as a resumed one replays it.

:class:`Epoch` is what an iteration records (the random states at its sampler's two draw
points, the batches and samples passed); :class:`ResumePlan` is how a resumed epoch's sampler
starts; :class:`EpochSampler` wraps torch's index sampler to record the one and carry out the
other (``checkpoint``'s doc tells the whole mechanism).

Invariants: a plan is used by one epoch only (the sampler takes it off the loader's
``Epochs`` as the epoch's first index list is drawn); what a resumed epoch yielded already is
dropped before torch sees it, or the epoch raises ``InvalidArgument`` where the caller's batch
sampler cuts other batches than the state's; torch's global RNG is put back after the first
index list whatever the sampler raised.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.utils.data

from ..._errors import InvalidArgument
from .state import States, capture, drawn_from, restore, type_name, uncaptured

_END = object()
BATCH_SAMPLER = torch.utils.data.BatchSampler
#: torch's own samplers, which draw their order from torch's generators alone (captured): an
#: epoch of one of these (in torch's batch sampler, or alone) is not looked at for draws from
#: Python's or numpy's global generators, whose state costs a few hundred microseconds to read.
TORCHS_SAMPLERS = (
    torch.utils.data.SequentialSampler,
    torch.utils.data.RandomSampler,
    torch.utils.data.SubsetRandomSampler,
    torch.utils.data.WeightedRandomSampler,
    torch.utils.data.distributed.DistributedSampler,
)


def draws_from_torch_only(sampler: Any) -> bool:
    """Whether ``sampler`` is one of torch's own (:data:`TORCHS_SAMPLERS`, not a subclass),
    alone or in torch's ``BatchSampler``."""
    if type(sampler) is BATCH_SAMPLER:
        sampler = sampler.sampler
    return type(sampler) in TORCHS_SAMPLERS


@dataclass
class Epoch:
    """One iteration of the loader: the random states at its sampler's two draw points
    (None until reached), and the batches yielded."""

    at_iter: States | None = None
    at_pull: States | None = None
    #: Batches passed: yielded, or (map-style) raised for by torch, which does not yield
    #: them again.
    yielded: int = 0
    #: Samples in the batches passed (None: not counted, for an iterable dataset, whose
    #: position is its own, or after an index list without a length).
    samples: int | None = 0
    #: Samples of each index list dispatched and not yet passed, in order.
    dispatched: collections.deque[int] = field(default_factory=collections.deque)
    #: Index lists of this torch iterator's epoch passed so far (skipped ones not counted).
    taken: int = 0
    ended: bool = False
    #: An iterable dataset's workers: each one's dataset state after its latest delivered
    #: batch, and the worker whose batch comes next.
    worker_states: dict[int, Any] = field(default_factory=dict)
    next_worker: int = 0
    #: Where the sampler drew this epoch's order from, if from a generator a state does not
    #: capture (``state.drawn_from``): the epoch cannot be resumed.
    uncaptured: str | None = None

    def sent(self, indices: Any, batched: bool) -> None:
        """An index list was dispatched (``batched``: a list of samples, else one sample)."""
        if self.samples is None:
            return
        try:
            self.dispatched.append(len(indices) if batched else 1)
        except TypeError:  # a batch sampler's own kind of index list: its samples unknown
            self.samples = None

    def took(self, taken: int | None, raised: bool) -> None:
        """torch's iterator yielded a batch, or raised (``raised``); it has passed ``taken``
        index lists of this epoch in all (None: every one dispatched, as without workers,
        where each is passed as it is drawn). A batch torch raised for is passed (a worker's
        exception: torch goes on with the next one) or not (a timeout), as ``taken`` says."""
        if self.samples is None:
            self.yielded += 0 if raised else 1
            return
        until = self.taken + len(self.dispatched) if taken is None else taken
        while self.taken < until and self.dispatched:
            self.taken += 1
            self.yielded += 1
            self.samples += self.dispatched.popleft()

    def delivered(self, worker: int, state: Any, num_workers: int) -> None:
        """A worker's batch was yielded, ``state`` its dataset's state after it."""
        self.worker_states[worker] = state
        self.next_worker = (worker + 1) % num_workers


@dataclass
class ResumePlan:
    """How a resumed epoch's sampler starts: states to put back when torch calls ``iter()``
    on it and at its first index list (``"undo"``: those right after ``iter()``, undoing the
    base seed drawn in between), what to drop, and the global RNG state to set after.

    What to drop: ``skip_samples`` samples of the order (batches cut from one sampler's
    order), or ``skip`` index lists whole, which must hold ``expect_samples`` samples when
    that is known (a batch sampler of the caller's)."""

    at_iter: States | None = None
    at_pull: States | str | None = None
    skip: int = 0
    skip_samples: int | None = None
    expect_samples: int | None = None
    after: torch.Tensor | None = None


class Epochs(Protocol):
    """What the sampler reads and updates of a loader's ``checkpoint.Resume``: the epoch under
    way and the plan for the one starting."""

    current: Epoch | None
    plan: ResumePlan | None


class EpochSampler:
    """torch's index sampler, wrapped for one torch iterator (every epoch of a persistent
    one): records each epoch's states, and replays a resumed one's (:class:`ResumePlan`)."""

    def __init__(self, base: Any, resume: Epochs, loader: Any) -> None:
        self.base = base
        self.resume = resume
        self.loader = weakref.proxy(loader)  # a persistent iterator is the loader's
        #: Each index list is a list of samples (else one sample: no batching).
        self.batched = bool(loader._auto_collation)
        #: Whether an epoch is looked at for draws from generators a state does not capture.
        self.watch_others = not draws_from_torch_only(base)

    def __iter__(self) -> Iterator[Any]:
        # torch may call iter() twice as its iterator starts (its base __init__, then _reset,
        # with the base seed drawn in between): the first call is the epoch's draw point, the
        # plan goes with the iterator first pulled.
        epoch, plan = self.resume.current, self.resume.plan
        if epoch is None:  # torch's iterator used outside DataLoader.__iter__
            epoch = self.resume.current = Epoch()
        first_call = epoch.at_iter is None
        if first_call and plan is not None and plan.at_iter is not None:
            restore(self.loader, plan.at_iter)
        if first_call:
            epoch.at_iter = capture(self.loader)
        others = uncaptured() if self.watch_others else None
        it = iter(self.base)  # now, when torch calls it: a sampler may draw here
        if first_call and plan is not None and plan.at_pull == "undo":
            plan.at_pull = capture(self.loader)
        return self._run(it, epoch, plan, others)

    def _run(self, it: Iterator[Any], epoch: Epoch, plan: ResumePlan | None, others: Any) -> Any:
        first: Any = _END
        if plan is not None and self.resume.plan is plan:
            self.resume.plan = None
        try:
            if plan is not None and isinstance(plan.at_pull, tuple):
                restore(self.loader, plan.at_pull)
            epoch.at_pull = capture(self.loader)
            if plan is not None:
                it = self._skip(it, plan)
            first = next(it, _END)
            drawn = None if others is None else drawn_from(others, uncaptured())
            if drawn is not None:
                drawer = self.base.sampler if type(self.base) is BATCH_SAMPLER else self.base
                epoch.uncaptured = f"{type_name(drawer)} draws its order with {drawn}"
        finally:
            if plan is not None and plan.after is not None:
                torch.set_rng_state(plan.after)
        while first is not _END:  # (not ``yield from it``: that calls iter() on it again,
            epoch.sent(first, self.batched)  # which restarts a sampler whose iter() returns
            yield first  # itself)
            first = next(it, _END)

    def _skip(self, it: Iterator[Any], plan: ResumePlan) -> Iterator[Any]:
        """``it`` without what the resumed epoch yielded already (see :class:`ResumePlan`)."""
        if plan.skip_samples is not None:
            if type(self.base) is torch.utils.data.BatchSampler:
                # Its sampler's order from that sample on, cut into this loader's batches.
                return _rebatched(self.base, plan.skip_samples)
            skip = plan.skip_samples  # no batching: an index list is a sample
        else:
            skip = plan.skip
        samples = 0
        for _ in range(skip):
            dropped = next(it, _END)
            if dropped is _END:
                break
            if plan.expect_samples is not None:
                samples += len(dropped)
        if plan.expect_samples is not None and samples != plan.expect_samples:
            raise InvalidArgument(
                f"this loader cannot resume the state it was given: its batch sampler "
                f"({type_name(self.base)}) made {skip} batches of {samples} samples where the "
                f"state's {skip} had {plan.expect_samples}, so the next unseen sample is not "
                "at a batch's start; make the loader with the batches the state was taken with"
            )
        return it

    def __len__(self) -> int:
        return len(self.base)  # the epoch's length, as the uninterrupted run's


def _rebatched(batches: torch.utils.data.BatchSampler, skip: int) -> Iterator[list[Any]]:
    """The batches torch's ``BatchSampler`` makes of its sampler's order from sample ``skip``
    on (``iter()`` on the sampler is called at the first batch, as ``BatchSampler`` does)."""
    samples = iter(batches.sampler)
    for _ in range(skip):
        if next(samples, _END) is _END:
            return
    size = int(batches.batch_size)
    while True:
        batch = list(itertools.islice(samples, size))
        if not batch or (len(batch) < size and batches.drop_last):
            return
        yield batch
