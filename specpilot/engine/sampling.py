"""Turning logits into tokens: greedy, temperature, top-k, top-p, min-p, keyed sampling."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specpilot.config import SamplingParams
from specpilot.kernels.keyed_argmax import as_int64, keyed_argmax
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
        probs = probs.masked_fill(~top_p_keep(probs, params.top_p), 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs / probs.sum(-1, keepdim=True)


# Rows whose nucleus lies within their this-many likeliest tokens find its cut without sorting the vocabulary
TOP_P_CANDIDATES = 512


def _nucleus_size(descending: torch.Tensor, top_p: float) -> torch.Tensor:
    """[N] how many of each row's probabilities (sorted descending) the nucleus keeps: the smallest prefix
    whose mass reaches top_p, the token crossing it included."""
    before = torch.nn.functional.pad(descending.cumsum(-1)[:, :-1], (1, 0))  # mass ahead of each position
    return (before < top_p).sum(-1)


def top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[N, V] the tokens of each row's nucleus: its likeliest tokens, most probable first and the lower id first
    among equal ones, up to the one whose mass reaches top_p. Found from the row's TOP_P_CANDIDATES largest
    values (a full sort only for rows whose nucleus is wider), then one pass over the vocabulary: everything
    above the cut's value, and of the tokens at it the lowest ids the nucleus has room for. Row by row: a row's
    nucleus never depends on the rows beside it."""
    vocab = probs.shape[-1]
    head = torch.topk(probs, min(TOP_P_CANDIDATES, vocab), dim=-1).values  # only values: ties' order is moot
    size = _nucleus_size(head, top_p)
    cut = head.gather(-1, (size - 1).clamp(min=0)[:, None])
    wide = size == head.shape[-1]
    if head.shape[-1] < vocab and bool(wide.any()):
        rows = wide.nonzero().squeeze(1)
        full = torch.sort(probs[rows], dim=-1, descending=True).values
        size[rows] = _nucleus_size(full, top_p)
        cut[rows] = full.gather(-1, (size[rows] - 1).clamp(min=0)[:, None])
    above = probs > cut
    at = probs == cut
    room = size[:, None] - above.sum(-1, keepdim=True)
    return above | (at & (at.cumsum(-1, dtype=torch.int32) <= room))


# Keyed sampling: the token sampled at an output position is a function of (the request's seed, the
# position, the target's distribution there) alone: Gumbel-max over noise from a counter-based hash of
# (seed, position, token id) (kernels/keyed_argmax.py). AR and verification then draw the same token for the
# same distribution, whatever the batch, the step or the drafts, so a seed gives the same text with
# speculation on or off.


def as_seeds(seeds: Sequence[int], device: torch.device) -> torch.Tensor:
    """Request seeds as an int64 tensor (a seed is any integer; its low 64 bits key it)."""
    return torch.tensor([as_int64(s) for s in seeds], dtype=torch.int64, device=device)


def keyed_sample(logits: torch.Tensor, params: SamplingParams, seed: int, positions: torch.Tensor) -> torch.Tensor:
    """[N] the keyed sample of each row's target distribution (row i decides output position
    positions[i]): the argmax of its keyed scores, first index on ties."""
    return keyed_argmax(target_probs(logits, params), seed, positions)


def _distribution(params: SamplingParams) -> tuple[float, int, float, float]:
    return params.temperature, params.top_k, params.top_p, params.min_p


def keyed_sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                      positions: torch.Tensor, repeats: int = 1) -> torch.Tensor:
    """[N] row r's keyed sample under params[i] and seeds[i], i = r // repeats (`repeats` rows an entry: a
    request's verify rows), at output position positions[r]: bitwise keyed_sample of that row alone, in a few
    launches for all rows. Rows of the same distribution settings share one target_probs call (every op in it
    is row-wise), the noise is one hash over all rows; the host's work is per entry, not per row."""
    device = logits.device
    probs = torch.empty(logits.shape, dtype=torch.float32, device=device)
    groups: dict[tuple[float, int, float, float], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(_distribution(p), []).append(i)
    within = torch.arange(repeats, device=device)  # a row's place among its entry's
    for entries in groups.values():
        index = (torch.tensor(entries, device=device)[:, None] * repeats + within).flatten()
        probs[index] = target_probs(logits[index], params[entries[0]])
    return keyed_argmax(probs, as_seeds(seeds, device).repeat_interleave(repeats), positions)


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
