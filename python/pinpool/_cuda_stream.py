"""Which CUDA stream is current: what a slot's fence is recorded on when no stream is given."""

from __future__ import annotations

import sys


def current_stream(device: int) -> int | None:
    """The raw handle of torch's current stream on ``device``, or None if torch has not
    initialised CUDA (then no GPU work can be reading a slot)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)
