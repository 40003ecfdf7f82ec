"""What a drafter proposes and what verification accepted: the data the speculative step passes on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.state.tree import TreeLayout


@dataclass
class Draft:
    """Per request a row of `tokens` ([requests, block_size - 1], int64, on any device): the proposed
    continuation after its newest committed token; and, where the drafter has them, its confidence in
    each proposed token (probability of its argmax), same shape. Both may stay on the device: the engine
    brings them to the host in the step's single sync. A tree drafter's `tokens` are its tree's draft
    nodes and `tree` says how they hang together (draft_tree.TreeLayout); without it they form a chain."""

    tokens: torch.Tensor
    confidences: torch.Tensor | None = None
    tree: TreeLayout | None = None
    # the drafter's graph already laid the tree into the verify graph's inputs, as the engine's acceptance
    # graph left them (ModelRunner.verify skips that work unless it refills the inputs itself)
    placed: bool = False


@dataclass
class Accepted:
    """Device-side acceptance of n requests: `counts` [n] tokens committed (accepted drafts + the bonus),
    `nodes` [n, q] the verify rows that decided them (0, then the accepted draft nodes; padded with 0),
    `tokens` [n, q] the committed tokens (the first counts[i] of row i), `starts` [n] the committed
    lengths before them."""

    counts: torch.Tensor
    nodes: torch.Tensor
    tokens: torch.Tensor
    starts: torch.Tensor

    def bonus(self) -> torch.Tensor:
        """[n] each request's newest committed token (the target's own, after the accepted drafts)."""
        return self.tokens.gather(1, (self.counts - 1)[:, None]).squeeze(1)
