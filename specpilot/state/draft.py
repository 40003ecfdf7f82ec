"""What a drafter proposes and what verification accepted: the data the speculative step passes on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.state.tree import TreeLayout


@dataclass
class Draft:
    """Per request a row of `tokens` ([requests, K], int64, on any device): the proposed continuation
    after its newest committed token; and, where the drafter declares `confidences`, its confidence in
    each proposed token (probability of its argmax), same shape. Both may stay on the device: the step
    brings them to the host in its single sync. A tree drafter's `tokens` are its tree's draft nodes and
    `tree` says how they hang together; without it they form a chain."""

    tokens: torch.Tensor
    confidences: torch.Tensor | None = None
    tree: TreeLayout | None = None
    # per request, how many of its K tokens to verify (None: all): verify widths may differ per request
    lengths: list[int] | None = None
    # the same chosen on the device (`ragged` graphs: [requests] int64), with the rows of the graph they fill; the
    # host learns them after the verify
    device_lengths: tuple[torch.Tensor, int] | None = None
    # the tensors are the first rows of the drafter's graph outputs for this batch-size bucket (what the
    # step's placement graph of the bucket reads); None: tensors of their own
    bucket: int | None = None
    # per request, whether n-gram assist's lookup supplied its row instead of the model drafter (None: none did)
    assisted: list[bool] | None = None

    def widths(self) -> list[int]:
        """Verify rows per request: its newest committed token and its drafts."""
        k = self.tokens.shape[1]
        if self.device_lengths is not None:
            raise ValueError("the draft's lengths were chosen on the device: the host learns them after the verify")
        if self.lengths is None:
            return [k + 1] * self.tokens.shape[0]
        if self.tree is not None:
            raise ValueError("a draft tree verifies all of its nodes: per-request lengths are for chains")
        return [min(max(n, 0), k) + 1 for n in self.lengths]


@dataclass
class Decision:
    """One request's outcome of a verify pass: the tokens to commit (accepted drafts, then the target's
    own bonus token) and the verify rows that decided them (0, then the accepted draft nodes)."""

    tokens: list[int]
    rows: list[int]


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

    # The host reads an acceptance as one flat int64 buffer: counts [b], then tokens and nodes [b, q] each.
    @staticmethod
    def packed_size(b: int, q: int) -> int:
        return b * (2 * q + 1)

    def pack(self) -> torch.Tensor:
        return torch.cat([self.counts, self.tokens.flatten(), self.nodes.flatten()])

    @staticmethod
    def unpack(values: list[int], b: int, q: int, n: int) -> list[Decision]:
        """The first n requests' decisions from `pack`'s values for b requests of q rows."""
        counts, tokens, nodes = values[:b], values[b : b + b * q], values[b + b * q :]
        return [Decision(tokens[s : s + c], nodes[s : s + c]) for s, c in zip(range(0, n * q, q), counts[:n])]
