"""Speculative decoding statistics: tau, acceptance histogram, per-position acceptance, time split."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch


@dataclass
class SpecStats:
    block_size: int = 0  # tokens per verify pass: the newest committed token + drafts
    steps: int = 0  # verify passes, summed over requests
    committed: int = 0  # tokens committed by those passes
    histogram: list[int] = field(default_factory=list)  # [n] = passes that committed n tokens
    position_accepted: list[int] = field(default_factory=list)  # [j] = passes that accepted draft j+1
    # steps' clocks, read when the time split is asked for: reading a clock waits for its last event,
    # which a step that launched the next draft early must not do itself
    clocks: list[StepClock] = field(default_factory=list, repr=False)
    times: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("draft", "verify", "other"), 0.0))

    def add_clock(self, clock: StepClock) -> None:
        if len(self.clocks) >= 64:
            self.time_split()
        self.clocks.append(clock)

    def time_split(self, wait: bool = False) -> dict[str, float]:
        """Seconds summed over steps: draft (on the device, the early-launched part included), verify
        (verify pass and acceptance), other (host work after the step's sync). Steps whose device work
        is still running are left for a later call unless `wait` (then their times are waited for)."""
        pending = []
        for clock in self.clocks:
            if not (wait or clock.finished()):
                pending.append(clock)
                continue
            for key, seconds in zip(("draft", "verify", "other"), clock.split()):
                self.times[key] += seconds
        self.clocks = pending
        return dict(self.times)

    def record(self, committed: list[int]) -> None:
        """One step's verify passes: the tokens each committed (work per distinct count, not per pass)."""
        if not committed:
            return
        top = max(committed)
        if len(self.histogram) <= top:  # sized by the block; stats reset while AR have block 0
            self.histogram += [0] * (max(self.block_size, top) + 1 - len(self.histogram))
            self.position_accepted += [0] * (len(self.histogram) - 2 - len(self.position_accepted))
        self.steps += len(committed)
        self.committed += sum(committed)
        for n, passes in Counter(committed).items():
            self.histogram[n] += passes
            for j in range(n - 1):
                self.position_accepted[j] += passes

    @property
    def tau(self) -> float:
        """Mean tokens per verify pass (accepted + 1)."""
        return self.committed / self.steps if self.steps else 0.0

    def as_dict(self, wait: bool = False) -> dict:
        """`wait`: include the time split of steps whose device work is still running (see time_split)."""
        steps = max(self.steps, 1)
        return {
            "tau": self.tau, "verify_passes": self.steps, "committed_tokens": self.committed,
            "accept_histogram": self.histogram,
            "per_position_acceptance": [a / steps for a in self.position_accepted],
            "time_s": self.time_split(wait),
        }


class StepClock:
    """Marks one step: its start, the draft's end, the verify's end, and where a drafter launches the
    next draft early, that draft's end. On CUDA the marks are events on the device's own timeline, so
    work launched asynchronously is charged to the interval where it runs; `synced()` and `done()`
    bound the host work after the step's sync (wall time)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.sync_wall = self.other = 0.0
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def synced(self) -> None:
        self.sync_wall = time.perf_counter()

    def done(self) -> None:
        self.other = time.perf_counter() - self.sync_wall

    def finished(self) -> bool:
        """Whether the device has passed the last mark (reading the clock would not wait)."""
        return not self.cuda or self.marks[-1].query()

    def split(self) -> tuple[float, float, float]:
        """(draft, verify, other) seconds; waits for the last mark on the device."""
        if self.cuda:
            self.marks[-1].synchronize()
            spans = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        else:
            spans = [b - a for a, b in zip(self.marks, self.marks[1:])]
        return spans[0] + sum(spans[2:]), spans[1], self.other
