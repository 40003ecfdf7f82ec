"""What the sealed evaluator is asked and what it answers, the rule that turns measurements into a verdict, and
the guard over the files no candidate may write."""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpilot.optimizer.significance import ALPHA, min_pairs, paired_test

REPEATS = 6  # interleaved pairs per candidate: enough for the test to accept with one pair to spare

@dataclass
class Request:
    """What the orchestrator asks: the deployment's base config, the candidate and the stock profile, and
    the benchmark (its prompts are a fixed slice; the forcing slice follows it and is never shown). A
    candidate with a `patch` (a unified diff of the package) runs from a sandboxed copy of the package."""

    config: dict[str, Any]  # EngineConfig fields
    candidate: dict[str, Any]  # a profile: {"mechanisms": [...] or "stock", "tunables": {...}}
    stock: dict[str, Any] = field(default_factory=lambda: {"mechanisms": "stock"})
    dataset: str = "humaneval"
    num_prompts: int = 3
    max_new_tokens: int = 32
    repeats: int = REPEATS
    patch: str | None = None
    guarded: list[str] = field(default_factory=list)  # files besides the installed package (the memory's)


@dataclass
class Verdict:
    accepted: bool
    reason: str | None
    forcing: dict[str, Any] | None = None
    speedup: dict[str, float] | None = None  # candidate over stock: median, min, max, lower (bound), p, pairs
    speedup_over_ar: float | None = None
    ceiling: float | None = None
    noise_band: float | None = None
    seconds: float = 0.0


def decide(stock_runs: list[float], candidate_runs: list[float], over_ar: float, ceiling: float,
           forcing: dict[str, Any] | None, seconds: float, alpha: float = ALPHA,
           reference: str = "stock") -> Verdict:
    """Paired interleaved runs (times, lower is faster) into a verdict: implausible above the ceiling, else
    accepted only if the paired sign-flip test shows the candidate faster than stock at `alpha`, i.e. its
    speedup's lower confidence bound is above 1. Stock's own spread across pairs is the noise band stated
    beside it. `reference` names what `stock_runs` ran in the reason (a head to head runs another profile)."""
    speedups = [s / c for s, c in zip(stock_runs, candidate_runs)]
    noise = (max(stock_runs) - min(stock_runs)) / statistics.median(stock_runs)
    test = paired_test(stock_runs, candidate_runs, alpha)
    spread = {"median": statistics.median(speedups), "min": min(speedups), "max": max(speedups),
              "lower": test.lower, "p": test.p_value, "pairs": len(speedups)}
    common = dict(forcing=forcing, speedup=spread, speedup_over_ar=over_ar, ceiling=ceiling, noise_band=noise,
                  seconds=seconds)
    if over_ar > ceiling:
        return Verdict(False, f"implausible: {over_ar:.2f}x over AR exceeds the cost model's ceiling "
                       f"{ceiling:.2f}x", **common)
    if len(speedups) < min_pairs(alpha):
        return Verdict(False, f"too few repeats: {len(speedups)} pairs cannot show a speedup at p <= {alpha}; "
                       f"at least {min_pairs(alpha)} are needed", **common)
    if test.p_value > alpha:
        return Verdict(False, f"not shown faster than {reference}: p = {test.p_value:.3f} > {alpha} over "
                       f"{len(speedups)} pairs (median {spread['median']:.3f}x, {1 - alpha:.0%} bound "
                       f"{test.lower:.3f}x; {reference}'s own spread {noise:.3f})", **common)
    return Verdict(True, None, **common)


class Guard:
    """Digests of files a candidate must leave alone (the installed package, the memory's database), taken
    before it runs and compared after."""

    def __init__(self, roots: list[Path]) -> None:
        self.roots = roots
        self.before = self._digests()

    def _digests(self) -> dict[str, str]:
        out = {}
        for root in self.roots:
            files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()
                                                           and "__pycache__" not in p.parts)
            for path in files:
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
        return out

    def changed(self) -> list[str]:
        """Files written, created or removed since the guard was set."""
        after = self._digests()
        return sorted(p for p in self.before.keys() | after.keys() if self.before.get(p) != after.get(p))
