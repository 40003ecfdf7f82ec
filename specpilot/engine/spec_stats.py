"""Speculative decoding statistics: tau, acceptance histogram, per-position acceptance, time split."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class SpecStats:
    block_size: int = 0  # tokens per verify pass: the newest committed token + drafts
    steps: int = 0  # verify passes, summed over requests
    committed: int = 0  # tokens committed by those passes
    histogram: list[int] = field(default_factory=list)  # [n] = passes that committed n tokens
    position_accepted: list[int] = field(default_factory=list)  # [j] = passes that accepted draft j+1
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0

    def record(self, committed: int) -> None:
        if not self.histogram:
            self.histogram = [0] * (self.block_size + 1)
            self.position_accepted = [0] * (self.block_size - 1)
        self.steps += 1
        self.committed += committed
        self.histogram[committed] += 1
        for j in range(committed - 1):
            self.position_accepted[j] += 1

    @property
    def tau(self) -> float:
        """Mean tokens per verify pass (accepted + 1)."""
        return self.committed / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        steps = max(self.steps, 1)
        return {
            "tau": self.tau, "verify_passes": self.steps, "committed_tokens": self.committed,
            "accept_histogram": self.histogram,
            "per_position_acceptance": [a / steps for a in self.position_accepted],
            "time_s": {"draft": self.draft_s, "verify": self.verify_s, "other": self.other_s},
        }


class StepClock:
    """Splits one step into intervals. On CUDA the marks are events on the device's own timeline, so
    work launched asynchronously is charged to the interval where it runs; the last interval (host work
    after the step's final sync) is wall time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start_wall = time.perf_counter()
        self.marks: list = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        self.last_wall = time.perf_counter()

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks, then the wall time since the last mark."""
        if self.cuda:
            self.marks[-1].synchronize()
            spans = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        else:
            spans = [b - a for a, b in zip(self.marks, self.marks[1:])]
        return spans + [time.perf_counter() - self.last_wall]
