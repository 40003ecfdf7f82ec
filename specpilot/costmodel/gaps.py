"""Gaps: a measured step breakdown minus the floors, each priced as the speedup it costs (what closing it
alone would add to S = τ · T_AR / T_step), ranked."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specpilot.costmodel.floors import Floors


@dataclass(frozen=True)
class Measured:
    ar_step_ms: float
    draft_ms: float
    verify_ms: float
    other_ms: float  # host work and whatever the step's clock does not put in draft or verify
    tau: float

    @property
    def spec_step_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.other_ms

    @property
    def speedup(self) -> float:
        return self.tau * self.ar_step_ms / self.spec_step_ms


@dataclass(frozen=True)
class Gap:
    name: str
    unit: str  # "ms" for a stage, "tokens/step" for τ
    measured: float
    best: float  # the floor (ms) or the ceiling (τ)
    lost_speedup: float

    def as_dict(self) -> dict:
        return asdict(self)


def rank_gaps(measured: Measured, floor: Floors) -> list[Gap]:
    """The step's stages against their floors, and τ against its ceiling, largest lost speedup first."""
    now = measured.speedup
    gaps = []
    for name, got, best in (("draft", measured.draft_ms, floor.draft_ms),
                            ("verify", measured.verify_ms, floor.verify_ms),
                            ("host and overhead", measured.other_ms, floor.overhead_ms)):
        closed = measured.spec_step_ms - max(got - best, 0.0)
        gaps.append(Gap(name, "ms", got, best, measured.tau * measured.ar_step_ms / closed - now))
    tau_lost = floor.tau_max * measured.ar_step_ms / measured.spec_step_ms - now
    gaps.append(Gap("acceptance (tau)", "tokens/step", measured.tau, floor.tau_max, tau_lost))
    return sorted(gaps, key=lambda g: g.lost_speedup, reverse=True)
