"""Hand-made DataLoader handles, built over real segments the way the main process receives
them, for the tests of corrupt and hostile handles (``test_codec``, ``test_hardening``)."""

from __future__ import annotations

import os
from typing import Any

import torch

import pinpool
from pinpool._native import WorkerSegment
from pinpool._wire import codec as _codec
from pinpool._wire.handle import BatchHandle


class HandleFactory:
    """Builds ``BatchHandle`` objects the way the main process gets them (``__setstate__``)
    for a live loader, over a real segment made here, in this process."""

    def __init__(self, loader: pinpool.DataLoader) -> None:
        self.token = loader._pinpool_receiver.token
        self.batch = {"a": torch.arange(10.0), "b": [torch.ones(3, 3, dtype=torch.int16), "s"]}
        self.plan = _codec.plan(self.batch)
        self.segment = WorkerSegment(1 << 16)
        self.write()
        self.next_worker = 1000

    def write(self) -> None:
        assert self.segment.try_begin(), "the segment is still in flight"
        _codec.write(self.plan, self.segment)

    def worker(self) -> int:
        self.next_worker += 1
        return self.next_worker

    def make(self, worker: int | None = None, announce: bool = True, **override: Any) -> Any:
        seg = self.segment
        origin = (os.getpid(), seg.fd) if announce else None
        h = BatchHandle(
            self.token,
            self.plan,
            worker=self.worker() if worker is None else worker,
            segment=0,
            origin=origin,
            total_len=seg.total_len,
            nonce=seg.nonce,
        )
        for name, value in override.items():
            setattr(h, name, value)
        received = BatchHandle.__new__(BatchHandle)
        received.__setstate__(h.__getstate__())
        return received
