"""Prompt lookup for a tree drafter, on the device: each slot's tokens in a device history, looked up by
kernels/ngram_lookup.py, so the next draft tree takes the lookup's path without the host in between.

Who writes the history: after a greedy verify the drafter's early launch appends the accepted tokens on
the device (`append_and_lookup`, inside its prep graph); everything else (prompts, tokens committed by
the host's walk, tokens token forcing substituted) is written from the host by `sync` before a lookup
that the host starts. Per request the host remembers how many leading tokens the history holds for sure.
"""

from __future__ import annotations

import torch

from specpilot.kernels.ngram_lookup import append_and_lookup, ngram_lookup
from specpilot.state.draft import Accepted
from specpilot.state.request import Request
from specpilot.state.transfer import to_device


class DeviceLookup:
    def __init__(self, num_slots: int, width: int, num_tokens: int, min_n: int, max_n: int,
                 device: torch.device) -> None:
        """`width`: positions per slot; `num_tokens`: tokens per lookup (the drafter's proposals)."""
        self.width, self.num_tokens, self.min_n, self.max_n, self.device = width, num_tokens, min_n, max_n, device
        # a row per slot and one for the scratch slot (graph padding); the last column absorbs the writes
        # of rows that were not committed
        self.history = torch.zeros(num_slots + 1, width + 1, dtype=torch.int64, device=device)
        self.synced: dict[str, int] = {}  # rid -> leading tokens the history holds

    def sync(self, reqs: list[Request]) -> None:
        """Write the requests' tokens the history lacks (one indexed copy for all of them)."""
        where: list[int] = []
        tokens: list[int] = []
        for req in reqs:
            prompt, total = len(req.prompt_ids), len(req.prompt_ids) + len(req.output_ids)
            have = min(self.synced.get(req.rid, 0), total)
            if have < total:
                tokens += req.prompt_ids[have:] + req.output_ids[max(have - prompt, 0):]
                base = req.slot * (self.width + 1)
                where += range(base + have, base + total)
            self.synced[req.rid] = total
        if where:
            self.history.view(-1).index_copy_(0, to_device(where, self.device), to_device(tokens, self.device))

    def mark_synced(self, reqs: list[Request]) -> None:
        """The device appended these requests' newest tokens itself (their early-launched draft is used)."""
        for req in reqs:
            self.synced[req.rid] = len(req.prompt_ids) + len(req.output_ids)

    def lookup(self, reqs: list[Request]) -> torch.Tensor:
        """[n, K + 1] for requests the history holds (after `sync`): found flag, then K tokens."""
        meta = to_device([[r.slot for r in reqs], [len(r.prompt_ids) + len(r.output_ids) for r in reqs]], self.device)
        return ngram_lookup(self.history, meta[0], meta[1], self.num_tokens, self.min_n, self.max_n)

    def append_and_lookup(self, slots: torch.Tensor, accepted: Accepted) -> torch.Tensor:
        """Device-side (graph-capturable): append each request's accepted tokens after its `starts + 1`
        known tokens, then look up from the new end."""
        return append_and_lookup(self.history, slots, accepted.starts, accepted.tokens, accepted.counts,
                                 self.num_tokens, self.min_n, self.max_n)

    def release(self, req: Request) -> None:
        self.synced.pop(req.rid, None)
