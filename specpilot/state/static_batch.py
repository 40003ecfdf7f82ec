"""The fixed input buffers a CUDA graph reads: one forward batch of up to `max_b` requests x `q` tokens.

A graph is captured per batch-size bucket, and every bucket's batch is a prefix view of the same
buffers, so one fill serves whichever bucket runs. Rows past the real requests point at the scratch
slot: a smaller batch in a larger bucket never writes into live requests' K/V. The target's runner
fills them from the host (one copy from pinned memory); the drafter's graphs lay them out on the device.
"""

from __future__ import annotations

import torch

from specpilot.state.batch import ForwardBatch
from specpilot.state.tree import chain_layout


class StaticBatch:
    def __init__(self, max_b: int, q: int, device: torch.device, scratch_slot: int, max_len: int,
                 causal: bool = True, tree: bool = False) -> None:
        self.max_b, self.q, self.scratch, self.max_len, self.causal = max_b, q, scratch_slot, max_len, causal
        n = self.n = max_b * q
        # ids, positions, cache rows (n each), then slots, q_lens, kv_lens (max_b each): one buffer, one copy
        self.dev = torch.zeros(3 * n + 3 * max_b, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.write_index, self.slot_ids, self.q_lens, self.kv_lens = \
            self.dev.split([n, n, n, max_b, max_b, max_b])
        self.q_lens.fill_(q)
        self.q_starts = torch.arange(0, n, q, dtype=torch.int32, device=device)
        self.host: torch.Tensor | None = None  # pinned, on the first host fill
        self._rows: dict[int, torch.Tensor] = {}
        # tree graphs: every fill restores chain masks and parents; a verify step then lays its tree over them
        self.chain = self.tree_mask = self.tree_parents = None
        if tree:
            chain = chain_layout(torch.zeros(max_b, q - 1, dtype=torch.long, device=device))
            parents = torch.nn.functional.pad(chain.parents, (1, 0))
            self.chain = torch.stack([chain.ancestors.reshape(-1), parents.reshape(-1)])
            self.tree_mask, self.tree_parents = self.chain.clone().unbind(0)
        # until a fill, every row aims at the scratch slot
        j = torch.arange(q, device=device).repeat(max_b)
        self.positions.copy_(j)
        self.write_index.copy_(scratch_slot * max_len + j)
        self.slot_ids.fill_(scratch_slot)
        self.kv_lens.fill_(q)
        self.fills = 0  # host fills so far: a layout made on the device holds until the next one

    def batch(self, b: int, num_kv_splits: int) -> ForwardBatch:
        n = b * self.q
        return ForwardBatch(
            input_ids=self.input_ids[:n], positions=self.positions[:n], write_index=self.write_index[:n],
            slot_ids=self.slot_ids[:b], q_lens=self.q_lens[:b], kv_lens=self.kv_lens[:b], q_starts=self.q_starts[:b],
            max_q_len=self.q, causal=self.causal, num_kv_splits=num_kv_splits,
            tree_mask=None if self.tree_mask is None else self.tree_mask[:n],
            tree_parents=None if self.tree_parents is None else self.tree_parents[:n],
        )

    def fill(self, slots: list[int], start_lens: list[int], token_lists: list[list[int]], b: int) -> None:
        """From the host: request i appends token_lists[i] (q tokens) at start_lens[i]; b - len(slots)
        padding rows aim at the scratch slot."""
        q, L = self.q, self.max_len
        pad = b - len(slots)
        starts = [*start_lens, *[0] * pad]
        slots_all = [*slots, *[self.scratch] * pad]
        ids = [t for toks in token_lists for t in toks] + [0] * (pad * q)
        pos = [s + i for s in starts for i in range(q)]
        writes = [slot * L + p for slot, s in zip(slots_all, starts) for p in range(s, s + q)]
        # one host tensor and one indexed write into the pinned buffer (small tensors cost more to make
        # than to fill: this was the largest host cost of a speculative step)
        if self.host is None:
            self.host = torch.zeros(self.dev.shape, dtype=torch.int64, pin_memory=self.dev.is_cuda)
            self.host.copy_(self.dev)
        values = torch.tensor(ids + pos + writes + slots_all + [q] * b + [s + q for s in starts])
        self.host.index_copy_(0, self._bucket_rows(b), values)
        self.dev.copy_(self.host, non_blocking=self.dev.is_cuda)
        if self.tree_mask is not None:
            self.tree_mask.copy_(self.chain[0])
            self.tree_parents.copy_(self.chain[1])
        self.fills += 1

    def _bucket_rows(self, b: int) -> torch.Tensor:
        """Where a bucket of b requests' values go in the buffer."""
        rows = self._rows.get(b)
        if rows is None:
            n, m, q = self.n, self.max_b, self.q
            spans = ((0, b * q), (n, b * q), (2 * n, b * q), (3 * n, b), (3 * n + m, b), (3 * n + 2 * m, b))
            rows = self._rows[b] = torch.cat([torch.arange(start, start + size) for start, size in spans])
        return rows
