"""Turning logits into tokens: greedy, temperature, top-k, top-p, min-p, keyed sampling."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specpilot.config import SamplingParams
from specpilot.kernels.softmax_topk import row_argmax
from specpilot.state.request import Request


def suppress(logits: torch.Tensor, row_banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """-inf on banned ids per row (stop tokens before min_new_tokens). Modifies and returns logits."""
    for row, banned in enumerate(row_banned):
        if banned:
            logits[row, list(banned)] = float("-inf")
    return logits


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from for one request's rows: [N, V] float32 logits → probs."""
    scaled = logits.float() / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        # stable: which of equal probabilities crosses top_p must not depend on how many rows sort together
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs / probs.sum(-1, keepdim=True)


# Keyed sampling: the token sampled at an output position is a function of (the request's seed, the
# position, the target's distribution there) alone: Gumbel-max over noise from a counter-based hash of
# (seed, position, token id). AR and verification then draw the same token for the same distribution,
# whatever the batch, the step or the drafts, so a seed gives the same text with speculation on or off.
_MASK64 = (1 << 64) - 1


def _as_int64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (_as_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: int64 arithmetic wraps the same way on every device."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def keyed_gumbel(seed: int | torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, V] float64 Gumbel noise for output positions `positions` [N] of the request keyed by `seed` (or
    of row i's request, keyed by seed[i], for an int64 tensor [N] of seeds as `as_seed` makes them)."""
    if not isinstance(seed, torch.Tensor):
        seed = torch.tensor(_as_int64(seed), dtype=torch.int64, device=positions.device)
    key = _mix64(seed + _GOLDEN)
    row = _mix64(key ^ (positions.long() * _GOLDEN))
    ids = torch.arange(vocab, dtype=torch.int64, device=positions.device)
    bits = _shr(_mix64(row[:, None] + ids * _MIX1), 11)  # 53 random bits per (position, token)
    uniform = (bits.double() + 0.5) * 2.0**-53  # in (0, 1)
    return -torch.log(-torch.log(uniform))


def as_seeds(seeds: Sequence[int], device: torch.device) -> torch.Tensor:
    """Request seeds as keyed_gumbel's int64 tensor (a seed is any integer; its low 64 bits key it)."""
    return torch.tensor([_as_int64(s) for s in seeds], dtype=torch.int64, device=device)


def keyed_scores(probs: torch.Tensor, seed: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[N, V] log p + the Gumbel noise of row i's output position positions[i]; -inf where p is 0."""
    return torch.where(probs > 0, probs.double().log() + keyed_gumbel(seed, positions, probs.shape[-1]),
                       float("-inf"))


def keyed_sample(logits: torch.Tensor, params: SamplingParams, seed: int, positions: torch.Tensor) -> torch.Tensor:
    """[N] the keyed sample of each row's target distribution (row i decides output position
    positions[i]): the argmax of its keyed scores, first index on ties."""
    return row_argmax(keyed_scores(target_probs(logits, params), seed, positions))


def _distribution(params: SamplingParams) -> tuple[float, int, float, float]:
    return params.temperature, params.top_k, params.top_p, params.min_p


def keyed_sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                      positions: torch.Tensor) -> torch.Tensor:
    """[N] row i's keyed sample under params[i] and seeds[i] at output position positions[i]: bitwise
    keyed_sample of that row alone, in a few launches for all rows. Rows of the same distribution settings
    share one target_probs call (every op in it is row-wise), the noise is one hash over all rows."""
    probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    groups: dict[tuple[float, int, float, float], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(_distribution(p), []).append(i)
    for rows in groups.values():
        index = torch.tensor(rows, device=logits.device)
        probs[index] = target_probs(logits[index], params[rows[0]])
    return row_argmax(keyed_scores(probs, as_seeds(seeds, logits.device), positions))


def choose_tokens(logits: torch.Tensor, reqs: Sequence[Request]) -> list[int]:
    """One token per row (row i: request i's next output position); greedy rows in one argmax,
    sampled rows by their keyed samples, together."""
    out = row_argmax(logits)
    sampled = [i for i, req in enumerate(reqs) if not req.params.greedy]
    if sampled:
        chosen = [reqs[i] for i in sampled]
        index = torch.tensor(sampled, device=logits.device)
        positions = torch.tensor([len(r.output_ids) for r in chosen], device=logits.device)
        out[index] = keyed_sample_rows(logits[index], [r.params for r in chosen], [r.sampling_seed for r in chosen],
                                       positions)
    return out.tolist()
