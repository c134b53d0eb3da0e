"""Plain data-parallel training's loading, as users run it: torchrun, one process per rank, a
gloo group, a ``DistributedSampler`` and a ``pinpool.DataLoader`` in each rank.

    torchrun --standalone --nproc-per-node 2 tests/frameworks/scripts/ddp_ranks.py OUT_DIR check
    torchrun --standalone --nproc-per-node 2 tests/frameworks/scripts/ddp_ranks.py OUT_DIR die

``check``: for 2 epochs (``set_epoch`` each), every rank's batches from a
``pinpool.DataLoader`` in copy mode and from one in zero-copy mode (2 workers each) must be
bit for bit those of torch's DataLoader with the same sampler settings; the ranks' indices
(gathered with ``all_gather_object``) must cover the dataset each epoch; each rank's loaders
must count exactly the batches that rank yielded, in a pool of that rank's own (its own arena
memfd, copy threads sized for the ranks sharing the host). Asserts run inside the rank, so a
failure shows in torchrun's output; each rank then writes ``OUT_DIR/rank<N>.json``.

``die``: both ranks iterate a copy-mode and a zero-copy loader in step, with no collective
after the start. Rank 0 writes ``OUT_DIR/rank0.json`` after a few batches and keeps
iterating (slowly, until torchrun stops it); rank 1, once rank 0's report is there, writes
``OUT_DIR/rank1.json`` and kills itself with SIGKILL mid-epoch. torchrun then tears the group
down and exits non-zero. Had rank 0 run to its deadline unstopped, it writes
``OUT_DIR/rank0-finished.json``.

``gpu`` (one GPU per rank): rank r calls ``torch.cuda.set_device(r)`` as training scripts do,
then a ``pinpool.DataLoader(device="cuda")`` in copy and in zero-copy mode must deliver
torch's batches (bit for bit, 2 epochs) on ``cuda:r``, from a pool bound to GPU r; a bare
``pinpool.PinPool`` made without ``device=`` binds to GPU r too. Each rank reports its pools'
``notes``.

In every mode every DataLoader worker writes an empty file ``OUT_DIR/workers/<rank>-<pid>``
as it starts, so that the test can check that none of them is left once torchrun has exited.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import math
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

import pinpool

SAMPLES = 45  # 23 per rank: neither a multiple of the ranks nor of ranks * batch size
BATCH = 4
EPOCHS = 2
SEED = 1234
WORKERS = 2
SLOT_BYTES = 1 << 20  # made up front: zero-copy can start with the first batch
KILL_AFTER = 3  # batches per loader rank 1 yields before it dies (of 6 in an epoch)
MODES = {"copy": False, "zero_copy": True}


class Samples(Dataset):  # type: ignore[type-arg]
    """Sample ``i``: 20 KiB of floats drawn from a generator seeded with ``i`` (big enough for
    the workers to stream it), an int tensor made from ``i``, and ``i``."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(64, 80, generator=gen)
        label = torch.tensor([i, i * i, -3 * i, i % 7], dtype=torch.int64)
        return {"x": x, "label": label, "idx": i}


def note_worker(out: str, rank: int, worker_id: int) -> None:
    """``worker_init_fn``: records this worker's pid for the test's leak check."""
    Path(out, "workers", f"{rank}-{os.getpid()}").touch()


def fingerprint(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's sample indices, and each entry's dtype, shape and the SHA-256 of its
    bytes: equal fingerprints are equal batches, bit for bit."""
    out: dict[str, Any] = {"indices": batch["idx"].tolist()}
    for key, t in sorted(batch.items()):
        assert isinstance(t, torch.Tensor), (key, type(t))
        digest = hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
        out[key] = f"{t.dtype} {list(t.shape)} {digest}"
    return out


def in_pool(pool: Any, t: torch.Tensor) -> bool:
    """Whether the tensor's bytes lie in the pool's arena."""
    start = t.untyped_storage().data_ptr()
    return pool is not None and pool.address <= start < pool.address + pool.arena_bytes


def arena_identity(pool: Any) -> list[int]:
    """The device and inode of the memfd behind the pool's first slot: two processes with
    these equal would share one arena."""
    with pool.checkout(timeout=30, nbytes=1) as slot:
        where = pool.slot_memfd(slot)
    assert where is not None, "the pool has no memfd behind its slots"
    st = os.fstat(where[0])
    return [st.st_dev, st.st_ino]


def make_loader(
    out: str, rank: int, sampler: Any, zero_copy: bool, device: str | None = None
) -> pinpool.DataLoader:
    return pinpool.DataLoader(
        Samples(),
        batch_size=BATCH,
        sampler=sampler,
        num_workers=WORKERS,
        zero_copy=zero_copy,
        slot_bytes=SLOT_BYTES,
        device=device,
        worker_init_fn=functools.partial(note_worker, out, rank),
    )


def check(out: str, rank: int, world: int) -> dict[str, Any]:
    """Mode ``check``: see the module's docstring."""
    assert SAMPLES % (world * BATCH) != 0, "the last batch of a rank must be a short one"
    dataset = Samples()
    # Each loader has a sampler of its own with the same settings, as a rebuilt one would.
    ref_sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
    torch_loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=ref_sampler)
    samplers = {m: DistributedSampler(dataset, shuffle=True, seed=SEED) for m in MODES}
    loaders = {m: make_loader(out, rank, samplers[m], zc) for m, zc in MODES.items()}
    per_rank = math.ceil(SAMPLES / world)
    yielded = dict.fromkeys(MODES, 0)
    order: list[list[int]] = []  # this rank's sample indices, each epoch
    for epoch in range(EPOCHS):
        ref_sampler.set_epoch(epoch)
        expect, idx = [], []
        for b in torch_loader:
            expect.append(fingerprint(b))
            idx += b["idx"].tolist()
        assert len(idx) == per_rank, (len(idx), per_rank)
        order.append(idx)
        for mode, loader in loaders.items():
            samplers[mode].set_epoch(epoch)
            got = []
            for batch in loader:
                assert in_pool(loader.pool, batch["x"]), f"{mode}: a batch outside the pool"
                got.append(fingerprint(batch))
                yielded[mode] += 1
            del batch
            for n, (g, e) in enumerate(zip(got, expect, strict=False)):
                assert g == e, f"rank {rank} {mode} epoch {epoch} batch {n}: {g} != {e} (torch's)"
            assert len(got) == len(expect), (mode, epoch, len(got), len(expect))
    assert order[0] != order[1], "set_epoch changed nothing: the check would be vacuous"
    gc.collect()  # the last batches' slots go back to their pools

    modes = {}
    for mode, loader in loaders.items():
        stats = loader.stats()
        pool = loader.pool
        assert pool is not None
        assert stats["batches"] == yielded[mode] == EPOCHS * math.ceil(per_rank / BATCH), (
            mode,
            stats,
            yielded,
        )
        # The pool counts this rank's batches, once each, and has them all back.
        assert stats["checkouts"] == stats["releases"] == yielded[mode], (mode, stats)
        assert stats["slots_checked_out"] == 0, (mode, stats)
        assert stats["copies"] == yielded[mode] - stats["zero_copy_batches"], (mode, stats)
        assert stats["overflow_batches"] == 0, (mode, stats)
        if MODES[mode]:
            assert stats["zero_copy_batches"] > 0, stats
            assert stats["zero_copy_batches"] + stats["zero_copy_fallbacks"] == yielded[mode]
        else:
            assert stats["zero_copy_batches"] == 0, stats
        modes[mode] = {
            "yielded": yielded[mode],
            "stats": stats,
            "pool_stats": pool.stats(),
            "pool": repr(pool),
            "arena": arena_identity(pool),
            "copy_threads": pool.copy_threads,
        }
    # The two loaders of this rank have an arena each, too.
    assert modes["copy"]["arena"] != modes["zero_copy"]["arena"]
    # torchrun's LOCAL_WORLD_SIZE: the ranks on this host share its cores.
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    cores = os.cpu_count() or 1
    for mode, info in modes.items():
        assert info["copy_threads"] * local <= max(local, cores), (mode, info, local, cores)

    mine = {"rank": rank, "pid": os.getpid(), "order": order, "modes": modes}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    assert [r["rank"] for r in everyone] == list(range(world))
    assert len({r["pid"] for r in everyone}) == world, "two ranks in one process"
    for epoch in range(EPOCHS):
        union = {i for r in everyone for i in r["order"][epoch]}
        assert union == set(range(SAMPLES)), f"epoch {epoch}: {sorted(union)}"
    for mode in MODES:
        arenas = [tuple(r["modes"][mode]["arena"]) for r in everyone]
        assert len(set(arenas)) == world, f"{mode}: ranks share an arena: {arenas}"
        for r in everyone:
            info = r["modes"][mode]
            assert info["pool_stats"]["checkouts"] == info["yielded"], (r["rank"], info)
    mine["gathered"] = everyone
    return mine


def gpu(out: str, rank: int, world: int) -> dict[str, Any]:
    """Mode ``gpu``: see the module's docstring."""
    local = int(os.environ["LOCAL_RANK"])
    assert torch.cuda.device_count() >= world, "one GPU per rank"
    torch.cuda.set_device(local)
    bare = pinpool.PinPool(1 << 20, 2)
    assert bare.device == local, f"a bare PinPool on rank {rank} is on GPU {bare.device}"
    dataset = Samples()
    ref_sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
    torch_loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=ref_sampler)
    samplers = {m: DistributedSampler(dataset, shuffle=True, seed=SEED) for m in MODES}
    loaders = {m: make_loader(out, rank, samplers[m], zc, "cuda") for m, zc in MODES.items()}
    for epoch in range(EPOCHS):
        ref_sampler.set_epoch(epoch)
        expect = [fingerprint(b) for b in torch_loader]
        for mode, loader in loaders.items():
            samplers[mode].set_epoch(epoch)
            got = []
            for batch in loader:
                assert batch["x"].device == torch.device("cuda", local), batch["x"].device
                got.append(fingerprint({k: v.cpu() for k, v in batch.items()}))
            assert got == expect, f"rank {rank} {mode} epoch {epoch}: not torch's batches"
    modes = {}
    for mode, loader in loaders.items():
        pool = loader.pool
        assert pool is not None and pool.device == local, (mode, pool)
        stats = loader.stats()
        if MODES[mode]:
            assert stats["zero_copy_batches"] > 0, stats
        modes[mode] = {"pool": repr(pool), "notes": list(pool.notes), "stats": stats}
    return {
        "rank": rank,
        "pid": os.getpid(),
        "device": local,
        "bare_pool": repr(bare),
        "bare_notes": list(bare.notes),
        "modes": modes,
    }


def die(out: str, rank: int, world: int) -> dict[str, Any] | None:
    """Mode ``die``: see the module's docstring. Returns rank 0's report if it was never
    stopped (rank 1 never returns)."""
    dataset = Samples()
    samplers = {m: DistributedSampler(dataset, shuffle=True, seed=SEED) for m in MODES}
    loaders = {m: make_loader(out, rank, samplers[m], zc) for m, zc in MODES.items()}
    # The last collective: both ranks are up and have their loaders.
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    deadline = time.monotonic() + 60
    steps = 0
    epoch = 0
    while time.monotonic() < deadline:
        for sampler in samplers.values():
            sampler.set_epoch(epoch)
        for pair in zip(*loaders.values(), strict=True):
            steps += 1
            assert all(in_pool(loaders[m].pool, b["x"]) for m, b in zip(MODES, pair, strict=True))
            del pair
            report = {"rank": rank, "pid": os.getpid(), "pids": pids, "steps": steps}
            report["stats"] = {m: loader.stats() for m, loader in loaders.items()}
            if rank == 0:
                if steps == KILL_AFTER:
                    write(out, rank, report)
                time.sleep(0.05)  # slow enough to be mid-epoch whenever rank 1 dies
            elif steps == KILL_AFTER:
                # Rank 0 is iterating; this rank dies mid-epoch, its workers busy.
                wait_for = Path(out, "rank0.json")
                while not wait_for.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                write(out, rank, report)
                os.kill(os.getpid(), signal.SIGKILL)
        epoch += 1
    return {"rank": rank, "pid": os.getpid(), "steps": steps, "finished": True}


def write(out: str, rank: int, report: dict[str, Any], name: str = "") -> None:
    path = Path(out, f"rank{rank}{name}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    tmp.replace(path)  # whole, or not there: the other rank polls for it


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    Path(out, "workers").mkdir(exist_ok=True)
    # A collective that waits for a rank that died gives up instead of hanging.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == int(os.environ["WORLD_SIZE"]) == 2, world
    if mode == "check":
        write(out, rank, check(out, rank, world))
        dist.barrier()
    elif mode == "gpu":
        write(out, rank, gpu(out, rank, world))
        dist.barrier()
    elif mode == "die":
        finished = die(out, rank, world)
        assert finished is not None
        write(out, rank, finished, "-finished")
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
