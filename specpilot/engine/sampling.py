"""Turning logits into tokens: greedy, temperature, top-k, top-p, min-p, per-request seeded RNG."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specpilot.config import SamplingParams
from specpilot.kernels.softmax_topk import row_argmax


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
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def choose_tokens(logits: torch.Tensor, row_params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row; greedy rows in one argmax, sampled rows from target_probs."""
    out = row_argmax(logits)
    sampled = [i for i, p in enumerate(row_params) if not p.greedy]
    for i in sampled:
        probs = target_probs(logits[i : i + 1], row_params[i])
        out[i] = torch.multinomial(probs, 1, generator=generators[i]).squeeze()
    return out.tolist()
