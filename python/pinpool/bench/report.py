"""Summaries over repeats, the printed table, the JSON file and the PNG plots.

Each metric of a scenario (a workload and a mode, or the stall scenario) is summarised per
loader as the median, min and max over its repeats (failed runs left out), and as
``ratio`` = that median / the baseline loader's median in the same scenario (None for a
loader that is the baseline itself on this machine). The stall scenario's phases are
summarised as ``<phase>_probe_max_ms`` and ``<phase>_wall_ms``.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

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
        ceiling = result.get("h2d_ceiling_gbps", {}).get(scenario)
        if ceiling:
            best = max(
                (by_loader[n]["gb_per_s"]["median"] for n in loaders if "gb_per_s" in by_loader[n]),
                default=0.0,
            )
            lines.append(
                f"  pinned H2D ceiling (same run): {ceiling:.1f} GB/s; "
                f"fastest loader at {100 * best / ceiling:.0f}% of it"
            )
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


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
        f.write("\n")


def plot_steps(result: dict[str, Any], scenario: str, path: str) -> None:
    """Step wall times of every repeat, one panel per loader (the compute loop's bubbles)."""
    runs = [r for r in result["runs"] if r["scenario"] == scenario and not r.get("error")]
    loaders = [n for n in result["loaders"] if any(r["loader"] == n for r in runs)]
    if not loaders:
        return
    fig, axes = plt.subplots(
        len(loaders), 1, figsize=(10, 1.9 * len(loaders) + 0.8), sharex=True, sharey=True
    )
    axes = [axes] if len(loaders) == 1 else list(axes)
    for ax, name in zip(axes, loaders, strict=True):
        title = name
        for r in (r for r in runs if r["loader"] == name):
            ax.plot(r["step_ms"], lw=0.9, alpha=0.8, label=f"{name} #{r['repeat'] + 1}")
            if "busy_ms" in r:
                ax.plot(r["busy_ms"], lw=0.7, ls="--", color="grey", alpha=0.7)
        ax.legend(fontsize=7, loc="upper right", ncol=4)
        idle = result["summary"].get(scenario, {}).get(name, {}).get("idle_share")
        if idle is not None:
            title += f"  (GPU idle {idle['median'] * 100:.1f}%; dashed: GPU busy, dotted: target)"
        if result["scenarios"][scenario]["mode"] == "compute":
            ax.axhline(result["config"]["compute_ms"], color="black", lw=0.6, ls=":")
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
    mode = result["scenarios"][scenario]["mode"]
    axes[-1].set_xlabel("timed step" + (" (first epoch)" if mode == "stall" else ""))
    fig.suptitle(f"{scenario}: wall time per step ({mode})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_phases(result: dict[str, Any], scenario: str, path: str) -> None:
    """The stall scenario's whole life: per phase, each loader's worst probe lateness and the
    phase's wall time (medians over repeats, log scale)."""
    by_loader = result["summary"].get(scenario, {})
    loaders = [n for n in result["loaders"] if n in by_loader]
    if not loaders or not any(k in by_loader[n] for n in loaders for k in PHASE_METRICS):
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(loaders)
    panels = [("probe_max_ms", "worst probe lateness, ms (lower is better)"), ("wall_ms", "wall")]
    for ax, (field, title) in zip(axes, panels, strict=True):
        for j, name in enumerate(loaders):
            ys = [
                (by_loader[name].get(f"{phase}_{field}") or {}).get("median") or 0.0
                for phase in PHASES
            ]
            xs = [i + j * width for i in range(len(PHASES))]
            ax.bar(xs, [max(y, 1e-3) for y in ys], width, label=name)
        ax.set_yscale("log")
        ax.set_xticks([i + width * (len(loaders) - 1) / 2 for i in range(len(PHASES))])
        ax.set_xticklabels(list(PHASES), fontsize=8)
        ax.set_title(title if field == "probe_max_ms" else "phase wall time, ms", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"{scenario}: a loader's whole life, phase by phase (median over repeats; 0 drawn at 0.001)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ratios(result: dict[str, Any], path: str) -> None:
    """Bar charts of each headline metric's ratio to the baseline, per scenario."""
    panels = []
    for mode, key in HEADLINES:
        groups = [
            (s, result["summary"].get(s, {}))
            for s, info in result["scenarios"].items()
            if info["mode"] == mode
        ]
        groups = [(s, g) for s, g in groups if any(key in m for m in g.values())]
        if groups:
            panels.append((mode, key, groups))
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.2 * max(1, len(panels)), 4))
    axes = list(axes) if len(panels) > 1 else [axes]
    loaders = result["loaders"]
    width = 0.8 / max(1, len(loaders))
    for ax, (mode, key, groups) in zip(axes, panels, strict=False):
        for j, name in enumerate(loaders):
            xs = [i + j * width for i in range(len(groups))]
            ys = [(g.get(name, {}).get(key) or {}).get("ratio") or 0.0 for _, g in groups]
            bars = ax.bar(xs, ys, width, label=name)
            labels = [f"{y:.2f}" if y else "" for y in ys]
            crowded = len(groups) * len(loaders) > 12
            ax.bar_label(bars, labels=labels, fontsize=7, rotation=90 if crowded else 0, padding=2)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([i + width * (len(loaders) - 1) / 2 for i in range(len(groups))])
        ax.set_xticklabels([s.split("/")[0] for s, _ in groups], fontsize=8)
        ax.set_title(f"{METRICS[key]} ({mode})", fontsize=9)
        ax.set_ylabel(f"ratio to {result['baseline']}")
        ax.grid(axis="y", alpha=0.3)
    if not panels:
        axes[0].text(0.5, 0.5, "no results", ha="center")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"pinpool bench: ratio to {result['baseline']} (median over repeats)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(result: dict[str, Any], out: str) -> list[str]:
    """Writes results.json, table.txt and the PNGs into ``out``; returns their paths."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, "results.json"), os.path.join(out, "table.txt")]
    write_json(result, paths[0])
    with open(paths[1], "w") as f:
        f.write(table(result) + "\n")
    for scenario in result["scenarios"]:
        if result["scenarios"][scenario]["mode"] == "churn":
            continue  # (no steps: loaders)
        path = os.path.join(out, f"steps-{scenario.replace('/', '-')}.png")
        plot_steps(result, scenario, path)
        paths.append(path)
        if result["scenarios"][scenario]["mode"] == "stall":
            path = os.path.join(out, f"phases-{scenario.replace('/', '-')}.png")
            plot_phases(result, scenario, path)
            paths.append(path)
    paths.append(os.path.join(out, "ratios.png"))
    plot_ratios(result, paths[-1])
    return [p for p in paths if os.path.exists(p)]
