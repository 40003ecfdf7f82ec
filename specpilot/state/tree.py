"""How a request's draft nodes hang together: a chain, or a draft tree over one verify block.

Node 0 is the request's newest committed token; draft node j (1-based) has `parents[j-1] < j` and
`depths[j-1]` (its distance from node 0; its RoPE position is the committed length + depth), and
`ancestors[j]` is the bit set of the nodes it may attend to (its ancestors and itself; node 0 sees
itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TreeLayout:
    """Per request (rows): draft node tokens, their parents and depths [n, K]; ancestor bit sets [n, K+1]."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor

    def narrow(self, keep: torch.Tensor) -> TreeLayout:
        """Per request the subtree of its draft nodes `keep` ([n, m] 0-based columns, ascending, every kept node's
        parent kept too), renumbered 1..m in the same order (parents still first)."""
        n, m = keep.shape
        nodes = torch.arange(1, m + 1, device=keep.device)
        new_index = torch.zeros(n, self.tokens.shape[1] + 1, dtype=torch.long, device=keep.device)
        new_index.scatter_(1, keep + 1, nodes.expand(n, m))  # an old node's new number (the root stays 0)
        parents = new_index.gather(1, self.parents.gather(1, keep).long())
        old = self.ancestors.gather(1, F.pad(keep + 1, (1, 0)))  # the root's row, then the kept nodes'
        bits = (old[:, :, None] >> (keep + 1)[:, None, :]) & 1  # [n, m + 1, m]: kept node i among its ancestors
        ancestors = (bits << nodes).sum(-1) + 1
        return TreeLayout(self.tokens.gather(1, keep), parents, self.depths.gather(1, keep), ancestors)


def chain_layout(tokens: torch.Tensor) -> TreeLayout:
    """The tree of a chain: node j's parent is j-1."""
    n, k = tokens.shape
    nodes = torch.arange(k + 1, device=tokens.device)
    ancestors = (torch.ones_like(nodes) << (nodes + 1)) - 1
    return TreeLayout(tokens, nodes[:-1].expand(n, k), nodes[1:].expand(n, k), ancestors.expand(n, k + 1))
