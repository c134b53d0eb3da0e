"""The ceilings a scenario's loaders are held against, both measured in the same run, and
each loader's share of the one that binds.

- ``workers``: what the workers themselves make per second: :data:`WORKERS`, torch's plain
  DataLoader over the same dataset, with the same workers, prefetch and collate function,
  whose workers make each batch, drop it and send only its size (``MadeAndDropped``; torch's
  default collation stacks into memory each worker keeps, as pinpool's workers write): no
  hand-over of the batch, no transfer, no GPU work. The
  runner runs it in the scenario's rotation like one more loader (the same warm-up, steps
  and repeats, through ``measure.run_once``), in every scenario that has a rate (all but
  ``churn``, whose figures are per loader made), but it is reported as a ceiling, not a
  competitor: it is not in ``result["loaders"]`` and has no ratio.
- ``pinned H2D``: the rate of copies from pinned host memory to the GPU
  (``gpu_work.h2d_ceiling``), with CUDA only.

The lower of the two binds; a loader's share of it is its median GB/s over the ceiling's
(the workers': their median GB/s over the same repeats).
"""

from __future__ import annotations

from typing import Any

from .loaders import LoaderSpec

#: The workers' own rate, run as a loader: the batches are made and dropped, never moved.
WORKERS = LoaderSpec(
    "workers (no transfer)", "torch", {"pin_memory": False}, "none", made_and_dropped=True
)

#: The ceilings' names, as the table and the JSON say them.
WORKERS_CEILING = "workers"
H2D_CEILING = "pinned H2D"


def has_rate(mode: str) -> bool:
    """Whether a scenario of ``mode`` has a GB/s rate to hold against ceilings."""
    return mode != "churn"


def rotation(specs: list[LoaderSpec], mode: str) -> list[LoaderSpec]:
    """The specs a scenario runs in each repeat: the loaders, then :data:`WORKERS` where the
    scenario has a rate."""
    return [*specs, WORKERS] if has_rate(mode) else list(specs)


def workers_ceilings(summary: dict[str, Any]) -> dict[str, float]:
    """``{scenario: GB/s}``: the median rate of :data:`WORKERS`'s runs in each scenario."""
    return {
        scenario: by_loader[WORKERS.name]["gb_per_s"]["median"]
        for scenario, by_loader in summary.items()
        if "gb_per_s" in by_loader.get(WORKERS.name, {})
    }


def binding(
    summary: dict[str, Any],
    loaders: list[str],
    workers_gbps: dict[str, float],
    h2d_gbps: dict[str, float],
) -> dict[str, dict[str, Any]]:
    """``{scenario: {"ceiling", "gb_per_s", "share"}}``: which ceiling binds (the lower of
    ``workers_gbps`` and ``h2d_gbps``, where measured), its GB/s, and each of ``loaders``'
    share of it (median GB/s / the ceiling's GB/s)."""
    out: dict[str, dict[str, Any]] = {}
    for scenario, by_loader in summary.items():
        measured = {
            name: gbps[scenario]
            for name, gbps in ((WORKERS_CEILING, workers_gbps), (H2D_CEILING, h2d_gbps))
            if gbps.get(scenario)
        }
        if not measured:
            continue
        bound = min(measured, key=measured.__getitem__)
        ceiling = measured[bound]
        share = {
            name: by_loader[name]["gb_per_s"]["median"] / ceiling
            for name in loaders
            if "gb_per_s" in by_loader.get(name, {})
        }
        out[scenario] = {"ceiling": bound, "gb_per_s": ceiling, "share": share}
    return out
