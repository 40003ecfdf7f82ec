"""Lossless acceptance of a drafted chain against the target's logits.

Rows: the target's logits at the verify positions of one request, [K+1, V], row j predicting the token
after (newest committed token, d_1 .. d_j). The verifier returns the tokens to commit: an accepted
prefix of the draft plus one token of the target's own (the bonus), so 1..K+1 tokens.
"""

from __future__ import annotations

import torch

from specpilot.engine.request import Request
from specpilot.engine.sampling import target_probs


class Verifier:
    """Greedy: accept while the draft equals the target's argmax. T>0 (point-mass drafts): sample the
    target at each position and accept while the sample equals the draft, so every committed token is
    a sample of the target's own distribution given the committed prefix - exactly AR sampling."""

    name = "exact"

    def accept(self, req: Request, rows: torch.Tensor, draft: list[int], argmax: list[int]) -> list[int]:
        if req.params.greedy:
            return self._prefix(draft, argmax)
        out: list[int] = []
        for j in range(len(draft) + 1):
            probs = target_probs(rows[j : j + 1], req.params)
            token = int(torch.multinomial(probs, 1, generator=req.generator))
            out.append(token)
            if j == len(draft) or token != draft[j]:
                break
        return out

    @staticmethod
    def _prefix(draft: list[int], argmax: list[int]) -> list[int]:
        a = 0
        while a < len(draft) and draft[a] == argmax[a]:
            a += 1
        return argmax[: a + 1]
