"""Draft trees from per-slot top-k in one launch: prompt lookup's merge, path scoring, the choice of the
likeliest paths and their layout, for every request at once, on the device.

Why: written as torch ops (drafters/draft_tree.py: ``merge_lookup``, then ``TreeBuilder.build``) a tree
is ~34 small kernels per speculative step, about 73 us on an H200, nearly all of it launches. Here it is
one program per request, and it never looks at most candidate paths: a path scores below its parent
(TreeBuilder's per-depth margin), so the best paths can be taken best first, the way a heap would,
from a frontier that holds only the children of the paths taken so far (at most k per path): N steps
over N x k entries instead of a score for each of the thousands of candidates.

Inputs per request (rows): ``probs`` [n, D, k] descending along k and ``token_ids`` [n, D, k] (distinct
per slot); ``hint`` [n, D + 1] or None: a use flag, then prompt lookup's token per slot, which joins
its slot's list at ``lookup_prob`` (the drafter's own entry for it dropped) in rows that use it;
``depth_bias`` [D + 1] float32, what TreeBuilder adds to a path's summed log probabilities per depth.
Candidates are the paths with at most ``max_deviations`` non-zero ranks. A path's score is
log(max(p, 1e-30)) summed in depth order, plus its depth's bias, in float32; the ``num_nodes`` best are
chosen, the lower candidate id first among equal scores, and laid out in candidate id order (the order
of TreeBuilder's candidates: by depth, then the number of deviations, then their positions, then their
ranks), which puts parents first.

Outputs, int64, as ``TreeLayout``: ``tokens``, ``parents``, ``depths`` [n, num_nodes] of draft nodes
1 .. num_nodes and ``ancestors`` [n, num_nodes + 1] bit sets (node 0, the root, is bit 0).

The torch reference is the drafter's own (``TreeBuilder.build_merged`` picks it for CPU tensors); this
module does not import the drafters. No host sync; the grid depends only on shapes: graph-capturable.
"""

from __future__ import annotations

from math import comb

import torch

from specpilot.kernels.triton_support import require_triton, tl, triton

__all__ = ["tree_build_triton"]

MAX_NODES = 63  # ancestor sets are int64 bit masks over node 0 .. num_nodes
MAX_DEPTH = 15  # 4-bit depths and positions in a path's key
MAX_TOPK = 8  # 3-bit ranks
MAX_DEVIATIONS = 3  # keys stay below 2**27: the low half of an int64 sort word


def _check(probs: torch.Tensor, token_ids: torch.Tensor, hint: torch.Tensor | None, depth_bias: torch.Tensor,
           num_nodes: int, max_deviations: int) -> None:
    if probs.dim() != 3 or not probs.is_floating_point():
        raise ValueError(f"probs must be floating point [n, D, k], got {probs.dtype} {tuple(probs.shape)}")
    n, depth, k = probs.shape
    if not 1 <= depth <= MAX_DEPTH or not 2 <= k <= MAX_TOPK:
        raise ValueError(f"need 1 <= D <= {MAX_DEPTH} slots of top-k with 2 <= k <= {MAX_TOPK}, got {(depth, k)}")
    if token_ids.shape != probs.shape or token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_ids must be integer {tuple(probs.shape)}, got {token_ids.dtype} {tuple(token_ids.shape)}")
    if hint is not None and (tuple(hint.shape) != (n, depth + 1) or hint.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"hint must be integer [{n}, {depth + 1}], got {hint.dtype} {tuple(hint.shape)}")
    if tuple(depth_bias.shape) != (depth + 1,) or depth_bias.dtype != torch.float32:
        raise ValueError(f"depth_bias must be float32 [{depth + 1}], got {depth_bias.dtype} {tuple(depth_bias.shape)}")
    if not 1 <= max_deviations <= MAX_DEVIATIONS:
        raise ValueError(f"max_deviations must lie in 1..{MAX_DEVIATIONS}, got {max_deviations}")
    paths = sum(comb(d, m) * (k - 1) ** m for d in range(1, depth + 1) for m in range(max_deviations + 1))
    if not 1 <= num_nodes <= min(MAX_NODES, paths):
        raise ValueError(f"num_nodes must lie in 1..{min(MAX_NODES, paths)} ({paths} candidate paths), got {num_nodes}")


if triton is not None:
    # A path's key, high bits to low: its depth (4 bits), its number of deviations (2), their positions
    # (4 bits each), their ranks (3 bits each), the first deviation first, with room for MAX_DEVIATIONS:
    # keys compare as TreeBuilder's candidate ids do.
    _LAST = tl.constexpr(MAX_DEVIATIONS - 1)  # the last deviation's fields are the lowest
    _POSITIONS = tl.constexpr(3 * MAX_DEVIATIONS)  # the ranks' fields lie below
    _COUNT = tl.constexpr(7 * MAX_DEVIATIONS)
    _DEPTH = tl.constexpr(7 * MAX_DEVIATIONS + 2)
    _ONE_DEVIATION = tl.constexpr(1 << (7 * MAX_DEVIATIONS))
    _ONE_DEEPER = tl.constexpr(1 << (7 * MAX_DEVIATIONS + 2))
    _KEY_MASK = tl.constexpr((1 << (7 * MAX_DEVIATIONS + 6)) - 1)
    _EMPTY = tl.constexpr(-0x7FFFFFFFFFFFFFFF)  # a frontier entry that holds no path: below every sort word

    @triton.jit
    def _children(s, key, t, logq, toks, bias, slot, rank, D: tl.constexpr, K: tl.constexpr,
                  MAX_DEV: tl.constexpr):
        """A path's children (one per rank of slot t, its depth): sort words, log probability sums and
        tokens [KP]. The sort word is the score's order-preserving int32 bits over the complement of the
        path's key, so one max takes the best score and, among equal ones, the lower key."""
        here = slot[:, None] == t
        lq = tl.sum(tl.where(here, logq, 0.0), 0)
        tok = tl.sum(tl.where(here, toks, 0), 0)
        b = tl.sum(tl.where(slot == t + 1, bias, 0.0), 0)
        m = (key >> _COUNT) & 3
        ok = (rank < K) & (t < D) & ((rank == 0) | (m < MAX_DEV))
        s = s + lq  # depth order, one addition per slot, as the reference's matmul accumulates
        bits = (s + b).to(tl.int32, bitcast=True)
        order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        j = _LAST - tl.minimum(m, _LAST)  # the new deviation's fields
        r = rank.to(tl.int64)
        dev = _ONE_DEVIATION + (t << (_POSITIONS + 4 * j)) + (r << (3 * j))
        key = key + _ONE_DEEPER + tl.where(r > 0, dev, 0)
        return tl.where(ok, (order << 32) | (_KEY_MASK - key), _EMPTY), s, tok

    @triton.jit
    def _tree_build_kernel(probs_ptr, ids_ptr, hint_ptr, bias_ptr, tokens_ptr, parents_ptr, depths_ptr, anc_ptr,
                           s_probs, s_ids, s_hint, lookup_prob, D: tl.constexpr, K: tl.constexpr,
                           N: tl.constexpr, MAX_DEV: tl.constexpr, HAS_HINT: tl.constexpr, DP: tl.constexpr,
                           KP: tl.constexpr, R: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        slot = tl.arange(0, DP)  # DP > D: also indexes depths 0 .. D
        rank = tl.arange(0, KP)
        entry = (slot[:, None] < D) & (rank[None, :] < K)
        offs = slot[:, None] * K + rank[None, :]
        p = tl.load(probs_ptr + row * s_probs + offs, mask=entry, other=0.0).to(tl.float32)
        toks = tl.load(ids_ptr + row * s_ids + offs, mask=entry, other=0).to(tl.int64)
        if HAS_HINT:
            # merged list: the drafter's entries but the lookup's token's own, with the lookup's token
            # placed after those likelier than lookup_prob, cut to k
            use = tl.load(hint_ptr + row * s_hint) != 0
            look = tl.load(hint_ptr + row * s_hint + 1 + slot, mask=slot < D, other=0).to(tl.int64)
            dup = tl.min(tl.where(entry & (toks == look[:, None]), rank[None, :], K), 1)
            pos = tl.sum((entry & (rank[None, :] != dup[:, None]) & (p > lookup_prob)).to(tl.int32), 1)
            hinted = rank[None, :] == pos[:, None]
            src = rank[None, :] - (rank[None, :] > pos[:, None]).to(tl.int32)
            src += (src >= dup[:, None]).to(tl.int32)
            moved = offs - rank[None, :] + src
            p_m = tl.load(probs_ptr + row * s_probs + moved, mask=entry & ~hinted, other=0.0).to(tl.float32)
            t_m = tl.load(ids_ptr + row * s_ids + moved, mask=entry & ~hinted, other=0).to(tl.int64)
            p = tl.where(use, tl.where(hinted, lookup_prob, p_m), p)
            toks = tl.where(use, tl.where(hinted, look[:, None], t_m), toks)
        logq = tl.log(tl.maximum(p, 1e-30))
        bias = tl.load(bias_ptr + slot, mask=slot <= D, other=0.0)

        # frontier row 0: the root's children; row i + 1: the children of the i-th path taken
        frow = tl.arange(0, R)[:, None]
        root = tl.zeros([], tl.int64)  # its key and depth
        word, s, tok = _children(0.0, root, root, logq, toks, bias, slot, rank, D, K, MAX_DEV)
        words = tl.where(frow == 0, word[None, :], _EMPTY)
        sums = tl.where(frow == 0, s[None, :], 0.0)
        ftok = tl.where(frow == 0, tok[None, :], 0)
        flin = tl.zeros([R, KP], tl.int64)  # bit i: the i-th path taken is an ancestor
        taken = tl.arange(0, R)
        keys = tl.zeros([R], tl.int64)  # per path taken: its key, token and lineage (itself included)
        tokens = tl.zeros([R], tl.int64)
        lineages = tl.zeros([R], tl.int64)
        for i in range(N):
            best = tl.max(words)
            sel = words == best
            s_i = tl.sum(tl.where(sel, sums, 0.0))
            tok_i = tl.sum(tl.where(sel, ftok, 0))
            lin = tl.sum(tl.where(sel, flin, 0)) | (tl.full([], 1, tl.int64) << i)
            key = _KEY_MASK - (best & _KEY_MASK)
            keys = tl.where(taken == i, key, keys)
            tokens = tl.where(taken == i, tok_i, tokens)
            lineages = tl.where(taken == i, lin, lineages)
            word, s, tok = _children(s_i, key, key >> _DEPTH, logq, toks, bias, slot, rank, D, K, MAX_DEV)
            grow = frow == i + 1
            words = tl.where(grow, word[None, :], tl.where(sel, _EMPTY, words))
            sums = tl.where(grow, s[None, :], sums)
            ftok = tl.where(grow, tok[None, :], ftok)
            flin = tl.where(grow, lin, flin)

        # node order = key order; j: the path described (axis 0), i: the others (axis 1)
        valid = taken < N
        others = valid[None, :]
        node = 1 + tl.sum((others & (keys[None, :] < keys[:, None])).to(tl.int64), 1)
        depth = keys >> _DEPTH
        on = others & (((lineages[:, None] >> taken[None, :].to(tl.int64)) & 1) == 1)
        bit = tl.full([R, R], 1, tl.int64) << node[None, :]  # node 63's bit wraps to the sign, as in TreeBuilder
        ancestors = 1 + tl.sum(tl.where(on, bit, 0), 1)
        parents = tl.sum(tl.where(on & (depth[None, :] == depth[:, None] - 1), node[None, :], 0), 1)
        tl.store(tokens_ptr + row * N + node - 1, tokens, mask=valid)
        tl.store(parents_ptr + row * N + node - 1, parents, mask=valid)
        tl.store(depths_ptr + row * N + node - 1, depth, mask=valid)
        tl.store(anc_ptr + row * (N + 1) + node, ancestors, mask=valid)
        tl.store(anc_ptr + row * (N + 1), tl.full([], 1, tl.int64))


def tree_build_triton(probs: torch.Tensor, token_ids: torch.Tensor, hint: torch.Tensor | None, lookup_prob: float,
                      depth_bias: torch.Tensor, num_nodes: int, max_deviations: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, parents, depths [n, num_nodes], ancestors [n, num_nodes + 1]) of each request's tree."""
    require_triton("tree_build_triton")
    _check(probs, token_ids, hint, depth_bias, num_nodes, max_deviations)
    # rows may be strided (views of a batch); a row's D x k entries must sit side by side
    probs, token_ids = (t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()
                        for t in (probs, token_ids))
    if hint is not None and hint.stride(1) != 1:
        hint = hint.contiguous()
    # the reference merges in probs' dtype: the lookup's probability rounds as its entry would
    lookup_prob = float(torch.tensor(lookup_prob, dtype=probs.dtype))
    n, depth, k = probs.shape
    dev = probs.device
    tokens, parents, depths = torch.empty(3, n, num_nodes, dtype=torch.int64, device=dev)
    ancestors = torch.empty(n, num_nodes + 1, dtype=torch.int64, device=dev)
    if n:
        r = triton.next_power_of_2(num_nodes)
        _tree_build_kernel[(n,)](probs, token_ids, hint if hint is not None else token_ids, depth_bias, tokens,
                                 parents, depths, ancestors, probs.stride(0), token_ids.stride(0),
                                 hint.stride(0) if hint is not None else 0, lookup_prob, D=depth, K=k, N=num_nodes,
                                 MAX_DEV=max_deviations, HAS_HINT=hint is not None,
                                 DP=triton.next_power_of_2(depth + 1), KP=triton.next_power_of_2(k), R=r,
                                 num_warps=1 if r <= 16 else 4)
    return tokens, parents, depths, ancestors
