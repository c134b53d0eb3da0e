"""``pinpool.pinned``: batches of a loader pinpool does not own, copied into pinned slots.

One idea: wrap any iterable of batches (torch's DataLoader, torchdata's StatefulDataLoader,
accelerate's DataLoaderShard, a subclass of your own, made with ``pin_memory=False``) and give
each batch it yields one more copy, into a slot of a :class:`~pinpool.PinPool`, through a
loader's own :class:`~pinpool._main.route.receiver.Receiver` (``encode_local``, then
``delivery.hand_to_consumer``): the same slots, overflow and oversize rules, CPU views and
device copies as :class:`pinpool.DataLoader`, with none of its worker-side machinery.

Invariants:

- The wrapped loader is iterated on the consumer's thread, one batch per ``next()``, in its
  order: nothing is taken ahead, so the wrapped loader's ``state_dict()`` always describes the
  batches the consumer has been given.
- Every array leaf of a yielded batch (plain CPU tensors and numeric numpy arrays) lies in one
  slot of the pool, or in ordinary memory as ``overflow=``/``oversize=`` say (counted), or,
  with a CUDA ``device``, on that device with the consumer's current stream made to wait for
  the copy. Containers are rebuilt as torch's ``pin_memory`` rebuilds them (``_wire.tree``);
  other leaves (strings, numbers, tensors already on a GPU, tensors that need grad, objects
  the walk cannot look into) are the wrapped loader's own objects, so a batch with no array
  leaf comes out equal to the one the wrapped loader yielded.
- The pool made here (none is made before the first batch with arrays unless ``pool=`` or
  ``slot_bytes=`` is given) is closed when the wrapper is closed or collected; a pool passed
  in is the caller's and stays open.
"""

from __future__ import annotations

import uuid
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Generic, Literal, TypeVar

import torch

from . import _signals
from ._errors import InvalidArgument
from ._main.route.delivery import hand_to_consumer
from ._main.route.receiver import Receiver
from ._main.settings.arguments import ARGUMENTS
from ._main.settings.delivery_mode import copy_mode
from ._main.settings.pool_settings import PoolSettings
from ._native import PinPool
from ._stats import LoaderStats

__all__ = ["Pinned", "pinned"]

_T = TypeVar("_T")

#: Slots of a pool made here: the batch being copied in, plus 4 (what ``pinpool.DataLoader``
#: gives a loader without workers: batches in flight plus 4).
DEFAULT_NUM_SLOTS = 5
#: The arguments :func:`pinned` takes, beside the loader (declared in ``arguments.ARGUMENTS``,
#: with the same meanings and defaults as ``pinpool.DataLoader``'s).
PINNED_ARGUMENTS = tuple(a.name for a in ARGUMENTS if a.pinned)


def pinned(
    loader: Iterable[_T],
    *,
    device: str | torch.device | int | None = None,
    pool: PinPool | None = None,
    slot_bytes: int | None = None,
    num_slots: int | None = None,
    copy_threads: int | None = None,
    slot_timeout: float | None = 60.0,
    overflow: Literal["copy", "wait"] = "copy",
    oversize: Literal["pin", "copy", "error"] = "pin",
) -> Pinned[_T]:
    """Wraps ``loader`` (any iterable of batches) so that each batch it yields lands in a
    pinned slot of a :class:`~pinpool.PinPool`, or on ``device``.

    >>> loader = pinpool.pinned(torch.utils.data.DataLoader(dataset, batch_size=256,
    ...                                                     num_workers=8))
    >>> for images, labels in loader:        # views into a pinned slot
    ...     images = images.to("cuda", non_blocking=True)

    Make the wrapped loader with ``pin_memory=False`` (torch's pinning would copy every
    batch once more, into its caching host allocator, only for pinpool to copy it again: a
    warning says so). Each ``iter()`` of the wrapper iterates the wrapped loader again (an
    epoch); attributes the wrapper does not have (``dataset``, ``sampler``, ``batch_size``,
    ``set_epoch``, ``state_dict``, ``load_state_dict`` ...) are read from the wrapped loader.

    Arguments (as for :class:`pinpool.DataLoader`):

    - ``device``: None (default) yields pinned CPU batches, views into slots (a slot returns
      to the pool when the last of them dies, fenced on torch's current stream); a CUDA
      device yields batches already on it, copied on pinpool's copy stream, safe to use on
      the consumer's current stream (which is made to wait for the copy's event).
    - ``pool``: an existing pool to use (the caller's: not closed here). Default: one made at
      the first batch with arrays, with ``slot_bytes`` (default: that batch's size plus 25%,
      rounded up to 2 MiB) and ``num_slots`` (default: 5), closed with the wrapper.
    - ``copy_threads``: the pool's copy threads (default: up to 8), which copy a batch's
      arrays of 1 MiB and more into its slot without the GIL; smaller ones are copied by
      torch or numpy on the iterating thread.
    - ``overflow``: when every slot is held by a batch the consumer keeps alive, ``"copy"``
      (default) puts the batch in ordinary memory, counted in ``stats()["overflow_batches"]``;
      ``"wait"`` waits up to ``slot_timeout`` seconds (None: forever), then raises
      :class:`~pinpool.PoolExhausted`.
    - ``oversize``: a batch larger than a slot gets memory of its own, pinned by torch where
      there is a CUDA device (``"pin"``, default) or ordinary (``"copy"``), counted in
      ``stats()["oversize_batches"]``; ``"error"`` raises :class:`~pinpool.BatchTooLarge`.

    What it gains: batches in a fixed set of pinned slots, reused, instead of each one
    allocated through torch's caching host allocator (which keeps growing, rounding every
    batch up to a power of two); with ``device``, asynchronous copies fenced by CUDA events.
    What it cannot do (``pinpool.DataLoader`` does): batches from workers still come through
    torch's own shared memory, which torch maps and unmaps in the main process with the GIL
    held, and are copied once more here on the iterating thread; no segment is reused by the
    workers, nothing is zero-copy, and no collation is streamed. Batches already on a GPU
    pass through untouched (for accelerate, prepare the loader with device placement off).
    """
    return Pinned(
        loader,
        device=device,
        pool=pool,
        slot_bytes=slot_bytes,
        num_slots=num_slots,
        copy_threads=copy_threads,
        slot_timeout=slot_timeout,
        overflow=overflow,
        oversize=oversize,
    )


class Pinned(Generic[_T]):
    """A loader's batches in pinned slots: what :func:`pinned` returns (see there)."""

    def __init__(
        self,
        loader: Iterable[_T],
        *,
        device: str | torch.device | int | None = None,
        pool: PinPool | None = None,
        slot_bytes: int | None = None,
        num_slots: int | None = None,
        copy_threads: int | None = None,
        slot_timeout: float | None = 60.0,
        overflow: Literal["copy", "wait"] = "copy",
        oversize: Literal["pin", "copy", "error"] = "pin",
    ) -> None:
        if not isinstance(loader, Iterable):
            raise InvalidArgument(f"pinned() needs an iterable of batches, not {loader!r}")
        if isinstance(loader, Pinned) or "_pinpool_receiver" in getattr(loader, "__dict__", {}):
            raise InvalidArgument(
                "this loader's batches are in pinpool slots already (pinpool.DataLoader "
                "takes device=, pool=, slot_bytes= itself)"
            )
        given = {name: value for name, value in locals().items() if name in PINNED_ARGUMENTS}
        pool_settings = PoolSettings.checked(given, default_num_slots=DEFAULT_NUM_SLOTS)
        if getattr(loader, "pin_memory", False) is True:
            warnings.warn(
                "the loader given to pinpool.pinned() has pin_memory=True: every batch is "
                "then pinned by torch and copied again by pinpool; make it with "
                "pin_memory=False",
                stacklevel=3,
            )
        self._inner = loader
        receiver = Receiver(uuid.uuid4().hex, pool_settings, copy_mode(pool_settings.device))
        self._receiver = receiver
        if pool_settings.known:
            receiver.pools.pool_for(0)  # sizes known: make the pool now
        self._finalizer = weakref.finalize(self, _signals.finalizing, receiver.close)

    def __iter__(self) -> Iterator[_T]:
        return _PinnedIter(self._receiver, iter(self._inner))

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]  # TypeError if it has none

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper lacks. Dunders stay the wrapper's own (copy,
        # pickle and the like must not find the wrapped loader's), and so do the wrapper's
        # fields before __init__ has set them.
        if name.startswith("__") or name in ("_inner", "_receiver", "_finalizer"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    @property
    def pool(self) -> PinPool | None:
        """The pool batches land in (None until the first batch when it is made lazily)."""
        return self._receiver.pool

    def stats(self) -> LoaderStats:
        """The counters of ``pinpool.DataLoader.stats()`` (:class:`~pinpool.LoaderStats`): the
        pool's (once it exists), ``batches`` and ``bytes`` handed over, ``overflow_batches``;
        the zero-copy and segment counters are 0 (a wrapped loader has neither)."""
        return self._receiver.stats()

    def close(self) -> None:
        """Closes the pool made for this wrapper (its arena is freed once the batches that
        still view it die); a pool passed in stays open. Iterating afterwards raises
        :class:`~pinpool.PoolClosed` at the first batch with arrays."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"pinpool.pinned({self._inner!r}, pool={self.pool!r})"


class _PinnedIter(Iterator[Any]):
    """One epoch: each batch of the wrapped loader's iterator, copied in as it is asked for.

    A class rather than a generator: a generator's frame would keep the last batch (and its
    slot) alive until the next ``next()``."""

    __slots__ = ("_inner", "_receiver")

    def __init__(self, receiver: Receiver, inner: Iterator[Any]) -> None:
        self._receiver = receiver
        self._inner = inner

    def __iter__(self) -> _PinnedIter:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        pool = self._receiver.pool
        # The pool's copy threads (one for the batch that makes the pool).
        threads = pool.copy_threads if pool is not None else 1
        return hand_to_consumer(self._receiver.encode_local(batch, None, threads))
