"""Prompt-lookup drafting: continue the latest earlier occurrence of the context's last n-gram."""

from __future__ import annotations

import torch

from specpilot.drafters.base import Drafter
from specpilot.state.draft import Draft
from specpilot.state.request import Request


class NgramIndex:
    """One request's context and, for each n, the latest start of every n-gram with a token after it.
    Updated as tokens arrive, so a lookup costs O(max_ngram) instead of a scan of the whole context
    (the scan was the largest host cost of a 32-request step)."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.ids: list[int] = []
        # longest first: the order lookups try them in
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(max_ngram, min_ngram - 1, -1)}

    def extend(self, tokens: list[int]) -> None:
        ids = self.ids
        for token in tokens:
            ids.append(token)
            for n, table in self.latest.items():
                start = len(ids) - n - 1  # the n-gram that just got a token after it
                if start >= 0:
                    table[tuple(ids[start : start + n])] = start

    def lookup(self, k: int) -> list[int]:
        """Longest n-gram first; among its matches the latest one. Always k tokens (stock verifies a full
        block): a short continuation is padded by repeating its last token."""
        return self.match(k)[0]

    def match(self, k: int) -> tuple[list[int], int]:
        """`lookup`'s k tokens and the length of the n-gram they continue (0: no match, the last token
        repeated)."""
        ids = self.ids
        for n, table in self.latest.items():
            if n >= len(ids):
                continue
            start = table.get(tuple(ids[-n:]))
            if start is not None:
                cont = ids[start + n : start + n + k]
                return cont + [cont[-1]] * (k - len(cont)), n
        return [ids[-1]] * k, 0


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, block_size: int, max_ngram: int = 4, min_ngram: int = 1) -> None:
        super().__init__(block_size)
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, reqs: list[Request]) -> Draft:
        return Draft(torch.tensor([self.synced(r).lookup(self.num_proposals) for r in reqs], dtype=torch.int64))

    def synced(self, req: Request) -> NgramIndex:
        """The request's index, brought up to its committed tokens (committed tokens never change)."""
        index = self.indexes.get(req.rid)
        if index is None:
            index = self.indexes[req.rid] = NgramIndex(self.min_ngram, self.max_ngram)
        prompt_len, have = len(req.prompt_ids), len(index.ids)
        if have < prompt_len:
            index.extend(req.prompt_ids[have:])
            have = prompt_len
        index.extend(req.output_ids[have - prompt_len :])
        return index

    def release(self, req: Request) -> None:
        self.indexes.pop(req.rid, None)
