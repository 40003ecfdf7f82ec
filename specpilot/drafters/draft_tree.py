"""Draft trees from a parallel drafter's per-slot top-k.

A parallel drafter (DFlash, PARD) predicts every slot of its block at once, each from the context alone,
so it offers a distribution per depth rather than per path. Verifying its top-1 chain wastes most of a
block: deep slots are rarely reached. A tree spends the same verify width on the likeliest paths
instead: a path's score is the product of its tokens' draft probabilities, and the `num_nodes` best
paths (every prefix of a chosen path scores at least as high, so the set is a tree) are verified in one
target pass under an ancestor mask.

Everything is tensor work of fixed shape on the drafter's device (no host sync, graph-capturable); on
CUDA, `TreeBuilder.build_merged` does the merge and the build in one Triton launch (kernels/tree_build.py).
Candidates are the paths that leave the top-1 chain at most `MAX_DEVIATIONS` times: at a 15-node budget
paths with more detours score far below the cut (a detour's probability multiplies in each time).

Layout of a tree over one request's verify block: node 0 is its newest committed token, draft node j
(1-based) has `parents[j-1] < j` and `depths[j-1]` (its distance from node 0; its RoPE position is the
committed length + depth), and `ancestors[j]` is the bit set of the nodes it may attend to (its
ancestors and itself; node 0 sees itself).
"""

from __future__ import annotations

from itertools import combinations, product

import torch
import torch.nn.functional as F

from specpilot.kernels.softmax_topk import top_k_indices
from specpilot.kernels.tree_build import MAX_DEPTH as MAX_KERNEL_DEPTH
from specpilot.kernels.tree_build import MAX_TOPK as MAX_KERNEL_TOPK
from specpilot.kernels.tree_build import tree_build_triton
from specpilot.kernels.triton_support import HAS_TRITON, pick_backend
from specpilot.state.tree import TreeLayout

MAX_DEVIATIONS = 2
MAX_TREE_NODES = 63  # ancestor sets are int64 bit masks over node 0 .. num_nodes
TIE_MARGIN = 1e-3  # per depth, in log probability (TreeBuilder)


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


def node_confidences(probs: torch.Tensor, token_ids: torch.Tensor, hint: torch.Tensor | None, lookup_prob: float,
                     tree: TreeLayout) -> torch.Tensor:
    """[n, K]: each draft node's confidence, the probability its token had in its depth's slot (after prompt
    lookup's merge, as the tree was built from). Fixed-shape tensor work (graph-capturable)."""
    if hint is not None:
        probs, token_ids = merge_lookup(probs, token_ids, hint, lookup_prob)
    slot = (tree.depths - 1).long()[..., None].expand(-1, -1, probs.shape[-1])
    match = token_ids.gather(1, slot) == tree.tokens[..., None]
    return (probs.gather(1, slot).float() * match).sum(-1)


class TreeBuilder:
    """Turns per-slot top-k ([n, D, k] probabilities and token ids, probabilities descending along k)
    into the `num_nodes` likeliest draft paths. Candidate tables are built once per (D, k), so a build
    is ~16 small kernels: one matmul scores every candidate path, top-k picks the nodes, sorting the
    picked ids gives parents-first node order, and one searchsorted maps each node's parent and
    ancestors from candidate ids to node indices. `build_merged` adds prompt lookup's merge and, for CUDA
    tensors, does it all in one Triton launch, which needs only the per-depth bias."""

    def __init__(self, topk: int, num_nodes: int, depth: int, device: torch.device) -> None:
        if topk < 2:
            raise ValueError(f"a draft tree needs top-k >= 2, got {topk}")
        if not 1 <= num_nodes <= MAX_TREE_NODES:
            raise ValueError(f"a draft tree holds 1..{MAX_TREE_NODES} draft nodes, got {num_nodes}")
        if device.type == "cuda" and HAS_TRITON and (depth > MAX_KERNEL_DEPTH or topk > MAX_KERNEL_TOPK):
            # said here, before the candidate tables (minutes of host work for deep trees), not at the first draft
            raise ValueError(f"a draft tree on CUDA spans at most {MAX_KERNEL_DEPTH} slots of top-{MAX_KERNEL_TOPK} "
                             f"(--speculative-num-draft-tokens <= {MAX_KERNEL_DEPTH + 1}, --speculative-eagle-topk <= "
                             f"{MAX_KERNEL_TOPK}), got {depth} slots of top-{topk}")
        self.topk, self.num_nodes, self.depth = topk, num_nodes, depth
        paths = _candidate_paths(depth, topk)  # index 0: the root (empty path)
        if len(paths) - 1 < num_nodes:
            raise ValueError(f"top-{topk} over {depth} slots offers {len(paths) - 1} paths, fewer than {num_nodes} nodes")
        index = {p: i for i, p in enumerate(paths)}
        c = len(paths)
        # score(path) = sum of log q over its (depth, rank) entries: one matmul with this 0/1 matrix
        entries = torch.zeros(depth * topk, c)
        # lineage: the parent's candidate id, then the ids of the path's prefixes (itself last; 0 = root)
        lineage = torch.zeros(c, depth + 1, dtype=torch.long)
        for i, p in enumerate(paths):
            for d, r in enumerate(p):
                entries[d * topk + r, i] = 1.0
                lineage[i, d + 1] = index[p[: d + 1]]
            lineage[i, 0] = index[p[:-1]] if p else 0
        depths = torch.tensor([len(p) for p in paths])
        # A child scores its parent's score plus a log probability (<= 0), minus this per-depth margin:
        # strictly below its parent even for a probability of 1 and float32 rounding at scores near -70,
        # so the top-N set is closed under prefixes (a tree). It reorders only near-equal paths.
        depth_bias = -TIE_MARGIN * torch.arange(depth + 1).float()
        bias = depth_bias[depths]
        bias[0] = float("-inf")  # the root is not a draft node
        pow2 = torch.ones(num_nodes + 1, dtype=torch.long) << torch.arange(num_nodes + 1)  # bit 63 wraps to the sign
        pow2[0] = 0  # node 0 (padding of short lineages too): its bit is added apart
        last = torch.tensor([(len(p) - 1) * topk + p[-1] if p else 0 for p in paths])
        self.tables = {name: t.to(device) for name, t in dict(
            entries=entries, lineage=lineage, depths=depths, bias=bias, depth_bias=depth_bias, pow2=pow2,
            last=last).items()}

    def _check(self, probs: torch.Tensor) -> None:
        if tuple(probs.shape[1:]) != (self.depth, self.topk):
            raise ValueError(f"expected top-{self.topk} over {self.depth} slots, got {tuple(probs.shape[1:])}")

    def build_merged(self, probs: torch.Tensor, token_ids: torch.Tensor, hint: torch.Tensor | None,
                     lookup_prob: float, backend: str = "auto") -> TreeLayout:
        """`build` of the lists `merge_lookup` makes (of `probs` and `token_ids` as they are without a
        hint): one Triton launch for CUDA tensors when triton imports, the torch ops otherwise. Among
        exactly equal path scores the kernel takes the lower candidate id (the Triton top-k's rule)."""
        self._check(probs)
        if pick_backend(backend, probs) == "triton":
            return TreeLayout(*tree_build_triton(probs, token_ids, hint, lookup_prob, self.tables["depth_bias"],
                                                 self.num_nodes, MAX_DEVIATIONS))
        if hint is not None:
            probs, token_ids = merge_lookup(probs, token_ids, hint, lookup_prob)
        return self.build(probs, token_ids)

    def build(self, probs: torch.Tensor, token_ids: torch.Tensor) -> TreeLayout:
        self._check(probs)
        n = probs.shape[0]
        t = self.tables
        logq = probs.float().clamp_min(1e-30).log().view(n, -1)
        score = torch.addmm(t["bias"], logq, t["entries"])
        chosen = top_k_indices(score, self.num_nodes).sort(dim=1).values  # candidate ids: parents first
        with_root = F.pad(chosen, (1, 0))  # node j's candidate id at j; the root (id 0) at node 0
        lineage = torch.searchsorted(with_root, t["lineage"][chosen].view(n, -1)).view(n, self.num_nodes, -1)
        ancestors = F.pad(t["pow2"][lineage[:, :, 1:]].sum(-1), (1, 0)) + 1
        return TreeLayout(token_ids.reshape(n, -1).gather(1, t["last"][chosen]), lineage[:, :, 0],
                          t["depths"][chosen], ancestors)


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
