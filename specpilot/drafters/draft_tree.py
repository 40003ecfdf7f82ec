"""Draft trees from a parallel drafter's per-slot top-k.

A parallel drafter (DFlash, PARD) predicts every slot of its block at once, each from the context alone,
so it offers a distribution per depth rather than per path. Verifying its top-1 chain wastes most of a
block: deep slots are rarely reached. A tree spends the same verify width on the likeliest paths
instead: a path's score is the product of its tokens' draft probabilities, and the `num_nodes` best
paths (every prefix of a chosen path scores at least as high, so the set is a tree) are verified in one
target pass under an ancestor mask.

Everything is tensor work of fixed shape on the drafter's device (no host sync, graph-capturable).
Candidates are the paths that leave the top-1 chain at most `MAX_DEVIATIONS` times: at a 15-node budget
paths with more detours score far below the cut (a detour's probability multiplies in each time).

Layout of a tree over one request's verify block: node 0 is its newest committed token, draft node j
(1-based) has `parents[j-1] < j` and `depths[j-1]` (its distance from node 0; its RoPE position is the
committed length + depth), and `ancestors[j]` is the bit set of the nodes it may attend to (its
ancestors and itself; node 0 sees itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations, product

import torch

MAX_DEVIATIONS = 2
MAX_TREE_NODES = 63  # ancestor sets are int64 bit masks over node 0 .. num_nodes


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


def merge_lookup(probs: torch.Tensor, token_ids: torch.Tensor, hint: torch.Tensor, prob: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot top-k ([n, D, k]) with prompt lookup's proposal merged in: `hint` [n, D + 1] holds a use
    flag, then the lookup's token for each slot. In rows that use it, that token joins its slot's list
    at probability `prob` (once: the drafter's own entry for it is dropped) and the list keeps its k
    likeliest, so the lookup's continuation becomes one more path the tree can take."""
    use, look = hint[:, :1, None].bool(), hint[:, 1:, None]
    k = probs.shape[-1]
    merged_p = torch.cat([torch.full_like(probs[..., :1], prob), probs.masked_fill(token_ids == look, 0.0)], -1)
    merged_p, order = merged_p.topk(k, dim=-1)
    merged_ids = torch.cat([look, token_ids], -1).gather(-1, order)
    return torch.where(use, merged_p, probs), torch.where(use, merged_ids, token_ids)


class TreeBuilder:
    """Turns per-slot top-k ([n, D, k] probabilities and token ids, probabilities descending along k)
    into the `num_nodes` likeliest draft paths. Candidate tables are built once per (D, k)."""

    def __init__(self, topk: int, num_nodes: int, depth: int, device: torch.device) -> None:
        if topk < 2:
            raise ValueError(f"a draft tree needs top-k >= 2, got {topk}")
        if not 1 <= num_nodes <= MAX_TREE_NODES:
            raise ValueError(f"a draft tree holds 1..{MAX_TREE_NODES} draft nodes, got {num_nodes}")
        self.topk, self.num_nodes, self.depth = topk, num_nodes, depth
        paths = _candidate_paths(depth, topk)  # index 0: the root (empty path)
        if len(paths) - 1 < num_nodes:
            raise ValueError(f"top-{topk} over {depth} slots offers {len(paths) - 1} paths, fewer than {num_nodes} nodes")
        index = {p: i for i, p in enumerate(paths)}
        c = len(paths)
        depths = torch.tensor([len(p) for p in paths])
        # score = chain prefix (log q of rank 0 up to the path's depth) + each detour's (log q_r - log q_0)
        detour_cols = torch.full((c, MAX_DEVIATIONS), depth * topk, dtype=torch.long)  # pad -> a zero column
        ancestors = torch.zeros((c, depth), dtype=torch.long)  # candidate ids of the path's prefixes (0 = root)
        for i, p in enumerate(paths):
            for j, (d, r) in enumerate((d, r) for d, r in enumerate(p) if r):
                detour_cols[i, j] = d * topk + r
            for d in range(len(p)):
                ancestors[i, d] = index[p[: d + 1]]
        last = torch.tensor([(len(p) - 1) * topk + p[-1] if p else 0 for p in paths])
        self.tables = {name: t.to(device) for name, t in dict(
            depths=depths, detour_cols=detour_cols, ancestors=ancestors, last=last,
            parent=torch.tensor([index[p[:-1]] if p else 0 for p in paths])).items()}

    def build(self, probs: torch.Tensor, token_ids: torch.Tensor) -> TreeLayout:
        n, depth, k = probs.shape
        if (depth, k) != (self.depth, self.topk):
            raise ValueError(f"expected top-{self.topk} over {self.depth} slots, got {tuple(probs.shape[1:])}")
        t = self.tables
        logq = probs.float().clamp_min(1e-30).log()
        chain = torch.cat([logq.new_zeros(n, 1), logq[:, :, 0].cumsum(1)], 1)  # [n, D+1] by depth
        detours = torch.cat([(logq - logq[:, :, :1]).reshape(n, -1), logq.new_zeros(n, 1)], 1)
        score = chain[:, t["depths"]] + detours[:, t["detour_cols"]].sum(-1)
        # ties (a probability of exactly 1) must not rank a child above its parent: deeper loses
        score = score - 1e-6 * t["depths"]
        score[:, 0] = float("-inf")  # the root is not a draft node
        chosen = score.topk(self.num_nodes, dim=1).indices.sort(dim=1).values  # candidate ids: parents first
        node_of = torch.zeros(n, score.shape[1], dtype=torch.long, device=probs.device)
        node_of.scatter_(1, chosen, torch.arange(1, self.num_nodes + 1, device=probs.device).expand(n, -1))
        tokens = token_ids.reshape(n, -1).gather(1, t["last"][chosen])
        parents = node_of.gather(1, t["parent"][chosen])
        depths = t["depths"][chosen]
        anc_nodes = node_of.gather(1, t["ancestors"][chosen].view(n, -1)).view(n, self.num_nodes, depth)
        bits = (torch.ones_like(anc_nodes) << anc_nodes).masked_fill(anc_nodes == 0, 0).sum(-1) | 1
        ancestors = torch.cat([bits.new_ones(n, 1), bits], 1)
        return TreeLayout(tokens, parents, depths, ancestors)


def _candidate_paths(depth: int, topk: int) -> list[tuple[int, ...]]:
    """Rank tuples (rank of each depth's token in its slot's top-k) with at most MAX_DEVIATIONS
    non-zero ranks, ordered by depth so every path comes after its prefix."""
    paths: list[tuple[int, ...]] = [()]
    for d in range(1, depth + 1):
        for m in range(MAX_DEVIATIONS + 1):
            for where in combinations(range(d), m):
                for ranks in product(range(1, topk), repeat=m):
                    p = [0] * d
                    for w, r in zip(where, ranks):
                        p[w] = r
                    paths.append(tuple(p))
    return paths
