"""How many zero-copy batches go through copy mode once the arena is ready, by batch size and
workers: the arena's sizing at work (a batch that gets no grant goes through its worker's
segment, copied by the main process).

The loader's persistent workers make one epoch while the arena is made ready (in the
background on a machine without CUDA: waited for here), then ``--epochs`` more are counted.
Prints one line per case. Runs on the CPU; on a CUDA machine pass ``--device cuda``.

    python benchmarks/zero_copy_fallbacks.py --cases 67.1x2 38.5x8 100x2
"""

from __future__ import annotations

import argparse
import time

import pinpool
from pinpool.bench.workloads import make_dataset


def one(batch_mb: float, workers: int, epochs: int, device: str | None) -> str:
    side = int((batch_mb * 1e6 / 8 / 3) ** 0.5)
    loader = pinpool.DataLoader(
        make_dataset("synthetic", 8 * 48, (3, side, side), "/tmp"),
        batch_size=8,
        num_workers=workers,
        prefetch_factor=2,
        zero_copy=True,
        persistent_workers=True,
        device=device,
    )
    it = iter(loader)
    next(it)
    pool = loader.pool
    assert pool is not None
    while pool.stats()["bytes_preparing"]:
        time.sleep(0.05)
    for _ in it:
        pass
    before = loader.stats()
    for _ in range(epochs):
        for _ in loader:
            pass
    after = loader.stats()
    zc = after["zero_copy_batches"] - before["zero_copy_batches"]
    fell = after["zero_copy_fallbacks"] - before["zero_copy_fallbacks"]
    return (
        f"{8 * 3 * side * side / 1e6:6.1f} MB x {workers:2d} workers: arena "
        f"{pool.arena_bytes >> 20} MiB, longest part {pool.largest_slot >> 20} MiB; "
        f"{epochs} epochs: zero-copy {zc}, through copy mode {fell}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["67.1x2", "38.5x8", "100x2"])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    for case in args.cases:
        mb, workers = case.split("x")
        print(one(float(mb), int(workers), args.epochs, args.device), flush=True)


if __name__ == "__main__":
    main()
