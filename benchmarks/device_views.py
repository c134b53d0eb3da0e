"""What a device batch's leaves cost the consumer's thread: one device allocation and its
views, made as ``Delivery.send_in_turn`` makes them, with one view per leaf (``as_strided``,
then ``view`` to the dtype and shape: ``leaves.device_leaf``) against the batch's device
layout (``leaves.DeviceLayout``: the allocation in the leaves' dtype, viewed in one native
call; a one-tensor batch is the allocation itself). No copy is made: this times the Python
and torch calls alone, on torch's current stream.

    python3 benchmarks/device_views.py [--rounds 20000]

Prints, per batch shape, the mean microseconds per batch of each way, best of 5 runs.
"""

from __future__ import annotations

import argparse
import time

import torch

from pinpool._wire import codec, leaves

BATCHES = {
    "tokens 8x8193 int64": torch.zeros(8, 8193, dtype=torch.int64),
    "ids, mask, labels 8x2048 int64": {
        k: torch.zeros(8, 2048, dtype=torch.int64)
        for k in ("input_ids", "attention_mask", "labels")
    },
    "8 float32 leaves": [torch.zeros(64, 32) for _ in range(8)],
}


def _per_leaf(specs: list[codec.LeafSpec], need: int, device: torch.device) -> list[torch.Tensor]:
    storage = torch.empty(need, dtype=torch.uint8, device=device)
    return [leaves.device_leaf(storage, s) for s in specs]


def _layout(specs: list[codec.LeafSpec], need: int, device: torch.device) -> list[torch.Tensor]:
    layout = leaves.device_layout(specs, need)
    assert layout is not None
    return layout.views(layout.allocate(device))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20000)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {device}, torch {torch.__version__}, {args.rounds} batches a run, best of 5")
    print(f"{'batch':34} {'per leaf us':>12} {'layout us':>10} {'saved':>7}")
    for name, batch in BATCHES.items():
        p = codec.plan(batch)
        specs = leaves.checked_specs(p.specs, p.nbytes)
        best = {}
        for way in (_per_leaf, _layout):
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(args.rounds):
                    way(specs, p.nbytes, device)
                times.append((time.perf_counter() - t0) / args.rounds * 1e6)
            best[way] = min(times)
        a, b = best[_per_leaf], best[_layout]
        print(f"{name:34} {a:12.2f} {b:10.2f} {a - b:7.2f}")


if __name__ == "__main__":
    main()
