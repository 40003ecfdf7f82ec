"""Logprobs of committed tokens, from the target logits that decided them (after the request's bans)."""

from __future__ import annotations

import math

import torch

from specpilot.config import SamplingParams
from specpilot.state.request import TokenLogprob

IMPOSSIBLE = -9999.0  # OpenAI's value for an id the distribution excludes (-inf is not JSON)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else IMPOSSIBLE


def token_logprobs(rows: torch.Tensor, tokens: list[int], params: SamplingParams) -> list[TokenLogprob]:
    """rows[j] [V] decided tokens[j]. Each row is normalized on its own, so its logprobs are a function of
    its logits alone (not of how many rows the pass held); one host copy for all of them."""
    k = min(params.top_logprobs_num, rows.shape[-1])
    named = torch.tensor(params.token_ids_logprob, dtype=torch.long, device=rows.device)
    values, top_ids = [], []
    for row, token in zip(rows, tokens):
        logprobs = torch.log_softmax(row.float(), dim=-1)
        top = torch.topk(logprobs, k)
        values.append(torch.cat([logprobs[token : token + 1], top.values, logprobs[named]]))
        top_ids.append(top.indices)
    if not values:
        return []
    host_values, host_ids = torch.stack(values).tolist(), torch.stack(top_ids).tolist()
    out = []
    for vals, ids in zip(host_values, host_ids):
        vals = [_finite(v) for v in vals]
        out.append(TokenLogprob(vals[0], list(zip(vals[1 : 1 + k], ids)),
                                list(zip(vals[1 + k :], params.token_ids_logprob))))
    return out
