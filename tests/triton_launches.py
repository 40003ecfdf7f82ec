"""Triton launches recorded on CPU instead of run: what each would be compiled as (a kernel's variant), so a test can
check that a warm-up launches every variant that later passes meet."""

from __future__ import annotations

import torch


def specialisation(args: tuple, kwargs: dict) -> tuple:
    """What Triton keys a compiled variant on, besides the source: tensors' dtype and 16-byte alignment, integers'
    being 1 or a multiple of 16, and the constexprs and launch options."""
    def of(a):
        if isinstance(a, torch.Tensor):
            return str(a.dtype), a.data_ptr() % 16 == 0
        if isinstance(a, int) and not isinstance(a, bool):
            return a == 1, a % 16 == 0
        return type(a).__name__
    return tuple(map(of, args)), tuple(sorted((k, str(v)) for k, v in kwargs.items()))


class LaunchRecorder:
    """Stands in for a @triton.jit kernel (`kernel[grid](...)` records instead of running): each variant with the
    phase that first launched it. `wanted(kwargs)` picks the launches that count."""

    def __init__(self, seen: dict[tuple, str], phase: list[str], name: str, wanted=lambda kwargs: True) -> None:
        self.seen, self.phase, self.name, self.wanted = seen, phase, name, wanted

    def __getitem__(self, grid):
        def launch(*args, **kwargs) -> None:
            if self.wanted(kwargs):
                self.seen.setdefault((self.name, specialisation(args, kwargs)), self.phase[0])
        return launch
