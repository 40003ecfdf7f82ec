"""Drafts a constrained request's grammar forces: where the grammar forces text (a JSON key's spelling, its
quotes and colon), constrained decoding writes it whatever the target's distribution, so its tokens are drafts
the target takes unless it spells the text otherwise — ones a drafter blind to the grammar often misses. The
propose stage puts them first in each constrained request's draft: a chain's first drafts, a tree's likeliest
path (where a node there already holds the forced token it is kept, so siblings stay distinct). Verification is
unchanged: lossless whatever the drafts."""

from __future__ import annotations

from dataclasses import replace

import torch

from specpilot.state.draft import Draft
from specpilot.state.request import Request
from specpilot.state.transfer import to_device
from specpilot.state.tree import TreeLayout


def with_forced(reqs: list[Request], draft: Draft) -> Draft:
    """`draft` with each constrained request's forced tokens (RequestGrammar.forced) drafted first; one
    asynchronous copy to the device, so the host waits for nothing."""
    k = draft.tokens.shape[1]
    forced = [[] if r.grammar is None else r.grammar.forced(k) for r in reqs]
    m = max(map(len, forced))
    if not m:
        return draft
    rows = to_device([[len(f), *f, *[-1] * (m - len(f))] for f in forced], draft.tokens.device)
    lengths, tokens = rows[:, 0], rows[:, 1:]
    if draft.tree is None:
        use = torch.arange(k, device=rows.device) < lengths[:, None]
        new = torch.where(use[:, :m], tokens, draft.tokens[:, :m])
        drafted = torch.cat([new, draft.tokens[:, m:]], 1)
        confidences = None if draft.confidences is None else torch.where(use, 1.0, draft.confidences)
        return replace(draft, tokens=drafted, confidences=confidences, bucket=None)
    tree, nodes = _forced_path(draft.tree, lengths, tokens)
    confidences = draft.confidences
    if confidences is not None:  # the path's nodes are sure (column 0 of the mask takes the path's padding)
        on_path = torch.zeros(nodes.shape[0], k + 1, dtype=torch.bool, device=nodes.device).scatter_(1, nodes, True)
        confidences = torch.where(on_path[:, 1:], 1.0, confidences)
    return replace(draft, tokens=tree.tokens, tree=tree, confidences=confidences, bucket=None)


def _forced_path(tree: TreeLayout, lengths: torch.Tensor, forced: torch.Tensor) -> tuple[TreeLayout, torch.Tensor]:
    """The tree with `forced` [n, m] (request i's first lengths[i]) on a path down from the root: at each depth, the
    child of the path's node that holds the forced token, else its first child (likeliest: nodes come parents
    first, likeliest first) takes it; the path ends where a node has no child. Returns the tree and the path's
    nodes [n, m] (1-based; 0 past its end)."""
    n, m = forced.shape
    k = tree.tokens.shape[1]
    tokens = tree.tokens.clone()
    node = torch.zeros(n, dtype=torch.long, device=tokens.device)  # the root
    alive = torch.ones(n, dtype=torch.bool, device=tokens.device)
    path = []
    columns = torch.arange(k, device=tokens.device)
    for d in range(m):
        alive = alive & (d < lengths)
        children = tree.parents == node[:, None]  # [n, k]
        holding = children & (tokens == forced[:, d : d + 1])
        # the holder if any, else the first child: the smallest column among the candidates
        pick = torch.where(holding.any(1, keepdim=True), holding, children)
        column = torch.where(pick, columns, k).amin(1)
        alive = alive & (column < k)
        column = column.clamp(max=k - 1)[:, None]
        # no boolean indexing: it would make the host wait for the device
        tokens.scatter_(1, column, torch.where(alive, forced[:, d], tokens.gather(1, column)[:, 0])[:, None])
        column = column[:, 0]
        node = torch.where(alive, column + 1, node)
        path.append(torch.where(alive, column + 1, 0))
    return replace(tree, tokens=tokens), torch.stack(path, 1)
