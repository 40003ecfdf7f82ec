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
        ids = _top_ids(logprobs, k)
        values.append(torch.cat([logprobs[token : token + 1], logprobs[ids], logprobs[named]]))
        top_ids.append(ids)
    if not values:
        return []
    host_values, host_ids = torch.stack(values).tolist(), torch.stack(top_ids).tolist()
    out = []
    for vals, ids, token in zip(host_values, host_ids, tokens):
        vals = [_finite(v) for v in vals]
        out.append(TokenLogprob(vals[0], _tie_order(list(zip(vals[1 : 1 + k], ids)), vals[0], token),
                                list(zip(vals[1 + k :], params.token_ids_logprob))))
    return out


def _top_ids(logprobs: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the k largest logprobs, where the k-th ties others the lowest of those ids (torch.topk's
    pick among ties varies by device and kernel)."""
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=logprobs.device)
    kth = torch.topk(logprobs, k).values[-1]
    vocab = logprobs.shape[-1]
    ids = torch.arange(vocab, device=logprobs.device)
    score = torch.where(logprobs > kth, 2 * vocab, torch.where(logprobs == kth, vocab - ids, 0))
    return torch.topk(score, k).indices


def _tie_order(top: list[tuple[float, int]], logprob: float, token: int) -> list[tuple[float, int]]:
    """The top entries by logprob, ties broken the same way on every device: the committed token first (a
    greedy token heads the list even where it ties another), then by id. A committed token that tied the
    last entry but was cut takes that entry's place."""
    if top and token not in (i for _, i in top) and logprob == top[-1][0]:
        top[-1] = (logprob, token)
    return sorted(top, key=lambda e: (-e[0], e[1] != token, e[1]))


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
