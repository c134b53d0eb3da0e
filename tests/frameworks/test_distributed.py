"""pinpool.DataLoader in plain data-parallel training: two CPU ranks (gloo) under torchrun,
launched the way users launch them (``python -m torch.distributed.run --standalone``).

The ranks run ``tests/frameworks/scripts/ddp_ranks.py`` (its docstring says what each rank
checks); this file launches it twice, once per mode, and checks from outside what only the
outside can see: what torchrun's exit leaves behind. Every process of a launch (torchrun, the
ranks, their DataLoader workers) carries a marker in its environment, and every worker records
its pid, so that a process left over is found whatever its command line says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "scripts" / "ddp_ranks.py"
MARKER = "PINPOOL_DDP_TEST_RUN"


def shm_entries() -> set[str]:
    """The names in ``/dev/shm`` right now (empty if it does not exist)."""
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def launched(tag: str, pids: set[int]) -> dict[int, str]:
    """The live processes of the launch tagged ``tag``: those with the tag in their
    environment or the script in their command line, and the recorded worker ``pids``
    (zombies, which hold nothing, are not counted). Maps pid to command line."""
    found = {}
    needle = f"{MARKER}={tag}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                continue
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours
            continue
        line = cmdline(pid)
        if pid in pids or needle in environ.split(b"\0") or str(SCRIPT) in line:
            found[pid] = line
    return found


def left_over(
    tag: str, out: Path, shm_before: set[str], wait: float
) -> tuple[dict[int, str], set[str]]:
    """Polls for up to ``wait`` seconds until no process of the launch is alive and no
    ``/dev/shm`` entry made since ``shm_before`` is there; returns what is left then."""
    deadline = time.monotonic() + wait
    while True:
        workers = {int(p.name.split("-")[1]) for p in (out / "workers").glob("*-*")}
        procs = launched(tag, workers)
        shm = shm_entries() - shm_before
        if (not procs and not shm) or time.monotonic() > deadline:
            return procs, shm
        time.sleep(0.2)


def torchrun(out: Path, mode: str) -> tuple[int, str, str]:
    """Runs the script's ``mode`` on two ranks; returns torchrun's exit code, the tail of its
    output and the launch's tag. The output goes to a file, not a pipe: this returns when
    torchrun exits, not when the last process holding a pipe's end does."""
    tag = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), *sys.path]))
    env[MARKER] = tag
    # The ranks check the copy threads pinpool picks by itself for ranks sharing a host.
    env.pop("PINPOOL_COPY_THREADS", None)
    env.pop("PINPOOL_WORKER_COPY_THREADS", None)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    log = out / "torchrun.log"
    with log.open("w") as f:
        done = subprocess.run(
            [*argv, str(SCRIPT), str(out), mode],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=240,
        )
    return done.returncode, log.read_text()[-8000:], tag


def reports(out: Path) -> dict[str, Any]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}


@pytest.mark.slow
def test_two_ranks_get_torchs_batches_each_in_a_pool_of_its_own(tmp_path: Path) -> None:
    """Copy and zero-copy mode, 2 epochs: each rank's batches are torch's with the same
    ``DistributedSampler`` (checked inside the ranks), the ranks together cover the dataset,
    each rank's pool is its own and counts only that rank's batches; once torchrun has
    exited, no process of it and nothing new in ``/dev/shm`` is left."""
    shm_before = shm_entries()
    code, output, tag = torchrun(tmp_path, "check")
    assert code == 0, output
    got = reports(tmp_path)
    assert sorted(got) == ["rank0", "rank1"], sorted(got)
    ranks = [got["rank0"], got["rank1"]]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["pid"] != ranks[1]["pid"]
    for epoch in range(2):
        union = set(ranks[0]["order"][epoch]) | set(ranks[1]["order"][epoch])
        assert union == set(range(45)), f"epoch {epoch}: samples left out"
        assert len(ranks[0]["order"][epoch]) == len(ranks[1]["order"][epoch]) == 23
    for mode in ("copy", "zero_copy"):
        for r in ranks:
            info = r["modes"][mode]
            assert info["yielded"] == 12, (mode, info)
            assert info["stats"]["batches"] == info["yielded"], (mode, info["stats"])
            assert info["pool_stats"]["checkouts"] == info["yielded"], (mode, info)
            # What each rank gathered (all_gather_object) is what each rank reported.
            assert r["gathered"] == [{k: v for k, v in x.items() if k != "gathered"} for x in ranks]
        zero_copy = [r["modes"][mode]["stats"]["zero_copy_batches"] for r in ranks]
        if mode == "zero_copy":
            assert min(zero_copy) > 0, f"a rank made no batch in zero-copy mode: {zero_copy}"
        else:
            assert zero_copy == [0, 0], f"zero-copy batches in copy mode: {zero_copy}"
        arenas = [tuple(r["modes"][mode]["arena"]) for r in ranks]
        assert arenas[0] != arenas[1], f"{mode}: the ranks share an arena"
    workers = list((tmp_path / "workers").iterdir())
    assert len(workers) == 2 * 2 * 2 * 2, "2 workers, 2 loaders, 2 epochs, 2 ranks"
    procs, shm = left_over(tag, tmp_path, shm_before, wait=10)
    assert not procs, f"processes of the launch still alive: {procs}"
    assert not shm, f"left in /dev/shm: {sorted(shm)}"


@pytest.mark.slow
def test_a_rank_killed_mid_epoch_leaves_nothing_behind(tmp_path: Path) -> None:
    """Rank 1 SIGKILLs itself mid-epoch, its workers busy, while rank 0 iterates: torchrun
    fails, tears rank 0 down, and neither rank's workers nor anything in ``/dev/shm`` is left
    (the workers of a rank that died notice within a few seconds)."""
    shm_before = shm_entries()
    code, output, tag = torchrun(tmp_path, "die")
    assert code != 0, output
    got = reports(tmp_path)
    # Rank 1 died where it meant to (not of an error before), and rank 0 was stopped.
    assert sorted(got) == ["rank0", "rank1"], (sorted(got), output)
    assert got["rank1"]["steps"] == 3 and got["rank0"]["steps"] == 3, got
    assert "SIGKILL" in output and str(got["rank1"]["pid"]) in output, output
    for r in got.values():
        assert r["pids"] == [got["rank0"]["pid"], got["rank1"]["pid"]]
        # (At least the 3 yielded: with an accelerator, torch's pin thread takes batches ahead.)
        assert min(r["stats"]["zero_copy"]["batches"], r["stats"]["copy"]["batches"]) >= 3
    assert {int(p.name.split("-")[0]) for p in (tmp_path / "workers").iterdir()} == {0, 1}
    procs, shm = left_over(tag, tmp_path, shm_before, wait=30)
    assert not procs, f"processes of the launch still alive: {procs}"
    assert not shm, f"left in /dev/shm: {sorted(shm)}"


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpu_ranks_each_bind_their_own_gpu(tmp_path: Path) -> None:
    """torchrun with one GPU per rank: every rank's loaders deliver torch's batches on its own
    GPU, from pools bound to it, and a bare ``PinPool`` binds to the rank's GPU too."""
    shm_before = shm_entries()
    code, output, tag = torchrun(tmp_path, "gpu")
    assert code == 0, output
    got = reports(tmp_path)
    # (Each rank checked its pools' device and its batches' itself.)
    assert [got[f"rank{r}"]["device"] for r in range(2)] == [0, 1]
    print(json.dumps(got, indent=1))  # the pools' notes
    procs, shm = left_over(tag, tmp_path, shm_before, wait=10)
    assert not procs and not shm, (procs, shm)
