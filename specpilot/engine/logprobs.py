"""Logprobs of committed tokens, from the target logits that decided them (after the request's bans)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from specpilot.config import SamplingParams
from specpilot.state.request import Request, TokenLogprob

IMPOSSIBLE = -9999.0  # OpenAI's value for an id the distribution excludes (-inf is not JSON)
PROMPT_CHUNK = 256  # prompt rows whose logits exist at once (a long prompt's would not fit)


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


def wants_prompt_logprobs(req: Request) -> bool:
    return req.params.return_logprob and 0 <= req.params.logprob_start_len < len(req.prompt_ids)


def prompt_logprobs(req: Request, hidden: torch.Tensor, logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """req.input_logprobs from its prompt's final hidden states [len(prompt), H] (row i predicts token i + 1),
    PROMPT_CHUNK rows of logits at a time."""
    start, prompt = req.params.logprob_start_len, req.prompt_ids
    entries: list[TokenLogprob | None] = [None] if start == 0 else []
    first = max(start, 1)  # the first position something predicts
    for lo in range(first, len(prompt), PROMPT_CHUNK):
        hi = min(lo + PROMPT_CHUNK, len(prompt))
        entries += token_logprobs(logits(hidden[lo - 1 : hi - 1]), prompt[lo:hi], req.params)
    req.input_logprobs = entries
