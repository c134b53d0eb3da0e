"""``python -m pinpool.bench --quick`` runs to the end and writes what it promises.

Runs the benchmark as a user would, in a subprocess (on a machine without CUDA it measures
the host-side path only), then checks the JSON's top-level keys and contents, the PNGs, and
the table printed at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOP_LEVEL = {
    "meta",
    "config",
    "baseline",
    "loaders",
    "skipped",
    "notes",
    "calibration",
    "interrupted",
    "scenarios",
    "runs",
    "summary",
}


@pytest.mark.slow
def test_quick_run_writes_json_plots_and_table(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "pinpool.bench", "--quick", "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"

    result = json.loads((out / "results.json").read_text())
    assert TOP_LEVEL <= set(result)
    assert result["meta"]["command"].endswith(f"--quick --out {out}")
    assert {"torch", "torch-pinned", "pinpool"} <= set(result["loaders"])
    assert result["baseline"] == "torch-pinned"
    runs = result["runs"]
    assert runs and not [r for r in runs if r.get("error")]
    for run in runs:
        assert run["steps"] == len(run["step_ms"]) > 0
        assert run["gb_per_s"] > 0 and run["cpu_ms_per_batch"] >= 0
        assert run["probe_samples"] > 0 and run["leaked_workers"] == 0
    for scenario in result["scenarios"]:
        by_loader = result["summary"][scenario]
        assert by_loader["torch-pinned"]["batches_per_s"]["ratio"] == pytest.approx(1.0)
        assert set(by_loader["pinpool"]["batches_per_s"]) >= {"median", "min", "max", "ratio"}
    if result["meta"]["host_only"]:
        assert "compute" not in {s["mode"] for s in result["scenarios"].values()}

    pngs = sorted(p.name for p in out.glob("*.png"))
    assert "ratios.png" in pngs and any(p.startswith("steps-") for p in pngs)
    assert all((out / p).stat().st_size > 1000 for p in pngs)

    assert "pinpool bench:" in proc.stdout
    for scenario in result["scenarios"]:
        assert f"{scenario}: " in proc.stdout
    assert "GB/s" in proc.stdout and "x1.00" in proc.stdout
    assert (out / "table.txt").read_text().strip() in proc.stdout
