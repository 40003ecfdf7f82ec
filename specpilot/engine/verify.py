"""Lossless acceptance of a drafted chain or tree against the target's logits.

Rows: the target's logits at one request's verify positions, [K+1, V]: row 0 predicts the token after
its newest committed token, row j (j >= 1) the token after draft node j and its ancestors. In a chain
node j's parent is j - 1; a tree gives each node's parent. The verifier returns the tokens to commit
(an accepted path of drafts plus one token of the target's own, the bonus: 1..depth+1 tokens) and the
accepted draft nodes, in order.

Greedy requests can be accepted on the device (`Verifier.greedy`): the same walk as tensor work of
fixed shape, so the host need not see the argmax before the next draft is launched.
"""

from __future__ import annotations

import torch

from specpilot.engine.sampling import keyed_sample
from specpilot.kernels.tree_accept import tree_accept
from specpilot.state.draft import Accepted
from specpilot.state.request import Request
from specpilot.state.tree import TreeLayout


class Verifier:
    """Walk from the newest committed token: at each node the target decides the next token (greedy:
    its argmax; T>0: the keyed sample of its distribution at that output position, the very token AR
    would draw there), and the walk moves to the child drafted with that token if there is one. Every committed token is thus the target's own decision given the committed
    prefix - exactly AR decoding, whatever was drafted (drafts are point masses; siblings are distinct)."""

    def accept(self, req: Request, rows: torch.Tensor, draft: list[int], argmax: list[int],
               parents: list[int] | None = None) -> tuple[list[int], list[int]]:
        children = draft_children(draft, parents)
        tokens: list[int] = []
        path: list[int] = []
        node = 0
        while True:
            if req.params.greedy:
                token = argmax[node]
            else:  # the node at depth len(tokens) decides output position len(output_ids) + len(tokens)
                position = torch.tensor([len(req.output_ids) + len(tokens)], device=rows.device)
                token = int(keyed_sample(rows[node : node + 1], req.params, req.sampling_seed, position)[0])
            tokens.append(token)
            child = children.get((node, token))
            if child is None:
                return tokens, path
            path.append(child)
            node = child

    def greedy(self, argmax: torch.Tensor, drafts: torch.Tensor, starts: torch.Tensor,
               tree: TreeLayout | None = None) -> Accepted:
        """The walk for all requests at once, on the device: `argmax` [n, q], each verify row's decision
        (its argmax, or for a sampling request its keyed sample),
        `drafts` [n, q - 1], `starts` [n] the committed lengths the pass verified at. A draft node is
        accepted when it and every ancestor equal their parents' argmax; siblings are distinct, so the
        accepted nodes form one path (the deepest one's lineage; kernels/tree_accept.py)."""
        n, q = argmax.shape
        if tree is None:
            accepted = (drafts == argmax[:, :-1]).long().cumprod(1).sum(1)
            nodes = torch.arange(q, device=argmax.device).repeat(n, 1)
            return Accepted(accepted + 1, nodes, argmax, starts)
        return Accepted(*tree_accept(argmax, drafts, tree.parents, tree.depths, tree.ancestors), starts)


def draft_children(draft: list[int], parents: list[int] | None = None) -> dict[tuple[int, int], int]:
    """(parent node, token) -> the child node drafted with that token (node 0: the newest committed token)."""
    children: dict[tuple[int, int], int] = {}
    for j, token in enumerate(draft, start=1):
        children.setdefault((j - 1 if parents is None else parents[j - 1], token), j)
    return children
