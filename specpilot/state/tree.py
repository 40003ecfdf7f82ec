"""How a request's draft nodes hang together: a chain, or a draft tree over one verify block.

Node 0 is the request's newest committed token; draft node j (1-based) has `parents[j-1] < j` and
`depths[j-1]` (its distance from node 0; its RoPE position is the committed length + depth), and
`ancestors[j]` is the bit set of the nodes it may attend to (its ancestors and itself; node 0 sees
itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TreeLayout:
    """Per request (rows): draft node tokens, their parents and depths [n, K]; ancestor bit sets [n, K+1]."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor


def chain_layout(tokens: torch.Tensor) -> TreeLayout:
    """The tree of a chain: node j's parent is j-1."""
    n, k = tokens.shape
    nodes = torch.arange(k + 1, device=tokens.device)
    ancestors = (torch.ones_like(nodes) << (nodes + 1)) - 1
    return TreeLayout(tokens, nodes[:-1].expand(n, k), nodes[1:].expand(n, k), ancestors.expand(n, k + 1))
