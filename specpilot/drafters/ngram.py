"""Prompt-lookup drafting: continue the latest earlier occurrence of the context's last n-gram."""

from __future__ import annotations

import torch

from specpilot.drafters.base import Draft, Drafter
from specpilot.engine.request import Request


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, block_size: int, max_ngram: int = 4, min_ngram: int = 1) -> None:
        super().__init__(block_size)
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, reqs: list[Request]) -> Draft:
        return Draft(torch.tensor([self.lookup(r.all_ids) for r in reqs], dtype=torch.int64))

    def lookup(self, ids: list[int]) -> list[int]:
        """Longest n-gram first; among its matches the latest one. Always K tokens (stock verifies a full
        block): a short continuation is padded by repeating its last token."""
        k = self.num_proposals
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start : start + n] == tail:
                    cont = ids[start + n : start + n + k]
                    return cont + [cont[-1]] * (k - len(cont))
        return [ids[-1]] * k
