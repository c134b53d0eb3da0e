"""``python -m pinpool.bench``: how much faster a training loop gets with pinpool, and whether
the GPU stops idling.

It compares torch's DataLoader (plain, and with ``pin_memory=True``) with ``pinpool.DataLoader``
(pinned CPU batches, and batches already on the GPU) on the same workloads, alternating the
loaders over repeats, and reports throughput to the device, time to the first batch, the time
a step spends inside ``next()``, the GPU's idle share in a compute-bound loop, main-thread
stalls, pinned host memory and CPU time, as a table (with a legend of its terms), a JSON file
and PNG plots. Each scenario's rates are also held against the ceilings measured in the same
run: the workers' own rate (torch's plain DataLoader, batches dropped) and, with CUDA, the
pinned host-to-device rate; each loader is shown as a share of the lower one, the one that
binds. ``python -m pinpool.bench --help`` lists the options.

Scenarios: every workload (default: ``synthetic`` images and ``tokens``, small batches of
int64 rows like a language model's) in ``throughput`` mode and, with CUDA, in ``compute``
mode (images only); then ``stall``: big batches over a loader's whole life, with the worst
main-thread stall of each phase reported on its own (construction, first batch, the rest of
the first epoch, a second epoch, ``del``, ``gc.collect()``).

Asked for by name (``--workloads varlen``), ``varlen``: batches of varying size, the usual NLP
"dynamic padding": token rows of 16 to 40,000 int64 tokens (a seeded long tail, the same for
every loader) padded per batch to its longest row, with an int64 attention mask, so one epoch's
batches vary by 100x and more (``--varlen-batch-size``, ``--varlen-workers``,
``--varlen-steps``). Besides throughput and stalls it reports, per loader, the pinned host
memory held at the end of the epoch (torch's caching host allocator, in use and cached; pinpool's
fixed arena) and pinpool's overflow batches and zero-copy fallbacks.

Modules: :mod:`.cli` (arguments, presets), :mod:`.workloads` (datasets), :mod:`.loaders`
(the loaders compared), :mod:`.measure` (one run and its metrics), :mod:`.ceilings` (the
rates the loaders are held against), :mod:`.runner` (the whole run), :mod:`.report` (table,
JSON, plots).
"""

import importlib.util

from .. import _torch_versions

# What the benchmark needs beyond pinpool itself: say how to get it, not just what is missing
# (the requirements as pyproject's "bench" extra has them).
_NEEDS = {
    "torch": _torch_versions.requirement(),
    "tqdm": "tqdm>=4.66",
    "matplotlib": "matplotlib>=3.8",
}
_MISSING = [name for name in _NEEDS if importlib.util.find_spec(name) is None]
if _MISSING:
    wanted = " ".join(f"'{_NEEDS[name]}'" for name in _MISSING)
    raise ModuleNotFoundError(
        f"python -m pinpool.bench needs {', '.join(_MISSING)}: pip install {wanted}",
        name=_MISSING[0],
    )

from .runner import main  # noqa: E402

__all__ = ["main"]
