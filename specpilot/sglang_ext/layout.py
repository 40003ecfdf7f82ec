"""Our drafts as SGLang's verify inputs.

SGLang verifies a request's block of D = K + 1 tokens (its newest committed token, then K drafts) in one
TARGET_VERIFY pass and reads the block's tree from these tensors (speculative/eagle_utils.py
build_tree_kernel_efficient, ngram_worker.py, ngram_info.py):

- draft_token [bs * D]: per request its newest committed token, then its draft nodes in node order;
- custom_mask, bool, flat: whether a block row attends to a key. FULL_MASK: per request D rows of
  (seq_len + D) keys, the context's all True; QLEN_ONLY: per request D rows of the D block keys alone;
- positions [bs * D]: seq_len + the node's depth;
- retrieve_index [bs, D]: each node's flat row, b * D + node;
- retrieve_next_token / retrieve_next_sibling [bs, D]: a node's first child and its next younger sibling
  (-1: none), children in node order: the links SGLang's verify kernels walk.

Beside them, for verifying with decode rows (decode_rows.py): each node's depth [bs, D] and whether a node is
a row's ancestor or the row itself [bs, D, D].

seq_len is what SGLang's batch.seq_lens holds at a decode step: the tokens already in the target's cache,
all but the newest committed one, which the block's row 0 writes. Our TreeLayout (state/tree.py) holds the
same tree as parents, depths and ancestor bit sets with node 0 the newest committed token, so the
conversion is index arithmetic of fixed shapes on the drafts' device: no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.state.tree import TreeLayout, chain_layout


@dataclass
class VerifyTensors:
    draft_token: torch.Tensor
    custom_mask: torch.Tensor
    positions: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor

    @property
    def draft_token_num(self) -> int:
        return self.retrieve_index.shape[1]


def verify_tensors(newest: torch.Tensor, drafts: torch.Tensor, tree: TreeLayout | None, seq_lens: torch.Tensor,
                   seq_lens_sum: int | None = None) -> VerifyTensors:
    """`newest` [bs] each request's newest committed token, `drafts` [bs, K] its draft nodes, `tree` how they
    hang together (None: a chain), `seq_lens` [bs] the tokens in the target's cache. FULL_MASK with
    `seq_lens_sum` (their sum, which SGLang keeps on the host as batch.seq_lens_sum), else QLEN_ONLY."""
    layout = chain_layout(drafts) if tree is None else tree
    bs, k = drafts.shape
    d = k + 1
    device = drafts.device
    nodes = torch.arange(d, device=device)
    seq_lens = seq_lens.to(device=device, dtype=torch.int64)
    block = ((layout.ancestors[:, :, None] >> nodes) & 1).bool()  # [bs, row, key]: key is the row or its ancestor
    next_token, next_sibling = tree_links(layout.parents)
    depths = torch.cat([torch.zeros_like(layout.depths[:, :1]), layout.depths], 1).long()
    return VerifyTensors(
        draft_token=torch.cat([newest.to(device)[:, None], drafts], 1).long().flatten(),
        custom_mask=block.flatten() if seq_lens_sum is None else _full_mask(block, seq_lens, seq_lens_sum),
        positions=(seq_lens[:, None] + depths).flatten(),
        retrieve_index=torch.arange(bs * d, device=device).view(bs, d),
        retrieve_next_token=next_token,
        retrieve_next_sibling=next_sibling,
        depths=depths,
        ancestors=block,
    )


def tree_links(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[bs, K] the parents of draft nodes 1..K -> (retrieve_next_token, retrieve_next_sibling) [bs, K + 1]:
    each node's first child and its next younger sibling in node order, -1 for none."""
    bs, k = parents.shape
    d = k + 1
    nodes = torch.arange(d, device=parents.device)
    parent = torch.cat([parents.new_full((bs, 1), -1), parents], 1).long()  # the root's: -1, no node
    child = parent[:, None, :] == nodes[:, None]  # [bs, p, j]: j is a child of p
    younger = (parent[:, :, None] == parent[:, None, :]) & (nodes[:, None] < nodes) & (parent >= 0)[:, :, None]
    first_child = torch.where(child, nodes, d).min(-1).values
    next_sibling = torch.where(younger, nodes, d).min(-1).values  # [bs, j]: the first younger k of j's parent
    return first_child.masked_fill(first_child == d, -1), next_sibling.masked_fill(next_sibling == d, -1)


def _full_mask(block: torch.Tensor, seq_lens: torch.Tensor, seq_lens_sum: int) -> torch.Tensor:
    """QLEN_ONLY's [bs, D, D] block keys placed in FULL_MASK's rows of seq_len + D keys, whose context part
    is all True."""
    bs, d, _ = block.shape
    nodes = torch.arange(d, device=block.device)
    start = d * d * torch.arange(bs, device=block.device) + d * (seq_lens.cumsum(0) - seq_lens)  # each request's
    first_key = start[:, None] + (seq_lens[:, None] + d) * nodes + seq_lens[:, None]  # [bs, row]: its block key 0
    mask = torch.ones(seq_lens_sum * d + bs * d * d, dtype=torch.bool, device=block.device)
    mask[(first_key[:, :, None] + nodes).flatten()] = block.flatten()
    return mask
