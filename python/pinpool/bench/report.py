"""Summaries over repeats and the printed table (``output_files`` writes them, with the JSON
file and the PNG plots).

Each metric of a scenario (a workload and a mode, or the stall scenario) is summarised per
loader as the median, min and max over its repeats (failed runs left out), and as
``ratio`` = that median / the baseline loader's median in the same scenario (None for a
loader that is the baseline itself on this machine). The stall scenario's phases are
summarised as ``<phase>_probe_max_ms`` and ``<phase>_wall_ms``. Above each scenario's block,
the ceilings measured in the same run (``ceilings``) and the one that binds; in it, each
loader's share of that one.
"""

from __future__ import annotations

import statistics
from typing import Any

from .ceilings import H2D_CEILING, WORKERS, WORKERS_CEILING
from .measure import PHASES
from .ranks import table_lines

#: Metric key -> label in the table and the plots.
METRICS = {
    "gb_per_s": "GB/s",
    "batches_per_s": "batches/s",
    "us_per_batch": "us per batch",
    "steps_per_s": "steps/s",
    "idle_share": "GPU idle share",
    "idle_share_copy_busy": "GPU idle, copy as work",
    "next_ms_median": "next() ms, median",
    "next_ms_p99": "next() ms, p99",
    "next_ms_max": "next() ms, max",
    "busy_ms_median": "GPU busy ms/step",
    "step_ms_median": "step ms, median",
    "step_ms_max": "step ms, max",
    "probe_p99_ms": "probe late ms, p99",
    "probe_max_ms": "probe late ms, max",
    "cpu_ms_per_batch": "CPU ms/batch",
    "pinned_mib": "pinned MiB",
    "pinned_held_mib": "pinned MiB held at the end",
    "overflow_batches": "overflow batches (unpinned)",
    "zero_copy_fallbacks": "zero-copy fallbacks",
    "zero_copy_in_place": "zero-copy in place, %",
    "time_to_first_batch_s": "time to first batch, ms",
    "end_of_epoch_ms": "end of epoch, ms",
    "ms_per_loader": "ms a loader (made, run, dropped)",
    "rss_growth_mib": "RSS growth over the loop, MiB",
    "thread_growth": "threads grown over the loop",
    "rss_left_mib": "RSS left after the loop, MiB",
}
#: Phase metric key -> (phase, key in the run's ``phases[phase]``).
_PHASE_FIELDS = {
    "probe_max_ms": "probe late ms, max",
    "wall_ms": "wall ms",
    "outside_max_ms": "outside probe late ms, max",
}
PHASE_METRICS = {f"{phase}_{field}": (phase, field) for phase in PHASES for field in _PHASE_FIELDS}
METRICS.update(
    {key: f"{phase}: {_PHASE_FIELDS[field]}" for key, (phase, field) in PHASE_METRICS.items()}
)
#: Shown multiplied by this (a share in percent, seconds in ms).
SCALE = {
    "idle_share": 100.0,
    "idle_share_copy_busy": 100.0,
    "time_to_first_batch_s": 1e3,
    "zero_copy_in_place": 100.0,
}
#: Counts: shown as whole numbers where they are (a median of two may be a half).
COUNTS = {"overflow_batches", "zero_copy_fallbacks", "thread_growth"}
_COMMON = ["step_ms_max", "probe_p99_ms", "probe_max_ms", "cpu_ms_per_batch", "pinned_mib"]
_NEXT = ["next_ms_median", "next_ms_p99"]
#: The metrics shown for each mode, headline first (tokens, varlen: for their workloads).
SHOWN = {
    "throughput": [
        "gb_per_s",
        "batches_per_s",
        *_NEXT,
        "time_to_first_batch_s",
        "end_of_epoch_ms",
        *_COMMON,
    ],
    "tokens": [
        "gb_per_s",
        "us_per_batch",
        *_NEXT,
        "time_to_first_batch_s",
        "end_of_epoch_ms",
        *_COMMON,
    ],
    "varlen": [
        "gb_per_s",
        "us_per_batch",
        *_NEXT,
        "next_ms_max",
        "time_to_first_batch_s",
        "end_of_epoch_ms",
        *_COMMON,
        "pinned_held_mib",
        "overflow_batches",
        "zero_copy_fallbacks",
        "zero_copy_in_place",
    ],
    "churn": ["ms_per_loader", "rss_growth_mib", "thread_growth", "rss_left_mib"],
    "compute": [
        "steps_per_s",
        "idle_share",
        "idle_share_copy_busy",
        *_NEXT,
        "busy_ms_median",
        "step_ms_median",
        "time_to_first_batch_s",
        "end_of_epoch_ms",
        *_COMMON,
    ],
    "stall": [
        "probe_max_ms",
        "probe_p99_ms",
        "step_ms_max",
        *_NEXT,
        "gb_per_s",
        "cpu_ms_per_batch",
        "time_to_first_batch_s",
        "end_of_epoch_ms",
    ],
}
#: The ratio panels of ratios.png: (mode, metric).
HEADLINES = [
    ("throughput", "gb_per_s"),
    ("compute", "steps_per_s"),
    ("compute", "idle_share"),
    ("stall", "probe_max_ms"),
    ("throughput", "cpu_ms_per_batch"),
    ("throughput", "time_to_first_batch_s"),
]

#: What the table's terms mean, printed above it.
LEGEND = [
    "how to read it:",
    "  probe late: how late a thread of the main process that sleeps 1 ms at a time woke up.",
    "    It cannot run while the main thread holds the GIL (or the process is starved of CPU),",
    "    so this is how long the training loop's process was blocked. Lower is better.",
    "  next() ms: time the training loop waited inside next() per timed step. Lower is better.",
    "  time to first batch: from constructing the loader to the first batch in hand (workers",
    "    starting included). Lower is better.",
    "  end of epoch: the first epoch's final next(), the one that raises StopIteration (and",
    "    shuts the workers down where they are not persistent). Lower is better.",
    "  GB/s, batches/s, steps/s: higher is better. GPU idle share, step ms, us per batch, CPU",
    "    ms/batch (main process only, workers excluded): lower is better. GPU idle share: the",
    "    share of the time outside the step's compute, the step's copy of a CPU batch to the",
    "    GPU included; copy as work: that copy counted as GPU work.",
    "  stall, whole life: the loader's phases one by one: construction, first_batch (iter() and",
    "    the first next()), epoch1 (the rest of the first epoch), epoch2 (a second epoch), del",
    "    (del it, loader), gc (gc.collect() after it): the worst probe lateness within the",
    "    phase / the phase's wall time (outside: the worst lateness of the same sleeper run",
    "    in a process of its own; late there too, the machine's CPUs were all busy, rather",
    "    than the loader's process held up). gc.collect() walks the whole process's heap,",
    "    torch's included: the loader's own share is what exceeds the others' there.",
    "  ceilings (same run): the rates that bound the loaders here. workers: what the workers",
    f"    make, '{WORKERS.name}': torch's DataLoader over the same dataset, workers and",
    "    collate (torch's default stacking into memory each worker keeps, as pinpool's",
    "    workers write), each worker dropping its batch and sending only its size (no",
    "    hand-over, no copy, no GPU work), timed like the loaders; pinned H2D: copies from",
    "    pinned host memory",
    "    to the GPU (CUDA only). The lower one binds; share of binding ceiling = a loader's",
    "    median GB/s / that ceiling's.",
    "  pinned MiB: the most pinned host memory held during the run; held at the end: what is",
    "    still held when the epoch is over (torch: its caching host allocator's blocks, in use",
    "    and cached; pinpool: its fixed arena). Overflow batches: pinpool batches that went to",
    "    unpinned memory; zero-copy fallbacks: zero-copy batches moved through copy mode.",
]


def _value(run: dict[str, Any], key: str) -> Any:
    """A run's figure for a metric key (phase keys look inside ``phases``)."""
    if key in PHASE_METRICS:
        phase, field = PHASE_METRICS[key]
        return (run.get("phases") or {}).get(phase, {}).get(field)
    return run.get(key)


def summarize(
    runs: list[dict[str, Any]], baseline: str, no_ratio: list[str] | tuple[str, ...] = ()
) -> dict[str, Any]:
    """``{scenario: {loader: {metric: {median, min, max, values, ratio}}}}``; the loaders in
    ``no_ratio`` (the baseline itself on this machine) get ``ratio`` None."""
    out: dict[str, Any] = {}
    for run in runs:
        if run.get("error"):
            continue
        by_loader = out.setdefault(run["scenario"], {}).setdefault(run["loader"], {})
        for key in METRICS:
            value = _value(run, key)
            if value is not None:
                by_loader.setdefault(key, {"values": []})["values"].append(value)
    for by_loader in out.values():
        for metrics in by_loader.values():
            for m in metrics.values():
                m.update(median=statistics.median(m["values"]), min=min(m["values"]))
                m["max"] = max(m["values"])
        base = by_loader.get(baseline, {})
        for loader, metrics in by_loader.items():
            for key, m in metrics.items():
                b = base.get(key, {}).get("median")
                m["ratio"] = m["median"] / b if b and loader not in no_ratio else None
    return out


def _num(v: float | None, key: str = "") -> str:
    if v is None:
        return "-"
    v = v * SCALE.get(key, 1.0)
    if key in COUNTS and float(v).is_integer():
        return str(int(v))
    a = abs(v)
    return f"{v:.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}"


def _cell(m: dict[str, Any] | None, key: str, same: bool = False, missing: str = "-") -> str:
    """``median [min..max] xR``; ``x-`` where the loader is the baseline itself here;
    ``missing`` where it has no figure."""
    if m is None:
        return missing
    pct = "%" if key.startswith("idle_share") else ""
    text = f"{_num(m['median'], key)}{pct} [{_num(m['min'], key)}..{_num(m['max'], key)}]"
    if same:
        return f"{text} x-"
    return text if m["ratio"] is None else f"{text} x{m['ratio']:.2f}"


def _missing(result: dict[str, Any], loader: str, key: str) -> str:
    """What a table cell says where a loader has no figure: why, for pinned memory held
    without CUDA, else ``-``."""
    if key == "pinned_held_mib":
        for run in result["runs"]:
            if run["loader"] == loader and str(run.get("pinned_held") or "").startswith("n/a"):
                return str(run["pinned_held"])
    return "-"


def _phase_cell(metrics: dict[str, Any], phase: str) -> str:
    """``late / wall (outside)`` (medians, ms) of one phase."""
    late = metrics.get(f"{phase}_probe_max_ms")
    wall = metrics.get(f"{phase}_wall_ms")
    if late is None or wall is None:
        return "-"
    cell = f"{_num(late['median'])} / {_num(wall['median'])}"
    outside = metrics.get(f"{phase}_outside_max_ms")
    return cell if outside is None else f"{cell} ({_num(outside['median'])})"


def source_line(meta: dict[str, Any]) -> str:
    """Which pinpool ran, where: version, commit, extension file, host."""
    commit = meta.get("git_commit")
    where = f"commit {commit[:12]}" if commit else "no git commit (installed package?)"
    if commit and meta.get("git_dirty"):
        where += " + uncommitted changes"
    return (
        f"  pinpool {meta.get('pinpool_version')}, {where}, native "
        f"{meta.get('pinpool_native')}; host {meta.get('hostname')}, "
        f"{meta.get('cpus_usable')} CPUs, GPU {meta.get('device_name') or 'none'}"
    )


#: The table's row of each loader's share of the binding ceiling.
SHARE = "share of binding ceiling"


def ceiling_line(result: dict[str, Any], scenario: str, bound: str) -> str:
    """The ceilings measured for ``scenario`` (the workers': median [min..max] over repeats)
    and which one binds."""
    parts = []
    workers = result["summary"].get(scenario, {}).get(WORKERS.name, {}).get("gb_per_s")
    if workers is not None:
        parts.append(f"{WORKERS_CEILING} {_cell(workers, 'gb_per_s')} GB/s")
    h2d = result.get("h2d_ceiling_gbps", {}).get(scenario)
    if h2d:
        parts.append(f"{H2D_CEILING} {_num(h2d)} GB/s")
    line = f"  ceilings (same run): {'; '.join(parts)}; binding: {bound}"
    if result["scenarios"][scenario]["mode"] == "compute":
        line += " (the GPU work of each step bounds this loop too: see steps/s)"
    return line


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def table(result: dict[str, Any]) -> str:
    """The plain-text results: a header, then one block per scenario (metrics x loaders)."""
    meta, summary = result["meta"], result["summary"]
    lines = [f"pinpool bench: {meta['path']}", f"  {meta['machine']}"]
    if "pinpool_version" in meta:
        lines.append(source_line(meta))
    same = set(result.get("same_as_baseline") or ())
    cells = f"  cells: median [min..max] over repeats, xR = median / {result['baseline']}'s median"
    if same:
        cells += f" (x-: the same loader as {result['baseline']} here, no ratio)"
    lines.append(cells)
    lines += [f"  {line}" for line in LEGEND]
    for name, why in result["skipped"].items():
        lines.append(f"  skipped {name}: {why}")
    lines += [f"  note: {n}" for n in result["notes"]]
    for scenario, info in result["scenarios"].items():
        lines += ["", f"{scenario}: {info['description']}"]
        by_loader = summary.get(scenario, {})
        loaders = [n for n in result["loaders"] if n in by_loader]
        bound = result.get("binding_ceiling", {}).get(scenario)
        if bound is not None:
            lines.append(ceiling_line(result, scenario, bound["ceiling"]))
        if not loaders:
            lines.append("  (no successful runs)")
            continue
        rows = [["", *loaders]]
        workload = info["workload"]
        shown = SHOWN[workload if workload in ("tokens", "varlen") else info["mode"]]
        for key in shown:
            if any(key in by_loader[n] for n in loaders):
                rows.append(
                    [
                        METRICS[key],
                        *(
                            _cell(by_loader[n].get(key), key, n in same, _missing(result, n, key))
                            for n in loaders
                        ),
                    ]
                )
        if bound is not None:  # after the GB/s row, or the headline where GB/s is not shown
            at = next((i + 1 for i, r in enumerate(rows) if r[0] == METRICS["gb_per_s"]), 2)
            shares = [bound["share"].get(n) for n in loaders]
            rows.insert(at, [SHARE, *("-" if v is None else f"{100 * v:.0f}%" for v in shares)])
        if info["mode"] == "stall" and any(
            k in by_loader[n] for n in loaders for k in PHASE_METRICS
        ):
            rows.append(["whole life: probe late max / wall ms (outside)", *([""] * len(loaders))])
            for phase in PHASES:
                rows.append([f"  {phase}", *(_phase_cell(by_loader[n], phase) for n in loaders)])
        lines += ["  " + row for row in _aligned(rows)]
    if result.get("ranks_summary"):
        lines += table_lines(result)
    failed = [r for r in result["runs"] if r.get("error")]
    for r in failed:
        lines.append(f"FAILED {r['scenario']} {r['loader']} repeat {r['repeat']}: {r['error']}")
    return "\n".join(lines)
