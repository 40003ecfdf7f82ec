"""Small host <-> device transfers that never make the host wait for queued GPU work."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from itertools import chain

import torch

_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}


def host_tensor(values: Iterable[int] | Iterable[float], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D CPU tensor of integers (or float32), made through an array: torch.tensor converts a list element by
    element, several times slower (at large batches, input fills were mostly that conversion)."""
    buffer = array(_TYPECODES[dtype], values)
    return torch.frombuffer(buffer, dtype=dtype) if buffer else torch.zeros(0, dtype=dtype)


def to_device(values: list[int] | list[list[int]] | list[list[float]], device: torch.device,
              dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """int64 (or `dtype`) values on `device` (a list, or rows of equal length). On CUDA they go through pinned
    memory, asynchronously: a copy from pageable memory would block the host until the stream reached it."""
    if values and isinstance(values[0], list):
        width = len(values[0])
        if any(len(row) != width for row in values):
            raise ValueError("to_device takes rows of equal length")
        host = host_tensor(chain.from_iterable(values), dtype).view(len(values), width)
    else:
        host = host_tensor(values, dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


class HostCopy:
    """Values on their way to the host: `host` is where a copy already queued on the device lands (pinned
    memory), or the values themselves on CPU. Created right behind the copy, so work launched
    afterwards does not delay it; `tolist()` waits for the copy alone."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.event = None
        if host.is_pinned():
            self.event = torch.cuda.Event()
            self.event.record()

    @classmethod
    def of(cls, tensor: torch.Tensor) -> HostCopy:
        """Queue the copy of a device tensor's values (none needed on CPU)."""
        if tensor.is_cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            tensor = host
        return cls(tensor)

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
