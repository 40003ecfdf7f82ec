"""Greedy acceptance of draft trees: which drafted nodes the target's argmax confirms, for every request
at once, on the device.

Why: written as torch ops the walk is ~20 kernels of a few microseconds each per speculative step
(gathers, shifts, a max, a sort); here it is one program per request over the tree's nodes.

Inputs per request (rows; q = nodes including the root, at most 64): ``argmax`` [n, q] the target's
argmax at each node; ``drafts``, ``parents``, ``depths`` [n, q - 1] of draft nodes 1 .. q - 1 (parents
come before children); ``ancestors`` [n, q] int64 bit sets (a node's ancestors and itself, the root's
bit 0). A draft node is accepted when it and every ancestor equal their parents' argmax; siblings are
distinct, so the accepted nodes are one path, the deepest accepted node's lineage.

Outputs: ``counts`` [n] tokens to commit (accepted nodes + the bonus), ``nodes`` [n, q] the verify
rows that decided them (0, then the accepted nodes in depth order; 0 past counts) and ``tokens``
[n, q] the committed tokens (the argmax at those rows).

Three entry points share this contract: ``tree_accept_reference`` (plain torch; CPU),
``tree_accept_triton`` (one launch; CUDA) and the dispatcher ``tree_accept``. No host sync; graph-capturable.
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_support import pick_backend, require_triton, tl, triton

__all__ = ["tree_accept", "tree_accept_reference", "tree_accept_triton"]

MAX_NODES = 64  # one int64 of ancestor bits per node


def _check(argmax: torch.Tensor, drafts: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
           ancestors: torch.Tensor) -> None:
    if argmax.dim() != 2 or not 2 <= argmax.shape[1] <= MAX_NODES:
        raise ValueError(f"argmax must be [n, q] with 2 <= q <= {MAX_NODES}, got {tuple(argmax.shape)}")
    n, q = argmax.shape
    for t, name, width in ((drafts, "drafts", q - 1), (parents, "parents", q - 1), (depths, "depths", q - 1),
                           (ancestors, "ancestors", q)):
        if tuple(t.shape) != (n, width):
            raise ValueError(f"{name} must be [{n}, {width}], got {tuple(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if ancestors.dtype != torch.int64:
        raise TypeError(f"ancestors must be int64 bit sets, got {ancestors.dtype}")


def tree_accept_reference(argmax: torch.Tensor, drafts: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                          ancestors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(argmax, drafts, parents, depths, ancestors)
    n, q = argmax.shape
    steps = torch.arange(1, q, device=argmax.device)
    matched = drafts == argmax.gather(1, parents.long())
    bits = (matched.long() << steps).sum(1, keepdim=True) + 1  # node j's bit (the root's: 1)
    whole = (ancestors[:, 1:] & ~bits) == 0  # every node on its lineage matched
    depth, best = torch.where(whole, depths.long(), 0).max(1)
    lineage = ancestors.gather(1, torch.where(depth > 0, best + 1, 0)[:, None])
    on_path = ((lineage >> steps) & 1).bool()
    # the lineage's nodes in index order are in depth order (parents come first): sort them first
    ordered = torch.where(on_path, steps, q + steps).sort(1).values
    nodes = torch.cat([torch.zeros_like(ordered[:, :1]), torch.where(ordered < q, ordered, 0)], 1)
    return depth + 1, nodes, argmax.gather(1, nodes)


if triton is not None:

    @triton.jit
    def _tree_accept_kernel(argmax_ptr, drafts_ptr, parents_ptr, depths_ptr, anc_ptr, counts_ptr, nodes_ptr,
                            tokens_ptr, s_argmax, s_drafts, s_parents, s_depths, s_anc,
                            Q: tl.constexpr, QP: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, QP)
        node = j < Q
        draft = (j >= 1) & node
        am = tl.load(argmax_ptr + r * s_argmax + j, mask=node, other=0).to(tl.int64)
        tok = tl.load(drafts_ptr + r * s_drafts + j - 1, mask=draft, other=0).to(tl.int64)
        par = tl.load(parents_ptr + r * s_parents + j - 1, mask=draft, other=0)
        par_am = tl.load(argmax_ptr + r * s_argmax + par, mask=draft, other=0).to(tl.int64)
        one = tl.full([QP], 1, tl.int64)
        bits = tl.sum(tl.where(draft & (tok == par_am), one << j.to(tl.int64), 0), 0) + 1
        anc = tl.load(anc_ptr + r * s_anc + j, mask=node, other=0)
        whole = draft & ((anc & ~bits) == 0)
        dep = tl.load(depths_ptr + r * s_depths + j - 1, mask=draft, other=0).to(tl.int64)
        depth = tl.max(tl.where(whole, dep, 0), 0)
        best = tl.max(tl.where(whole & (dep == depth), j, 0), 0)  # one accepted node per depth
        lineage = tl.sum(tl.where(j == best, anc, 0), 0)
        on = draft & (((lineage >> j.to(tl.int64)) & 1) == 1)
        pos = tl.cumsum(on.to(tl.int32), 0)  # an accepted node's place after the root: its depth
        count = depth + 1
        rest = node & ((j == 0) | (j >= count))
        tl.store(counts_ptr + r, count)
        tl.store(nodes_ptr + r * Q + j, tl.zeros([QP], tl.int64), mask=rest)
        tl.store(nodes_ptr + r * Q + pos, j.to(tl.int64), mask=on)
        tl.store(tokens_ptr + r * Q + j, tl.zeros([QP], tl.int64) + tl.sum(tl.where(j == 0, am, 0), 0), mask=rest)
        tl.store(tokens_ptr + r * Q + pos, am, mask=on)


def tree_accept_triton(argmax: torch.Tensor, drafts: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                       ancestors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    require_triton("tree_accept_triton")
    _check(argmax, drafts, parents, depths, ancestors)
    # rows may be strided (views of a verify batch); nodes must sit side by side
    argmax, drafts, parents, depths, ancestors = (t if t.stride(1) == 1 else t.contiguous()
                                                  for t in (argmax, drafts, parents, depths, ancestors))
    n, q = argmax.shape
    counts = torch.empty(n, dtype=torch.int64, device=argmax.device)
    nodes = torch.empty(n, q, dtype=torch.int64, device=argmax.device)
    tokens = torch.empty(n, q, dtype=torch.int64, device=argmax.device)
    if n:
        _tree_accept_kernel[(n,)](argmax, drafts, parents, depths, ancestors, counts, nodes, tokens,
                                  argmax.stride(0), drafts.stride(0), parents.stride(0), depths.stride(0),
                                  ancestors.stride(0), Q=q, QP=triton.next_power_of_2(q), num_warps=1)
    return counts, nodes, tokens


def tree_accept(argmax: torch.Tensor, drafts: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                ancestors: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts [n], nodes [n, q], tokens [n, q]) of the greedy walk over each request's draft tree."""
    if pick_backend(backend, argmax) == "triton":
        return tree_accept_triton(argmax, drafts, parents, depths, ancestors)
    return tree_accept_reference(argmax, drafts, parents, depths, ancestors)
