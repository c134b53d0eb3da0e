"""Checkpoint and resume mid-epoch: what ``DataLoader.state_dict()`` records, and how the
next iteration replays it.

checkpoint: building a loader's state and applying a loaded one (``state``: the saved
state's format and validation; ``epoch``: one epoch's record and the sampler that replays
it).

An epoch's batches are a function of the random states its index sampler starts from: torch's
global RNG (a ``RandomSampler`` without a generator draws its seed from it), the loader's
``generator`` and any sampler's ``generator``. :class:`EpochSampler` wraps the index sampler
torch reads and records those states at the two points a sampler draws: when torch calls
``iter()`` on it (as the iterator starts, before torch draws the workers' base seed) and at its
first index list (after). A resumed epoch puts the states back at the same two points, so the
sampler makes the same order, and drops what was already yielded before anyone sees it: no
worker loads it and, under the zero-copy ``ReservingSampler``, no slot is handed out for it.

Where an epoch is counts **samples**, not batches: the loader counts the samples of each
batch it yields (the length of its index list, as dispatched, in order). When the batches are
cut from one sampler's order (torch's ``BatchSampler``, or no batching) a resumed epoch starts
at the next unseen sample of that order and cuts the rest into its own loader's batches, of
whatever size: a state taken after 4 batches of 4 resumes a ``batch_size=8`` loader at sample
16. A batch sampler of the caller's makes batches of its own: there the batches already
yielded are dropped whole, and the samples they held must add up to the state's count.

A state records what decides the order (:func:`order_of`: the dataset's length, the sampler's
class, length and order-deciding attributes); loading a mid-epoch state into a loader whose
order differs raises ``InvalidArgument`` naming the difference, rather than resuming at a
sample that is not the next unseen one. A ``DistributedSampler``'s epoch is set by the caller
after loading (``set_epoch``): it is compared when the resumed epoch starts.

An ``IterableDataset`` resumes itself, from its own ``state_dict()``. With ``num_workers=0``
that is taken with the loader's and loaded back before its iterator is made. With workers,
each worker holds its own copy of the dataset: each batch comes with its worker's state right
after it (``_wire.handle.WorkerProgress``), the loader keeps the latest delivered batch's
state of each worker and which worker's batch comes next (torch deals batches out to the
workers in turn), and a resumed epoch loads each worker's state into its copy of the dataset
(:class:`LoadWorkerState`, before the worker's iterator is made) and starts the turns at that
worker (the ``_worker_queue_idx_cycle`` property of ``_main.epochs.workers.WorkersIter``).
Its position is the dataset's: another batch size resumes at the next unseen sample of each
worker's copy.

Invariants:

- A state is plain data (ints, bools, strings, None, dicts, CPU uint8 tensors, and an iterable
  dataset's own state): ``torch.save``-able, loadable into a fresh loader made with the same
  arguments (or another batch size). Each distinct random state is one tensor object, however
  many places name it (``torch.save`` and ``copy.deepcopy`` keep one copy).
- A mid-epoch state resumes at the next unseen sample or is refused when it is loaded (the
  order differs) or, for a batch sampler of the caller's whose batches turn out to differ,
  when the resumed epoch starts: never at another sample.
- Once a resumed epoch's sampler has made its first index list, torch's global RNG and the
  generators are as they were at ``state_dict()`` (or as they were then plus that epoch's own
  draws, when the state was taken before them), so what the caller draws next, and the next
  epochs, are as in the uninterrupted run; with ``persistent_workers`` too (the base seed a
  resumed loader draws for its new workers, where the uninterrupted run's kept theirs, is
  undone at the first index list).
- A state taken between epochs (before the first ``iter()``, or once an iterator has ended)
  resumes at the next epoch: the random states are put back as they were, nothing is skipped.
- Not replayed: random state of the workers themselves (skipping shifts which worker makes
  which batch, a worker's RNG has not advanced over the skipped batches, and persistent
  workers were seeded when they started), and samplers drawing from RNGs other than torch's
  (Python's ``random``, numpy) or from torch's global RNG after their first index list.
- An iterable dataset's workers resume where their delivered batches left them: batches a
  worker had made ahead, not yet delivered, are made again.
- A version-1 state (counting batches only, with no record of the order) still loads, with a
  warning: it resumes right only in a loader with the batches it was taken with, which
  nothing can check.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.data

from ..._errors import InvalidArgument
from .epoch import Epoch, EpochSampler, ResumePlan
from .state import (
    VERSION,
    VERSIONS,
    Shared,
    capture,
    check_sampler_epoch,
    check_state,
    checked_field,
    order_differs,
    order_of,
    plain,
)

# (Epoch and EpochSampler: the loader's modules import them from here.)
__all__ = [
    "Epoch",
    "EpochSampler",
    "LoadWorkerState",
    "NotResumable",
    "Resume",
    "WorkerStart",
    "raise_if_not_resumable",
    "unsupported",
]


@dataclass
class WorkerStart:
    """How a resumed epoch of an iterable dataset's workers starts: each worker's dataset
    state (by worker id; a worker without one starts afresh) and the worker whose batch comes
    first."""

    states: dict[int, Any]
    first: int


@dataclass
class Resume:
    """A loader's checkpoint state: the latest iteration, a loaded state not yet used, and
    the plan for the epoch starting.

    ``iterable``: the dataset is an ``IterableDataset``; ``num_workers``: the loader's. The
    loader calls :func:`raise_if_not_resumable` before ``state_dict`` and ``load_state_dict``."""

    iterable: bool
    num_workers: int = 0
    current: Epoch | None = None
    pending: dict[str, Any] | None = field(default=None, repr=False)
    plan: ResumePlan | None = field(default=None, repr=False)
    #: For the next torch iterator made (an iterable dataset with workers).
    worker_start: WorkerStart | None = field(default=None, repr=False)

    @property
    def worker_states(self) -> bool:
        """Workers send their dataset's state with each batch."""
        return self.iterable and self.num_workers > 0

    def start(self, loader: Any) -> None:
        """An iteration starts (before torch's iterator is made or reset): a new epoch, and
        the plan from a loaded state for its sampler (:class:`EpochSampler`). Raises
        ``InvalidArgument``, changing nothing, when the loaded state's sampler was at another
        epoch (``set_epoch``) than the loader's is now."""
        state = self.pending
        # What a mid-epoch state says of its order (version 2, map-style: checked at load).
        order = None
        if state is not None and state["epoch"] is not None:
            if state["version"] >= 2 and not self.iterable:
                order = state["order"]
                check_sampler_epoch(order, loader)
        self.pending = None
        self.current = Epoch(samples=None if self.iterable else 0)
        self.plan, self.worker_start = None, None
        if state is None:
            return
        now = (state["rng"], state["generators"])
        epoch = state["epoch"]
        if epoch is None:  # taken between epochs
            self.plan = ResumePlan(at_iter=now, at_pull="undo" if state["iterator_kept"] else None)
            return
        if self.worker_states:
            workers = state["workers"]
            self.worker_start = WorkerStart(dict(workers["states"]), workers["next"])
            self.current.worker_states = dict(workers["states"])
            self.current.next_worker = workers["next"]
        elif self.iterable:
            loader.dataset.load_state_dict(state["dataset"])
        self.current.yielded = epoch["yielded"]
        # (Version 1 did not count samples: a "samples" there is not one this code wrote.)
        samples = epoch["samples"] if state["version"] >= 2 and not self.iterable else None
        self.current.samples = samples
        at_iter = (epoch["at_iter"]["rng"], epoch["at_iter"]["generators"])
        if epoch["at_pull"] is None:  # taken before the sampler's first index list
            self.plan = ResumePlan(at_iter=at_iter, at_pull=now)
            return
        at_pull = (epoch["at_pull"]["rng"], epoch["at_pull"]["generators"])
        self.plan = ResumePlan(at_iter=at_iter, at_pull=at_pull, after=state["rng"])
        if self.iterable:
            return  # (the dataset resumes itself)
        if order is not None and order["by"] == "batches":
            self.plan.skip, self.plan.expect_samples = epoch["yielded"], samples
        elif samples is not None:
            self.plan.skip_samples = samples
        else:  # samples not counted (a version-1 state): its batches, as they were
            self.plan.skip = epoch["yielded"]

    def state_dict(self, loader: Any, dataset: Any, iterator_kept: bool) -> dict[str, Any]:
        """``iterator_kept``: the next epoch resets a persistent torch iterator (no base seed
        drawn)."""
        if self.pending is not None:  # loaded, not iterated since
            return dict(self.pending)
        epoch = self.current
        if epoch is not None and epoch.uncaptured is not None:
            raise NotResumable(
                f"pinpool.DataLoader cannot checkpoint this loader: its sampler "
                f"{epoch.uncaptured}, which a checkpoint does not capture (a resumed epoch "
                "would draw another order: samples seen twice, others never); draw the order "
                "with torch's generator (the loader's generator= or torch.manual_seed)"
            )
        mid = epoch is not None and not epoch.ended and epoch.at_iter is not None
        rng, generators = capture(loader)
        shared = Shared()
        return {
            "version": VERSION,
            "iterable": self.iterable,
            "rng": shared(rng),
            "generators": {p: shared(g) for p, g in generators.items()},
            "iterator_kept": iterator_kept,
            "epoch": {
                "at_iter": plain(epoch.at_iter, shared),
                "at_pull": plain(epoch.at_pull, shared),
                "yielded": epoch.yielded,
                "samples": epoch.samples,
            }
            if epoch is not None and mid
            else None,
            "num_workers": self.num_workers,
            "order": None if self.iterable else order_of(loader),
            "dataset": dataset.state_dict()
            if self.iterable and mid and not self.worker_states
            else None,
            "workers": {"states": dict(epoch.worker_states), "next": epoch.next_worker}
            if epoch is not None and mid and self.worker_states
            else None,
        }

    def load_state_dict(self, state: dict[str, Any], loader: Any = None) -> None:
        """Takes ``state`` for the next iteration, once the whole of it is checked (against
        ``loader``'s generators too, if given): a malformed state raises one
        ``InvalidArgument`` (a ValueError) naming the field here, and leaves the loader as it
        was, rather than failing at ``iter()`` or in a worker."""
        version = state.get("version") if isinstance(state, dict) else None
        if type(version) is not int or version not in VERSIONS:
            raise InvalidArgument(
                f"not a pinpool DataLoader state of version {' or '.join(map(str, VERSIONS))} "
                f"(version {version!r:.80})"
            )
        if checked_field(state, "iterable", bool) != self.iterable:
            kinds = ("a map-style", "an iterable")
            raise InvalidArgument(
                f"the state is {kinds[state['iterable']]} dataset's, "
                f"this loader has {kinds[self.iterable]} dataset"
            )
        num_workers = checked_field(state, "num_workers", int)
        if self.iterable and num_workers != self.num_workers:
            raise InvalidArgument(
                f"the state is of an iterable dataset's loader with num_workers="
                f"{num_workers}, this loader has {self.num_workers}: each "
                "worker resumes its own copy of the dataset"
            )
        check_state(state, self.iterable, self.num_workers, loader)
        if state["epoch"] is not None and not self.iterable:
            if version >= 2 and loader is not None:
                why = order_differs(state["order"], order_of(loader))
                if why is not None:
                    raise InvalidArgument(
                        f"this loader cannot resume the state: {why}, so it would not resume "
                        "at the next unseen sample; make the loader as the one the state was "
                        "taken from (the batch size may differ)"
                    )
            elif version == 1:
                warnings.warn(
                    "a pinpool DataLoader state of version 1 counts batches, not samples, and "
                    "does not record the order it was taken with: it resumes at the right "
                    "sample only in a loader with the sampler and batches it was taken with, "
                    "which cannot be checked",
                    UserWarning,
                    stacklevel=3,
                )
        self.pending = state


class NotResumable(NotImplementedError, AttributeError):
    """What ``state_dict``/``load_state_dict`` raise on a loader that cannot resume. Also an
    AttributeError, so that ``hasattr(loader, "state_dict")`` is False: frameworks that
    checkpoint every loader with those methods (Lightning's ``_Stateful``) then treat it as
    one without them, as they treat torch's, instead of failing at every checkpoint."""


def raise_if_not_resumable(why_not: str | None) -> None:
    """Raises :class:`NotResumable` when ``why_not`` (from :func:`unsupported`) says why."""
    if why_not is not None:
        raise NotResumable(f"pinpool.DataLoader cannot checkpoint and resume {why_not}")


def unsupported(dataset: Any, iterable: bool, num_workers: int, in_order: bool) -> str | None:
    """Why a loader with these settings cannot checkpoint and resume (None: it can)."""
    if iterable and not (hasattr(dataset, "state_dict") and hasattr(dataset, "load_state_dict")):
        return (
            "an IterableDataset without state_dict() and load_state_dict() (it would restart "
            f"from its beginning): {type(dataset).__name__}"
        )
    if not iterable and num_workers > 0 and not in_order:
        return (
            "with in_order=False and workers: batches are yielded as they arrive, so the "
            "batches yielded are not the first ones drawn, and no count says which were"
        )
    return None


class LoadWorkerState:
    """The ``worker_init_fn`` of a resumed epoch's workers (an iterable dataset): the
    caller's own, then the worker's dataset state loaded into its copy of the dataset
    (torch makes the worker's iterator over the dataset after this)."""

    def __init__(self, states: dict[int, Any], init_fn: Any) -> None:
        self.states = states
        self.init_fn = init_fn

    def __call__(self, worker_id: int) -> None:
        if self.init_fn is not None:
            self.init_fn(worker_id)
        state = self.states.get(worker_id)
        info = torch.utils.data.get_worker_info()
        if state is not None and info is not None:
            dataset: Any = info.dataset
            dataset.load_state_dict(state)
