"""Whether paired timings show a real speedup: the one-sided sign-flip (randomization) test on the pairs' log
speedups, and the confidence bound it implies. It assumes only that, were the candidate no faster, each pair's
log speedup would be as likely negative as positive; machine drift between pairs cancels inside each pair."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05
_EXACT_UP_TO = 14  # pairs whose 2^n sign assignments are enumerated; beyond, a fixed-seed sample of them
_SAMPLED = 1 << 16


@dataclass(frozen=True)
class Significance:
    p_value: float  # one-sided: the chance of a mean log speedup this large were the candidate no faster
    lower: float  # the speedup's one-sided (1 - alpha) lower confidence bound (geometric mean); 0: too few pairs
    geometric_mean: float


def min_pairs(alpha: float = ALPHA) -> int:
    """The fewest pairs whose best case (every pair faster) reaches `alpha`."""
    return math.ceil(math.log2(1 / alpha))


def _signs(n: int) -> np.ndarray:
    if n <= _EXACT_UP_TO:
        codes = np.arange(1 << n)[:, None] >> np.arange(n)[None, :]
        return 1 - 2 * (codes & 1)  # every assignment, the observed one (all +1) included
    draws = np.random.default_rng(0).choice([-1, 1], size=(_SAMPLED, n))
    return np.vstack([np.ones((1, n), dtype=draws.dtype), draws])


def _p(log_speedups: np.ndarray, signs: np.ndarray) -> float:
    flipped = signs @ log_speedups
    return float(np.mean(flipped >= log_speedups.sum() - 1e-12))


def paired_test(stock_runs: list[float], candidate_runs: list[float], alpha: float = ALPHA) -> Significance:
    """Times of interleaved pairs (lower is faster). The bound is the largest speedup the test still rejects
    at `alpha` when the pairs are divided by it (the test inverted by bisection)."""
    if len(stock_runs) != len(candidate_runs) or not stock_runs:
        raise ValueError("the test needs pairs: as many stock runs as candidate runs, at least one")
    logs = np.log(np.asarray(stock_runs, dtype=float) / np.asarray(candidate_runs, dtype=float))
    signs = _signs(len(logs))
    if len(logs) < min_pairs(alpha):
        return Significance(_p(logs, signs), 0.0, math.exp(float(logs.mean())))
    low, high = float(logs.min()), float(logs.max())
    if _p(logs - low, signs) > alpha:  # not even the worst pair's speedup is shown: the bound lies below it
        low -= high - low + 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if _p(logs - mid, signs) <= alpha else (low, mid)
    return Significance(_p(logs, signs), math.exp(low), math.exp(float(logs.mean())))
