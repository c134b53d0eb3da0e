"""The command line of ``python -m pinpool.bench`` and the settings a run resolves to.

Every size is an argument. Arguments left out take a preset chosen for the machine: ``gpu``
when torch sees CUDA, a small ``cpu`` preset otherwise (so ``make demo`` finishes on a 2-core
box), and a tiny ``quick`` preset with ``--quick``. Explicit arguments always win.

The ``tokens`` workload has its own batch size, workers and steps (``--token-*``, presets in
:data:`TOKEN_PRESETS`): its batches are small, so it needs many more steps than the images.
So has the ``varlen`` workload (``--varlen-*``, presets in :data:`VARLEN_PRESETS`), which runs
only when asked for (``--workloads varlen``).
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from .loaders import LOADERS
from .workloads import VARLEN_LENGTHS, WORKLOADS

MODES = ("throughput", "compute", "stall", "churn")
#: The churn scenario: loaders made, run for one epoch over a tiny dataset and dropped, one
#: after the other, this many (what an evaluation loader per epoch, a sweep or a test suite
#: does); CHURN_ITEMS items of batch CHURN_BATCH each.
CHURN_LOADERS = 100
CHURN_ITEMS = 24
CHURN_BATCH = 4


def cpu_count() -> int:
    """CPUs this process may run on (the affinity mask, not the whole machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _preset(*values: Any) -> dict[str, Any]:
    keys = ("batch_size", "shape", "workers", "steps", "warmup", "repeats", "big_batch_mib")
    return dict(zip(keys, values, strict=True))


PRESETS: dict[str, dict[str, Any]] = {
    # batch size, image shape, workers, steps, warm-up (at least), repeats, big batch MiB
    "gpu": _preset(256, (3, 224, 224), min(8, cpu_count()), 150, 10, 3, 256),
    "cpu": _preset(64, (3, 128, 128), 2, 400, 5, 3, 64),
    "quick": _preset(32, (3, 64, 64), 2, 60, 3, 2, 16),
}

#: The tokens workload per preset: batch size, workers, steps. Rows are TOKEN_ROW int64 values,
#: so a batch of 8 is 8 x 8193 x 8 bytes = 512 KiB. On a GPU, 10000 steps: a pinpool run of
#: 2000 took 0.3 to 0.6 s on the H200, and its GB/s moved by a tenth from run to run.
TOKEN_PRESETS: dict[str, dict[str, int]] = {
    "gpu": {"token_batch_size": 8, "token_workers": 4, "token_steps": 10000},
    "cpu": {"token_batch_size": 8, "token_workers": 4, "token_steps": 500},
    "quick": {"token_batch_size": 8, "token_workers": 2, "token_steps": 100},
}

#: The varlen workload per preset: rows per batch, workers, steps. Rows are 16 to 40,000 int64
#: tokens (a long tail), padded per batch with an int64 mask: over the gpu preset's 2032 batches
#: one of 16 rows is 15 KB to 10.2 MB, 0.36 MB median, 1.6 MB on average (workloads.VARLEN_ALPHA).
VARLEN_PRESETS: dict[str, dict[str, int]] = {
    "gpu": {"varlen_batch_size": 16, "varlen_workers": min(8, cpu_count()), "varlen_steps": 2000},
    "cpu": {"varlen_batch_size": 16, "varlen_workers": 2, "varlen_steps": 300},
    "quick": {"varlen_batch_size": 16, "varlen_workers": 2, "varlen_steps": 60},
}

#: Items per batch in the stall scenario; each item is big_batch_mib / STALL_ITEMS.
STALL_ITEMS = 8
#: Workloads run when --workload is not given.
DEFAULT_WORKLOADS = ["synthetic", "tokens"]


@dataclass
class Config:
    """Everything a benchmark run needs, resolved from arguments and presets."""

    preset: str
    device: str | None  # a CUDA device, or None: host-side path only
    workloads: list[str]
    modes: list[str]
    loaders: list[str]
    batch_size: int
    shape: tuple[int, ...]
    workers: int
    steps: int
    warmup: int
    stall_warmup: int
    prefetch_factor: int
    compute_ms: float
    repeats: int
    big_batch_mib: int
    stall_shape: tuple[int, ...]
    stall_steps: int
    stall_workers: int
    token_batch_size: int
    token_workers: int
    token_steps: int
    token_warmup: int
    varlen_batch_size: int
    varlen_workers: int
    varlen_steps: int
    varlen_warmup: int
    varlen_lengths: str
    data_dir: str
    out: str
    ranks: int  # data-parallel ranks (1: a plain run)
    start_method: str | None  # how workers start (None: multiprocessing's default)
    switch_interval: float | None  # sys.setswitchinterval for the run (None: Python's)


def _names(values: list[str] | None, allowed: tuple[str, ...], what: str) -> list[str] | None:
    """Accepts ``--x a b`` and ``--x a,b``; checks every name."""
    if values is None:
        return None
    names = [n for v in values for n in v.split(",") if n]
    for n in names:
        if n not in allowed:
            raise SystemExit(f"unknown {what} {n!r}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(names))


def parser() -> argparse.ArgumentParser:
    loader_names = tuple(s.name for s in LOADERS)
    p = argparse.ArgumentParser(
        prog="python -m pinpool.bench",
        description="How much faster does a training loop get with pinpool, and does the GPU "
        "stop idling? Compares torch's DataLoader (plain and pinned) with pinpool's.",
    )
    add = p.add_argument
    add(
        "--workload",
        "--workloads",
        nargs="+",
        help=f"one or more of {', '.join(WORKLOADS)} ({' '.join(DEFAULT_WORKLOADS)}); tokens "
        "and varlen run in throughput mode only. varlen: token rows of 16 to 40,000 tokens "
        "(a seeded long tail) padded per batch to its longest row, so batch sizes vary by "
        "100x and more; it also reports the pinned host memory each loader holds at the end "
        "and pinpool's overflow batches and zero-copy fallbacks",
    )
    add("--modes", nargs="+", help=f"measurements to run: {', '.join(MODES)} (all)")
    add(
        "--loaders",
        nargs="+",
        help=f"loaders to compare: {', '.join(loader_names)} (all but the -unstreamed ones)",
    )

    def preset(key: str) -> str:
        values = [PRESETS[p][key] for p in ("gpu", "cpu", "quick")]
        if key == "shape":
            values = [",".join(map(str, v)) for v in values]
        return f"(gpu / cpu / --quick preset: {' / '.join(map(str, values))})"

    def token_preset(key: str) -> str:
        values = [TOKEN_PRESETS[p][key] for p in ("gpu", "cpu", "quick")]
        return f"(gpu / cpu / --quick preset: {' / '.join(map(str, values))})"

    def varlen_preset(key: str) -> str:
        values = [VARLEN_PRESETS[p][key] for p in ("gpu", "cpu", "quick")]
        return f"(gpu / cpu / --quick preset: {' / '.join(map(str, values))})"

    add("--batch-size", type=int, help=f"items per batch {preset('batch_size')}")
    add("--shape", help=f"image shape {preset('shape')}")
    add("--workers", type=int, help=f"DataLoader workers, image workloads {preset('workers')}")
    add(
        "--steps",
        type=int,
        help=f"batches per measured run, image workloads {preset('steps')}; the stall "
        "scenario times a tenth of it (at least 4) in each of its two epochs",
    )
    add(
        "--warmup",
        type=int,
        help=f"batches before each timed window, the first included (at least 1); default: the "
        f"preset's {preset('warmup')} or workers x (prefetch + 2) if more, so every buffer a "
        "loader cycles through is used",
    )
    add(
        "--token-batch-size",
        type=int,
        help=f"rows per batch, tokens workload {token_preset('token_batch_size')}",
    )
    add(
        "--token-workers",
        type=int,
        help=f"DataLoader workers, tokens workload {token_preset('token_workers')}",
    )
    add("--token-steps", type=int, help=f"batches per run, tokens {token_preset('token_steps')}")
    add(
        "--varlen-batch-size",
        type=int,
        help=f"rows per batch, varlen workload {varlen_preset('varlen_batch_size')}",
    )
    add(
        "--varlen-workers",
        type=int,
        help=f"DataLoader workers, varlen workload {varlen_preset('varlen_workers')}",
    )
    add("--varlen-steps", type=int, help=f"batches per run, varlen {varlen_preset('varlen_steps')}")
    add(
        "--varlen-lengths",
        choices=VARLEN_LENGTHS,
        default="pareto",
        help="row lengths, varlen workload: a long Pareto tail (pareto, the default), "
        "lognormal (padded batches of 16 rows: about 1.2 to 8 MB), or that lognormal draw "
        "shortest first (ascending: a length curriculum)",
    )
    add("--prefetch-factor", type=int, default=2, help="batches in flight per worker (2)")
    add("--compute-ms", type=float, default=30.0, help="GPU work per step, compute loop (30)")
    add("--repeats", type=int, help=f"runs of each loader, alternating {preset('repeats')}")
    add("--big-batch-mib", type=int, help=f"stall scenario batch in MiB {preset('big_batch_mib')}")
    add("--device", default="cuda", help="CUDA device to copy to (cuda)")
    add(
        "--ranks",
        type=int,
        default=1,
        help="data-parallel ranks, one GPU each, every rank loading its shard: starts the run "
        "under torchrun (the same as torchrun --nproc-per-node N -m pinpool.bench) (1)",
    )
    add(
        "--start-method",
        choices=("fork", "forkserver", "spawn"),
        help="how every loader's workers start (multiprocessing's default, fork on Linux "
        "before Python 3.14): with forkserver, workers are forked by a server process, not "
        "by the training process, which only sends it the worker's arguments; the server is "
        "started, and made ready, before the first run",
    )
    add(
        "--switch-interval",
        type=float,
        help="seconds a thread may hold the GIL while another waits for it before it is made "
        "to give it up (sys.setswitchinterval; Python's default: 0.005)",
    )
    add("--data-dir", help="where the memmap file is made (a dir under the temp dir)")
    add(
        "--out",
        help="output dir (default: pinpool-bench-results/<date>-<host>/ under the temp dir, "
        f"{tempfile.gettempdir()})",
    )
    add("--quick", action="store_true", help="a short run with small shapes (CI, tests)")
    return p


def resolve(argv: list[str] | None, cuda: bool) -> Config:
    """Parses ``argv`` and fills what it leaves out from the preset for this machine."""
    args = parser().parse_args(argv)
    preset = "quick" if args.quick else ("gpu" if cuda else "cpu")
    base = PRESETS[preset]

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return base[name] if value is None else value

    def pick_token(name: str) -> int:
        value = getattr(args, name)
        return int(TOKEN_PRESETS[preset][name] if value is None else value)

    def pick_varlen(name: str) -> int:
        value = getattr(args, name)
        return int(VARLEN_PRESETS[preset][name] if value is None else value)

    shape = tuple(int(d) for d in args.shape.split(",")) if args.shape else base["shape"]
    workers = pick("workers")
    stall_workers = min(2, workers)
    cycle = args.prefetch_factor + 2  # buffers a worker cycles through, give or take
    # At least one warm-up batch: the first one, timed as time to first batch.
    asked = None if args.warmup is None else max(1, args.warmup)
    warmup = asked or max(base["warmup"], workers * cycle)
    stall_warmup = asked or max(3, stall_workers * cycle)
    token_workers = pick_token("token_workers")
    token_warmup = asked or max(base["warmup"], token_workers * cycle)
    varlen_workers = pick_varlen("varlen_workers")
    varlen_warmup = asked or max(base["warmup"], varlen_workers * cycle)
    steps = pick("steps")
    big = pick("big_batch_mib")
    # Stall scenario: STALL_ITEMS images of shape (3, s, s) adding up to about big MiB.
    side = max(1, round(math.sqrt((big << 20) / STALL_ITEMS / 3)))
    host = socket.gethostname().split(".")[0] or "run"
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in host)
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    # Outside any source tree unless asked: recorded runs are not part of the code.
    default_out = os.path.join(tempfile.gettempdir(), "pinpool-bench-results", f"{stamp}-{host}")
    out = args.out or default_out
    return Config(
        preset=preset,
        device=args.device if cuda else None,
        workloads=_names(args.workload, WORKLOADS, "workload") or list(DEFAULT_WORKLOADS),
        modes=_names(args.modes, MODES, "mode") or list(MODES),
        loaders=_names(args.loaders, tuple(s.name for s in LOADERS), "loader")
        or [s.name for s in LOADERS if s.in_default],
        batch_size=pick("batch_size"),
        shape=shape,
        workers=workers,
        steps=steps,
        warmup=warmup,
        stall_warmup=stall_warmup,
        prefetch_factor=args.prefetch_factor,
        compute_ms=args.compute_ms,
        repeats=pick("repeats"),
        big_batch_mib=big,
        stall_shape=(3, side, side),
        stall_steps=max(4, steps // 10),
        stall_workers=stall_workers,
        token_batch_size=pick_token("token_batch_size"),
        token_workers=token_workers,
        token_steps=pick_token("token_steps"),
        token_warmup=token_warmup,
        varlen_batch_size=pick_varlen("varlen_batch_size"),
        varlen_workers=varlen_workers,
        varlen_steps=pick_varlen("varlen_steps"),
        varlen_warmup=varlen_warmup,
        varlen_lengths=args.varlen_lengths,
        data_dir=args.data_dir or os.path.join(tempfile.gettempdir(), "pinpool-bench"),
        out=out,
        ranks=max(1, args.ranks),
        start_method=args.start_method,
        switch_interval=args.switch_interval,
    )
