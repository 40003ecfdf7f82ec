"""Small host <-> device transfers that never make the host wait for queued GPU work."""

from __future__ import annotations

import torch


def to_device(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    """int64 values on `device`. On CUDA they go through pinned memory, asynchronously: a copy from
    pageable memory would block the host until the stream reached it."""
    host = torch.tensor(values, dtype=torch.int64)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


class HostCopy:
    """A device tensor's values on their way to the host. The copy is queued now, right behind the
    work that produces them, so work launched afterwards does not delay it; `tolist()` waits for the
    copy alone."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.event = None
        if tensor.is_cuda:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
