"""What a zero-copy reservation costs the consumer's thread, step by step, with no workers
running: the loader's own reservation table and pool (512 KiB slots, 128 of them, the tokens
workload's size; on the loader's device when there is one, released fenced on torch's current
stream as a device batch's slot is), in a loop.

    python3 benchmarks/reservation_cost.py [--rounds 20000]

Prints the mean microseconds of each step, best of 5 runs: two system calls the path could
make (``os.getpid``, ``os.fstat``), the pool's ``slot_location``, a checkout preferring a
worker's recent slots and its release, and a whole reservation with its adoption and release
(``Reservations.reserve``, ``adopt``, ``Slot.release``). A round that finds every slot
fenced waits for the device instead (counted).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

import pinpool

SLOT = 512 << 10


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20000)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    loader = pinpool.DataLoader(
        torch.zeros(4, 2),
        batch_size=2,
        num_workers=2,
        zero_copy=True,
        slot_bytes=SLOT,
        num_slots=128,
        device="cuda" if cuda else None,
    )
    pool = loader.pool
    assert pool is not None
    deadline = time.monotonic() + 30
    while pool.stats()["slots_preparing"] and time.monotonic() < deadline:
        time.sleep(0.01)
    reservations = loader._pin_receiver.reservations
    stream = torch.cuda.current_stream() if cuda else None
    fd = pool.memfd_parts()[0][0]
    probe = pool.try_checkout(SLOT)
    assert probe is not None
    recent = [pool.try_checkout(SLOT) for _ in range(16)]
    prefer = [s.offset for s in recent if s is not None]
    for s in recent:
        if s is not None:
            s.release(stream)
    del recent
    counter = iter(range(1 << 62))
    drained = [0]

    def drain() -> None:
        # A loop this tight releases slots fenced faster than the fence thread retires them:
        # where none is left, wait for the device and retire (counted, printed).
        drained[0] += 1
        if cuda:
            torch.cuda.synchronize()
        pool.flush()

    def checkout() -> None:
        slot = pool.try_checkout(SLOT, reserve=1, prefer=prefer)
        if slot is None:
            drain()
            return
        slot.release(stream)

    def reserve() -> None:
        r = reservations.reserve(pool, 1, SLOT, 1, worker=next(counter) % 4)
        if r is None:
            drain()
            return
        reservations.adopt(r.claim).release(stream)

    steps: dict[str, Callable[[], object]] = {
        "os.getpid()": os.getpid,
        "os.fstat(arena memfd)": lambda: os.fstat(fd),
        "pool.slot_location(slot)": lambda: pool.slot_location(probe),
        "try_checkout(prefer=16) + release": checkout,
        "reserve + adopt + release": reserve,
    }
    print(f"device {'cuda' if cuda else 'cpu'}, {args.rounds} rounds a run, best of 5")
    for name, step in steps.items():
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(args.rounds):
                step()
            best = min(best, (time.perf_counter() - t0) / args.rounds * 1e6)
            if cuda:
                torch.cuda.synchronize()
        print(f"  {name:36} {best:8.2f} us  (waits for fenced slots: {drained[0]})")
        drained[0] = 0
    probe.release(stream)
    del loader


if __name__ == "__main__":
    main()
