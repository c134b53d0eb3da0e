"""Which calls give up the GIL, and so cost a hand-off when another thread wants it.

A spinner thread runs pure Python. With the switch interval set to 50 ms, each time the
calling thread gives up the GIL (a torch op's dispatch does, numpy views do not) the spinner
keeps it for the whole 50 ms, so ``releases per call`` is the time per call over 50 ms. A
release that the calling thread takes back before the spinner wakes is not counted: counts
below 1 are releases too short to be lost every time (more cores, more of them lost).

    python benchmarks/gil_probe.py [--calls 20]

It reports, per call, how often each one gives the GIL up (``view``, ``.to(device)``,
``Event.record``, ``torch.from_numpy`` of a numpy view, slicing, ``torch.cuda.stream``).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import pinpool

INTERVAL = 0.05


class CudaArray:
    """An object with a ``__cuda_array_interface__`` over ``owner``'s device memory."""

    __slots__ = ("__cuda_array_interface__", "owner")

    def __init__(self, owner: torch.Tensor, shape: tuple[int, ...], typestr: str) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "data": (owner.data_ptr(), False),
            "shape": shape,
            "typestr": typestr,
            "version": 2,
        }


def calls() -> dict[str, Callable[[], Any]]:
    """The calls to probe: views of a 512 KiB host buffer, and (with CUDA) a delivery's
    device calls."""
    row = 8193
    buf = bytearray(1 << 20)
    base = torch.frombuffer(buf, dtype=torch.uint8)
    out: dict[str, Callable[[], Any]] = {
        "torch.empty(0)": lambda: torch.empty(0),
        "slice": lambda: base[64 : 64 + 8 * row],
        "as_strided": lambda: base.as_strided((8 * row,), (1,), 64),
        "view(dtype)": lambda: base.view(torch.int64),
        "view(shape)": lambda: base.view(256, 4096),
        "torch.frombuffer": lambda: torch.frombuffer(buf, dtype=torch.int64, count=row, offset=64),
        "from_numpy(np.frombuffer().reshape())": lambda: torch.from_numpy(
            np.frombuffer(buf, np.int64, 8 * row, 64).reshape(8, row)
        ),
    }
    if not torch.cuda.is_available():
        return out
    dev = torch.device("cuda", 0)
    pool = pinpool.PinPool(1 << 20, 2, device=0)
    slot = pool.checkout()
    host = torch.frombuffer(slot, dtype=torch.uint8, count=8 * row * 8)
    copy_stream = torch.cuda.Stream(dev)
    stored = host.to(dev)
    event = torch.cuda.Event()
    event.record(copy_stream)
    current = torch.cuda.current_stream(dev)

    def stream_context() -> None:
        with torch.cuda.stream(copy_stream):
            pass

    out.update(
        {
            "cuda: torch.cuda.stream() enter+exit": stream_context,
            "cuda: current_stream()": lambda: torch.cuda.current_stream(dev),
            "cuda: .to(device, non_blocking=True)": lambda: host.to(dev, non_blocking=True),
            "cuda: Event()": lambda: torch.cuda.Event(),
            "cuda: Event().record(stream)": lambda: torch.cuda.Event().record(copy_stream),
            "cuda: stream.wait_event()": lambda: current.wait_event(event),
            "cuda: record_stream()": lambda: stored.record_stream(current),
            "cuda: slice": lambda: stored[64:128],
            "cuda: view(dtype)": lambda: stored.view(torch.int64),
            "cuda: view(shape)": lambda: stored.view(8, -1),
            "cuda: torch.empty(n, device=)": lambda: torch.empty(
                1 << 19, dtype=torch.uint8, device=dev
            ),
            "cuda: as_tensor(__cuda_array_interface__)": lambda: torch.as_tensor(
                CudaArray(stored, (8, row), "<i8"), device=dev
            ),
        }
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20, help="calls per probe (20)")
    args = ap.parse_args()
    probes = calls()
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    sys.setswitchinterval(INTERVAL)
    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    time.sleep(2 * INTERVAL)
    print(f"{'call':44s} {'releases per call':>18s}")
    for name, fn in probes.items():
        fn()
        time.sleep(0)  # let the spinner have the GIL now: the timed calls start a fresh hold
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        per_call = (time.perf_counter() - start) / args.calls
        print(f"{name:44s} {per_call / INTERVAL:18.2f}", flush=True)
    stop.set()
    spinner.join()


if __name__ == "__main__":
    main()
