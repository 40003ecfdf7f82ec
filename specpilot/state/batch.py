"""The description of one forward pass over many requests (prefill, decode or verify)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain
from operator import add
from typing import TYPE_CHECKING

import numpy as np
import torch

from specpilot.state.transfer import host_tensor

if TYPE_CHECKING:
    from specpilot.state.tree import TreeLayout


@dataclass
class ForwardBatch:
    """Flat, ragged tokens of B requests; request b's tokens are rows q_starts[b] : q_starts[b] + q_lens[b].

    Their K/V go to cache rows `write_index` (slot * max_len + position) before attention, so after the
    write request b's slot holds kv_lens[b] tokens and its i-th new token sits at kv_lens[b] - q_lens[b] + i.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    write_index: torch.Tensor  # [T] int64
    slot_ids: torch.Tensor  # [B] int32
    q_starts: torch.Tensor  # [B] int32
    q_lens: torch.Tensor  # [B] int32
    kv_lens: torch.Tensor  # [B] int32
    max_q_len: int
    causal: bool = True  # False: every new token sees the whole new block (block drafters)
    num_kv_splits: int = 1
    # Tree verification: [T] int64, per token the bit set of its request's new tokens it may see (its
    # ancestors and itself, draft_tree.TreeLayout.ancestors); replaces `causal` within the new block.
    tree_mask: torch.Tensor | None = None
    tree_parents: torch.Tensor | None = None  # [T] int64: each draft node's parent node (row 0's: 0)
    # [T, TREE_TABLE_KEYS] int32: the batch-invariant kernel's tree table (slot_attention.tree_tail_rows), derived
    # from positions and tree_mask by the model once per pass for all its layers
    tail_rows: torch.Tensor | None = None
    verify: bool = False  # a speculative verify: a hybrid target writes no recurrent state before the commit

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def batch_size(self) -> int:
        return self.slot_ids.shape[0]

    def place_tree(self, tree: TreeLayout) -> None:
        """Lay a draft tree over a verify batch of n requests x q tokens (node 0 = each request's newest
        token, then its q - 1 draft nodes): nodes keep their own cache rows, but sit at position
        committed length + depth, and see only their ancestors. Device-side, in place."""
        n, q = tree.ancestors.shape
        pos = self.positions[: n * q].view(n, q)
        pos[:, 1:] = pos[:, :1] + tree.depths
        self.tree_mask[: n * q].copy_(tree.ancestors.reshape(-1))
        self.tree_parents[: n * q].view(n, q)[:, 1:] = tree.parents

    @classmethod
    def build(cls, slots: list[int], start_lens: list[int], token_lists: list[list[int]], max_len: int,
              device: torch.device, causal: bool = True) -> ForwardBatch:
        """Request b appends token_lists[b] to its slot, whose first start_lens[b] positions are kept."""
        if not (len(slots) == len(start_lens) == len(token_lists)):
            raise ValueError("slots, start_lens and token_lists must have one entry per request")
        q_lens = [len(t) for t in token_lists]
        for start, n in zip(start_lens, q_lens):
            if not n:
                raise ValueError("every request in a forward pass needs at least one new token")
            if start + n > max_len:
                raise ValueError(f"request needs {start + n} cache positions; the slot holds {max_len}")
        q_starts = [0, *accumulate(q_lens)][:-1]
        # numpy over the flat tokens (a prefill's thousands of positions as Python ints cost milliseconds): token
        # t of request b sits at start_lens[b] + t - q_starts[b]
        lens = np.array(q_lens, dtype=np.int64)
        positions = np.arange(lens.sum(), dtype=np.int64) + np.repeat(
            np.subtract(start_lens, q_starts, dtype=np.int64), lens)
        writes = positions + np.repeat(np.multiply(slots, max_len, dtype=np.int64), lens)

        def on_device(host: torch.Tensor) -> torch.Tensor:
            return host.to(device, non_blocking=True)

        return cls(
            input_ids=on_device(host_tensor(chain.from_iterable(token_lists))),
            positions=on_device(torch.from_numpy(positions)),
            write_index=on_device(torch.from_numpy(writes)),
            slot_ids=on_device(host_tensor(slots, torch.int32)),
            q_starts=on_device(host_tensor(q_starts, torch.int32)),
            q_lens=on_device(host_tensor(q_lens, torch.int32)),
            kv_lens=on_device(host_tensor(map(add, start_lens, q_lens), torch.int32)),
            max_q_len=max(q_lens),
            causal=causal,
        )
