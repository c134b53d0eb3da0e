"""``python -m pinpool.bench``: how much faster a training loop gets with pinpool, and whether
the GPU stops idling.

It compares torch's DataLoader (plain, and with ``pin_memory=True``) with ``pinpool.DataLoader``
(pinned CPU batches, and batches already on the GPU) on the same workloads, alternating the
loaders over repeats, and reports throughput to the device, the GPU's idle share in a
compute-bound loop, main-thread stalls, pinned host memory and CPU time, as a table, a JSON
file and PNG plots. ``python -m pinpool.bench --help`` lists the options.

Modules: :mod:`.cli` (arguments, presets), :mod:`.workloads` (datasets), :mod:`.loaders`
(the loaders compared), :mod:`.measure` (one run and its metrics), :mod:`.runner` (the
whole run), :mod:`.report` (table, JSON, plots).
"""

from .runner import main

__all__ = ["main"]
