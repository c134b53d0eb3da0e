"""``python -m pinpool.bench --quick`` runs to the end and writes what it promises.

Runs the benchmark as a user would, in a subprocess (on a machine without CUDA it measures
the host-side path only), then checks the JSON's top-level keys and contents (the stall
scenario's phases, time to first batch, time inside next(), the tokens workload, what ran
where, the ceilings and each loader's share of the one that binds), the PNGs, and the table
printed at the end; and the varlen workload's own figures.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

PHASES = ["construction", "first_batch", "epoch1", "epoch2", "del", "gc"]
#: The workers' ceiling, run like a loader (pinpool.bench.ceilings.WORKERS).
WORKERS = "workers (no transfer)"

TOP_LEVEL = {
    "meta",
    "config",
    "baseline",
    "loaders",
    "same_as_baseline",
    "skipped",
    "notes",
    "calibration",
    "h2d_ceiling_gbps",
    "workers_ceiling_gbps",
    "binding_ceiling",
    "interrupted",
    "scenarios",
    "runs",
    "summary",
}


def run_bench(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``python -m pinpool.bench ARGV --out DIR`` in ``tmp_path``, as a user runs it; checks
    it succeeded and returns it with DIR."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "pinpool.bench", *argv, "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc, out


@pytest.mark.slow
def test_quick_run_writes_json_plots_and_table(tmp_path: Path) -> None:
    proc, out = run_bench(tmp_path, "--quick")

    result = json.loads((out / "results.json").read_text())
    assert TOP_LEVEL <= set(result)
    assert result["meta"]["command"].endswith(f"--quick --out {out}")
    assert {"torch", "torch-pinned", "pinpool"} <= set(result["loaders"])
    assert result["baseline"] == "torch-pinned"
    runs = result["runs"]
    assert runs and not [r for r in runs if r.get("error")]
    # Churn: loaders made and dropped in a loop, each timed; what the loop left behind.
    churn = [r for r in runs if r["scenario"] == "churn"]
    assert {r["loader"] for r in churn} == set(result["loaders"])
    for run in churn:
        assert run["steps"] == result["scenarios"]["churn"]["steps"] > 0
        assert run["ms_per_loader"] > 0 and run["thread_growth"] >= 0
        assert run["rss_growth_mib"] >= 0
    runs = [r for r in runs if r["scenario"] != "churn"]
    for run in runs:
        assert run["steps"] == len(run["step_ms"]) == len(run["wait_ms"]) > 0
        assert run["gb_per_s"] > 0 and run["cpu_ms_per_batch"] >= 0
        assert run["probe_samples"] > 0 and run["leaked_workers"] == 0
        # The first batch comes after construction; next() is part of each step.
        assert 0 < run["time_to_first_batch_s"] < 60
        # The epoch's final next() (StopIteration, the workers shut down) is timed alone.
        assert 0 < run["end_of_epoch_ms"] < 60e3
        assert 0 <= run["next_ms_median"] <= run["next_ms_p99"] <= max(run["step_ms"])
        assert run["us_per_batch"] == pytest.approx(run["wall_s"] / run["steps"] * 1e6)

    # The stall scenario: every phase of every loader's life, on its own.
    stall = [r for r in runs if r["scenario"] == "stall"]
    assert {r["loader"] for r in stall} == {*result["loaders"], WORKERS}
    for run in stall:
        phases = run["phases"]
        assert list(phases) == PHASES
        for phase in phases.values():
            assert phase["wall_ms"] >= 0 and phase["probe_samples"] >= 0
            # A phase is never charged more lateness than its own wall time.
            assert 0 <= phase["probe_max_ms"] <= phase["wall_ms"] + 1e-6
            assert 0 <= phase["outside_max_ms"] <= phase["wall_ms"] + 1e-6
        # The outside probe's process slept through the whole life, on the same clock: its
        # wake-ups fall in the longer phases too (each lasts many of its 1 ms sleeps).
        for name in ("first_batch", "epoch1", "epoch2"):
            if phases[name]["wall_ms"] > 50:
                assert phases[name]["outside_samples"] > 0, name
        # Two whole epochs: the first batch plus the rest of epoch 1, then epoch 2.
        epoch = result["scenarios"]["stall"]["warmup"] + run["steps"]
        assert phases["epoch1"]["batches"] + 1 == phases["epoch2"]["batches"] == epoch
        assert phases["epoch2"]["first_batch_ms"] > 0
        ttfb_ms = phases["construction"]["wall_ms"] + phases["first_batch"]["wall_ms"]
        assert run["time_to_first_batch_s"] * 1e3 == pytest.approx(ttfb_ms)

    # The tokens workload: many small batches of 8193 int64 values per row.
    tokens = result["scenarios"]["tokens/throughput"]
    assert tokens["workload"] == "tokens" and tokens["shape"] == [8193]
    token_runs = [r for r in runs if r["scenario"] == "tokens/throughput"]
    assert {r["loader"] for r in token_runs} == {*result["loaders"], WORKERS}
    for run in token_runs:
        assert run["bytes"] == run["steps"] * tokens["batch_size"] * 8193 * 8
        assert run["us_per_batch"] > 0

    for scenario in result["scenarios"]:
        if scenario == "churn":
            continue
        by_loader = result["summary"][scenario]
        assert by_loader["torch-pinned"]["batches_per_s"]["ratio"] == pytest.approx(1.0)
        assert set(by_loader["pinpool"]["batches_per_s"]) >= {"median", "min", "max", "ratio"}
        for name in result["loaders"]:
            for key in (
                "time_to_first_batch_s",
                "end_of_epoch_ms",
                "next_ms_median",
                "next_ms_p99",
            ):
                assert by_loader[name][key]["median"] >= 0
        assert by_loader["pinpool"]["time_to_first_batch_s"]["ratio"] > 0
    for name in result["loaders"]:
        for phase in PHASES:
            assert result["summary"]["stall"][name][f"{phase}_probe_max_ms"]["median"] >= 0

    check_ceilings(result, proc.stdout)
    if result["meta"]["host_only"]:
        assert "compute" not in {s["mode"] for s in result["scenarios"].values()}
        # torch and torch-pinned are the same loader without a GPU: no ratio between them.
        assert result["same_as_baseline"] == ["torch"]
        assert result["summary"]["stall"]["torch"]["gb_per_s"]["ratio"] is None

    # What ran where: enough to tell a wheel's run from a checkout's.
    meta = result["meta"]
    assert meta["pinpool_version"] and meta["pinpool_native"].endswith(".so")
    assert Path(meta["pinpool_native"]).is_file() and len(meta["pinpool_native_sha256"]) == 64
    assert meta["git_commit"] is None or len(meta["git_commit"]) == 40
    assert meta["hostname"] and meta["cpu_count"] > 0 and "device_name" in meta

    pngs = sorted(p.name for p in out.glob("*.png"))
    assert "ratios.png" in pngs and any(p.startswith("steps-") for p in pngs)
    assert "phases-stall.png" in pngs
    assert all((out / p).stat().st_size > 1000 for p in pngs)

    assert "pinpool bench:" in proc.stdout
    for scenario in result["scenarios"]:
        assert f"{scenario}: " in proc.stdout
    assert "GB/s" in proc.stdout and "x1.00" in proc.stdout
    # The legend says what the terms mean and which way is better.
    assert "probe late: how late a thread" in proc.stdout and "Lower is better" in proc.stdout
    assert "time to first batch, ms" in proc.stdout and "next() ms, median" in proc.stdout
    assert "end of epoch, ms" in proc.stdout
    assert "whole life" in proc.stdout and "us per batch" in proc.stdout
    if result["meta"]["host_only"]:
        assert " x-" in proc.stdout
    assert (out / "table.txt").read_text().strip() in proc.stdout


def check_ceilings(result: dict, stdout: str) -> None:
    """Every scenario with a rate has the workers' ceiling, measured in the same run like a
    loader (same batches, same repeats) but not compared as one; the binding ceiling is the
    lower of it and the pinned H2D one; each loader's share of it is its median GB/s over it;
    the table shows all of it."""
    assert WORKERS not in result["loaders"]
    rated = [s for s, info in result["scenarios"].items() if info["mode"] != "churn"]
    assert rated and set(result["workers_ceiling_gbps"]) == set(rated)
    assert set(result["binding_ceiling"]) == set(rated)
    assert not [r for r in result["runs"] if r["scenario"] == "churn" and r["loader"] == WORKERS]
    blocks = stdout.split("\n\n")
    for scenario in rated:
        runs = [r for r in result["runs"] if r["scenario"] == scenario]
        ceiling_runs = [r for r in runs if r["loader"] == WORKERS]
        # As many runs as each loader, over the same batches: the same dataset and collate.
        assert len(ceiling_runs) == result["config"]["repeats"]
        assert {(r["steps"], r["bytes"]) for r in runs} == {(runs[0]["steps"], runs[0]["bytes"])}
        by_loader = result["summary"][scenario]
        workers = result["workers_ceiling_gbps"][scenario]
        # The median of its runs' own rates, as a loader's GB/s is.
        assert workers == statistics.median(r["gb_per_s"] for r in ceiling_runs) > 0
        assert workers == by_loader[WORKERS]["gb_per_s"]["median"]
        assert by_loader[WORKERS]["gb_per_s"]["ratio"] is None  # a ceiling, not a competitor
        h2d = result["h2d_ceiling_gbps"].get(scenario)
        assert (h2d is None) == result["meta"]["host_only"]
        bound = result["binding_ceiling"][scenario]
        assert bound["gb_per_s"] == pytest.approx(min(workers, h2d or workers))
        assert bound["ceiling"] == ("pinned H2D" if h2d and h2d < workers else "workers")
        assert set(bound["share"]) == set(result["loaders"])
        for name, share in bound["share"].items():
            assert share == pytest.approx(by_loader[name]["gb_per_s"]["median"] / bound["gb_per_s"])
            # Ratios against the baseline are still there, as before.
            assert (by_loader[name]["gb_per_s"]["ratio"] is None) == (
                name in result["same_as_baseline"]
            )

        # The table: the ceilings, which one binds, and each loader's share of it, in order.
        block = next(b for b in blocks if b.startswith(f"{scenario}: "))
        line = next(x for x in block.splitlines() if x.startswith("  ceilings (same run): "))
        # (Three figures, as every cell of the table: 11.7, 4.40.)
        shown = re.search(r"workers ([0-9.]+) \[", line)
        assert shown and float(shown.group(1)) == pytest.approx(workers, rel=0.01), line
        # A compute scenario (timed only where there is a GPU) says its steps bound it too.
        tail = f"binding: {bound['ceiling']}"
        if result["scenarios"][scenario]["mode"] == "compute":
            tail += " (the GPU work of each step bounds this loop too: see steps/s)"
        assert line.endswith(tail)
        assert ("pinned H2D" in line) == (h2d is not None)
        assert block.splitlines()[2].split() == result["loaders"]  # the columns: loaders only
        row = next(x for x in block.splitlines() if x.startswith("  share of binding ceiling"))
        shown = [int(p) for p in re.findall(r"(\d+)%", row)]
        assert shown == pytest.approx([100 * bound["share"][n] for n in result["loaders"]], abs=0.5)
        assert WORKERS not in block


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.slow
@pytest.mark.skipif(
    _gpus() < 2,
    reason=f"two ranks need two GPUs (one per rank); this machine has {_gpus()}",
)
def test_two_ranks_each_load_their_shard_and_rank_0_reports_the_totals(tmp_path: Path) -> None:
    # Under torchrun (NCCL, one GPU per rank): both ranks run every loader, each over half
    # the dataset.
    argv = ["--quick", "--ranks", "2", "--workload", "synthetic", "--modes", "throughput"]
    argv += ["--loaders", "torch", "pinpool", "--repeats", "1", "--steps", "20"]
    proc, out = run_bench(tmp_path, *argv)
    result = json.loads((out / "results.json").read_text())
    assert result["meta"]["ranks"] == 2
    runs = [
        r
        for r in result["runs"]
        if r["scenario"] == "synthetic/throughput" and r["loader"] != WORKERS
    ]
    assert sorted((r["loader"], r["rank"]) for r in runs) == [
        ("pinpool", 0),
        ("pinpool", 1),
        ("torch", 0),
        ("torch", 1),
    ]
    assert all(r["steps"] == 20 and not r.get("error") for r in runs)
    # Each rank's own pool took in its own batches only: warm-up plus the timed steps.
    warmup = result["scenarios"]["synthetic/throughput"]["warmup"]
    for r in runs:
        if r["loader"] == "pinpool":
            assert r["loader_stats"]["batches"] == warmup + 20
    totals = result["ranks_summary"]["synthetic/throughput"]
    for loader in ("torch", "pinpool"):
        mine = sorted(r["gb_per_s"] for r in runs if r["loader"] == loader)
        assert totals[loader]["total_gbps_median"] == pytest.approx(sum(mine))
        assert sorted(totals[loader]["per_rank_gbps"]) == pytest.approx(mine)
    assert "2 ranks, each loading its own shard" in proc.stdout


@pytest.mark.slow
def test_workers_started_by_a_forkserver_with_a_shorter_switch_interval(tmp_path: Path) -> None:
    proc, out = run_bench(
        tmp_path,
        "--quick",
        "--workload",
        "tokens",
        "--modes",
        "throughput",
        "--loaders",
        "pinpool",
        "--repeats",
        "1",
        "--start-method",
        "forkserver",
        "--switch-interval",
        "0.002",
    )
    result = json.loads((out / "results.json").read_text())
    assert not [r for r in result["runs"] if r.get("error")]
    assert [r["loader"] for r in result["runs"]] == ["pinpool", WORKERS]
    meta = result["meta"]
    # The run's workers came from the server, started (and timed) before the first run.
    assert meta["start_method"] == "forkserver"
    assert 0 < meta["forkserver_ready_s"] < 120
    assert meta["switch_interval_s"] == pytest.approx(0.002)
    assert result["config"]["start_method"] == "forkserver"
    assert any("forkserver" in n for n in result["notes"])
    assert "GIL switch interval set to 2 ms" in proc.stdout


def test_more_ranks_than_gpus_is_one_line_and_a_failure(tmp_path: Path) -> None:
    from pinpool.bench.ranks import missing_gpus

    assert missing_gpus(2, 2) is None and missing_gpus(1, 8) is None
    why = missing_gpus(2, 1)
    assert why is not None and "\n" not in why
    assert "--ranks 2 needs 2 GPUs" in why and "this machine has 1" in why
    if not _gpus():
        return  # without CUDA the ranks run on the CPU over gloo (the test above)
    # On a GPU machine, one rank more than it has GPUs: refused before torchrun starts.
    ranks = str(_gpus() + 1)
    proc = subprocess.run(
        [sys.executable, "-m", "pinpool.bench", "--quick", "--ranks", ranks],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"--ranks {ranks} needs {ranks} GPUs" in lines[0], proc.stderr


@pytest.mark.slow
def test_varlen_workload_reports_pinned_memory_held_and_pinpool_counters(tmp_path: Path) -> None:
    # Dynamic padding: rows of 16 to 40,000 tokens padded per batch, every loader over the
    # same batches. A few steps only: counts and bytes are compared here, the batches' bits
    # elsewhere.
    argv = ["--quick", "--workloads", "varlen", "--modes", "throughput", "--repeats", "1"]
    argv += ["--varlen-steps", "12", "--varlen-workers", "2", "--warmup", "4"]
    proc, out = run_bench(tmp_path, *argv)
    result = json.loads((out / "results.json").read_text())
    assert list(result["scenarios"]) == ["varlen/throughput"]
    scenario = result["scenarios"]["varlen/throughput"]
    assert scenario["workload"] == "varlen" and scenario["shape"] == [16, 40_000]
    runs = result["runs"]
    assert runs and not [r for r in runs if r.get("error")]
    assert {r["loader"] for r in runs} == {*result["loaders"], WORKERS}
    assert set(result["loaders"]) >= {"torch-pinned", "pinpool"}
    host_only = result["meta"]["host_only"]
    # The workers' ceiling delivered the same batches (see the last check) and is no loader.
    assert result["workers_ceiling_gbps"]["varlen/throughput"] > 0
    for run in [r for r in runs if r["loader"] != WORKERS]:
        assert {"pinned_held_bytes", "pinned_held_mib", "pinned_held"} <= set(run)
        assert {"overflow_batches", "zero_copy_fallbacks", "gb_per_s", "next_ms_p99"} <= set(run)
        assert run["gb_per_s"] > 0 and run["probe_samples"] > 0
        if run["loader"].startswith("pinpool"):
            # The arena is fixed: what it holds at the end is its size.
            assert run["pinned_held_bytes"] >= run["pool"]["arena_bytes"] > 0
            assert run["overflow_batches"] == 0, run["loader_stats"]
            assert run["zero_copy_fallbacks"] >= 0
            assert run["loader_stats"]["batches"] == scenario["warmup"] + 12
        else:
            assert run["overflow_batches"] is None and run["zero_copy_fallbacks"] is None
            if host_only:
                assert run["pinned_held_bytes"] is None and run["pinned_held"] == "n/a (no CUDA)"
            else:
                assert run["pinned_held_bytes"] >= 0
    # Every loader delivered the same batches: as many, and as many bytes.
    assert {(r["steps"], r["bytes"]) for r in runs} == {(12, runs[0]["bytes"])}
    by_loader = result["summary"]["varlen/throughput"]
    assert by_loader["torch-pinned"]["gb_per_s"]["ratio"] == pytest.approx(1.0)
    assert by_loader["pinpool"]["gb_per_s"]["ratio"] > 0
    assert by_loader["pinpool"]["overflow_batches"]["median"] == 0
    assert "pinned_held_mib" in by_loader["pinpool"]

    # The table: the batches' range, and the new rows, with n/a where there is no CUDA.
    assert "varlen/throughput: varlen, batch 16 rows of 16..40000 int64 tokens" in proc.stdout
    for label in ("pinned MiB held at the end", "overflow batches", "zero-copy fallbacks"):
        assert label in proc.stdout
    if host_only:
        assert "n/a (no CUDA)" in proc.stdout
    check_ceilings(result, proc.stdout)


def test_the_outside_probe_stops_while_a_forked_child_lives() -> None:
    """The outside probe's process stops on a line sent to it, not on its stdin's end: a
    DataLoader worker forked meanwhile holds a copy of that pipe's write end, and one still
    alive (a loader that failed, its iterator not yet collected) kept the bench waiting out
    the probe's 60 s."""
    import os
    import signal

    from pinpool.bench.probes import OutsideProbe

    probe = OutsideProbe().start()
    child = os.fork()
    if child == 0:  # holds every descriptor it inherited, the probe's stdin included
        signal.pause()
        os._exit(0)
    try:
        probe.stop()
        assert probe.lateness, "the sleeper's record came back"
        assert os.waitpid(child, os.WNOHANG) == (0, 0), "the child was alive meanwhile"
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_the_benchs_own_probes_say_nothing_of_pinpools() -> None:
    """``make demo``'s first lines are the bench's: its probe of each loader (made without
    workers) gives none of pinpool's warnings about settings that need workers."""
    import warnings

    from pinpool.bench.loaders import LOADERS, check

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for spec in LOADERS:
            check(spec, None)
    said = [str(w.message) for w in caught if str(w.message).startswith("pinpool")]
    assert not said, said


def test_the_lower_ceiling_binds_and_each_loader_is_shown_as_a_share_of_it() -> None:
    """Without a GPU run: the binding ceiling and the shares, from made-up figures where the
    pinned H2D ceiling binds in one scenario and the workers' in the other, and the table's
    lines for them."""
    from pinpool.bench.ceilings import binding, workers_ceilings
    from pinpool.bench.report import table

    def rate(median: float, ratio: float | None = 1.0) -> dict:
        return {"gb_per_s": {"median": median, "min": median, "max": median, "ratio": ratio}}

    summary = {
        "a/throughput": {"torch": rate(2.0), "pinpool": rate(9.0), WORKERS: rate(30.0, None)},
        "b/throughput": {"torch": rate(2.0), "pinpool": rate(3.0), WORKERS: rate(4.0, None)},
    }
    workers = workers_ceilings(summary)
    assert workers == {"a/throughput": 30.0, "b/throughput": 4.0}
    h2d = {"a/throughput": 12.0, "b/throughput": 50.0}
    bound = binding(summary, ["torch", "pinpool"], workers, h2d)
    assert bound["a/throughput"] == {
        "ceiling": "pinned H2D",
        "gb_per_s": 12.0,
        "share": {"torch": 2.0 / 12.0, "pinpool": 9.0 / 12.0},
    }
    assert bound["b/throughput"]["ceiling"] == "workers"
    assert bound["b/throughput"]["share"] == {"torch": 0.5, "pinpool": 0.75}
    # Without a GPU: the workers' ceiling alone.
    assert binding(summary, ["pinpool"], workers, {})["a/throughput"]["share"] == {"pinpool": 0.3}

    scenario = {"workload": "synthetic", "mode": "throughput", "description": "d"}
    text = table(
        {
            "meta": {"path": "p", "machine": "m"},
            "baseline": "torch",
            "loaders": ["torch", "pinpool"],
            "skipped": {},
            "notes": [],
            "runs": [],
            "scenarios": {"a/throughput": scenario, "b/throughput": scenario},
            "summary": summary,
            "h2d_ceiling_gbps": h2d,
            "binding_ceiling": bound,
        }
    )
    lines = text.splitlines()
    assert [line for line in lines if line.startswith("  ceilings (same run): ")] == [
        "  ceilings (same run): workers 30.0 [30.0..30.0] GB/s; pinned H2D 12.0 GB/s; "
        "binding: pinned H2D",
        "  ceilings (same run): workers 4.00 [4.00..4.00] GB/s; pinned H2D 50.0 GB/s; "
        "binding: workers",
    ]
    shares = [line.split()[4:] for line in lines if line.startswith("  share of binding")]
    assert shares == [["17%", "75%"], ["50%", "75%"]]


def test_the_workers_ceiling_makes_torchs_batch_into_memory_it_keeps() -> None:
    # The workers' ceiling makes each batch as torch's default collation would (the same
    # bytes), into memory kept from one batch to the next, none of which is pickled to a worker.
    import pickle

    import torch

    from pinpool.bench.workloads import MadeAndDropped, MadeBatch

    samples = [(torch.full((3, 8, 8), i, dtype=torch.uint8), i) for i in range(4)]
    made = MadeAndDropped(None)
    want = sum(t.nbytes for t in torch.utils.data.default_collate(samples))
    assert made(samples) == MadeBatch(want)
    kept = dict(made._kept)
    assert len(kept) == 1 and made(samples) == MadeBatch(want)
    assert [t.data_ptr() for t in made._kept.values()] == [t.data_ptr() for t in kept.values()]
    (stack,) = kept.values()
    assert torch.equal(stack, torch.stack([s[0] for s in samples]))
    assert pickle.loads(pickle.dumps(made))._kept == {}
    own = MadeAndDropped(lambda s: {"x": torch.zeros(5, dtype=torch.int64)})
    assert own(samples) == MadeBatch(40) and own._kept == {}
