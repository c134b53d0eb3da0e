"""The GPU side of a bench run: :class:`ComputeWork`, a stand-in for a model step whose length
is calibrated once, and :func:`h2d_ceiling`, the host-to-device copy rate loaders are held
against.

Invariants: both need CUDA and run on the current stream; ``ComputeWork.step`` cannot start
before its batch is on the device (it reads the batch's largest tensor) and takes about
``target_ms`` of GPU time; nothing here touches a loader.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .workloads import largest


class ComputeWork:
    """A stand-in for a model step: the mean of the batch's largest tensor (so the work cannot
    start before the batch is on the device), then a chain of ``n x n`` float32 matmuls on
    fixed device tensors, as many as take ``target_ms`` (timed once with CUDA events)."""

    def __init__(
        self, device: torch.device, target_ms: float, n: int = 4096, data_parallel: Any = None
    ) -> None:
        self.data_parallel = data_parallel  # a ranks.DataParallelStep, run after the chain
        gen = torch.Generator(device=device).manual_seed(0)
        # Scaled so that x @ w keeps the size of x: long chains neither overflow nor vanish.
        self.w = torch.randn(n, n, device=device, generator=gen) / math.sqrt(n)
        self.x = torch.randn(n, n, device=device, generator=gen)
        one = torch.ones((), device=device)
        self._before = torch.cuda.Event(enable_timing=True)
        self.iters = 10
        self._chain(one)  # warm-up: kernels, cuBLAS workspace
        per_matmul = self._timed(lambda: self._chain(one)) / self.iters
        self.iters = max(1, round(target_ms / per_matmul))
        first = self._timed(lambda: self._chain(one))
        self.iters = max(1, round(self.iters * target_ms / first))  # one correction
        self.calibration = {
            "target_ms": target_ms,
            "matmul_n": n,
            "matmul_ms": per_matmul,
            "matmuls_per_step": self.iters,
            "chain_ms": self._timed(lambda: self._chain(one)),
        }

    def _chain(self, scale: torch.Tensor) -> torch.Tensor:
        x = self.x * scale
        for _ in range(self.iters):
            x = x @ self.w
        return x.mean()

    @staticmethod
    def _timed(fn: Any) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    @property
    def before_event(self) -> torch.cuda.Event:
        """The timing event of the step about to run that goes before its copy (made at the
        end of the step before, off the time between steps)."""
        return self._before

    def step(self, batch: Any) -> tuple[torch.cuda.Event, torch.cuda.Event, torch.Tensor]:
        """Queues one step's work on the current stream: (start event, end event, loss)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = self._chain(1 + 1e-3 * largest(batch).float().mean())
        if self.data_parallel is not None:
            loss = loss + self.data_parallel(loss)
        end.record()
        self._before = torch.cuda.Event(enable_timing=True)  # the next step's
        return start, end, loss


def h2d_ceiling(nbytes: int, device: torch.device, repeats: int = 10) -> float:
    """GB/s of ``non_blocking`` copies of ``nbytes`` from torch pinned memory to ``device``:
    the PCIe ceiling that loaders are measured against in the same run."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    gbps = nbytes * repeats / (start.elapsed_time(end) / 1e3) / 1e9
    del src, dst
    return gbps
