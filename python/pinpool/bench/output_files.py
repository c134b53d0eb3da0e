"""The files a bench run writes into its ``--out`` folder: ``results.json`` (the whole
result), ``table.txt`` (``report.table``) and the PNG plots (step times per scenario, the stall
scenario's phases, each headline metric's ratio to the baseline).

Invariants: every figure drawn is read from the result (``report.summarize``'s summaries and
the runs' own records), never measured here; a plot with nothing to show is not written, and
:func:`write_all` returns only the paths that exist. Plots go through matplotlib's Agg
backend: no display is needed.
"""

from __future__ import annotations

import json
import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from .measure import PHASES
from .report import HEADLINES, METRICS, PHASE_METRICS, table


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
