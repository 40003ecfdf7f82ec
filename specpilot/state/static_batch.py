"""The fixed input buffers a CUDA graph reads: one forward batch of up to `max_b` requests x `q` tokens.

A graph is captured per batch-size bucket, and every bucket's batch is a prefix view of the same
buffers, so one fill serves whichever bucket runs. Rows past the real requests point at the scratch
slot: a smaller batch in a larger bucket never writes into live requests' K/V. The target's runner
fills them from the host (one copy from pinned memory); the drafter's graphs lay them out on the device, and
under `overlap` the decode inputs move on there (`advance`, `keep`: engine/ahead.py).
"""

from __future__ import annotations

import numpy as np
import torch

from specpilot.state.batch import ForwardBatch
from specpilot.state.tree import chain_layout


def _even(n: int) -> int:
    """A field width that starts the next int64 field on a 16-byte boundary: Triton specialises a kernel on its pointer
    arguments' alignment, so a field after an odd width would compile another variant of every kernel reading it
    (an eager pass's inputs are sized to its request count, and a batch's tail meets odd counts mid-run)."""
    return n + n % 2


class StaticBatch:
    def __init__(self, max_b: int, q: int, device: torch.device, scratch_slot: int, max_len: int,
                 causal: bool = True, tree: bool = False) -> None:
        max_b = _even(max_b)  # the extra row, if any, is a padding row like those of a smaller batch
        self.max_b, self.q, self.scratch, self.max_len, self.causal = max_b, q, scratch_slot, max_len, causal
        n = self.n = max_b * q
        # ids, positions, cache rows (n each), then slots, q_lens, kv_lens (max_b each): one buffer, one copy
        self.dev = torch.zeros(3 * n + 3 * max_b, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.write_index, self.slot_ids, self.q_lens, self.kv_lens = \
            self.dev.split([n, n, n, max_b, max_b, max_b])
        self.q_lens.fill_(q)
        self.q_starts = torch.arange(0, n, q, dtype=torch.int32, device=device)
        self.host: torch.Tensor | None = None  # pinned, on the first host fill
        self._views: list[np.ndarray] = []  # the host buffer's ids, positions, ... as arrays (sharing its memory)
        self._offsets = np.arange(q, dtype=np.int64)  # a token's position in its request's q
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
        # q = 1 (decode): the buffer as its six fields' rows, and the values a padding row holds after a fill
        self._fields = self.dev.view(6, max_b) if q == 1 else None
        self._padding = torch.tensor([0, 0, scratch_slot * max_len, scratch_slot, q, q], device=device) if q == 1 \
            else None

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
        if self.host is None:
            self.host = torch.zeros(self.dev.shape, dtype=torch.int64, pin_memory=self.dev.is_cuda)
            self.host.copy_(self.dev)
            n, m = self.n, self.max_b
            self._views = [v.numpy() for v in self.host.split([n, n, n, m, m, m])]
        # numpy writes into the pinned buffer's views: a few array operations whatever the batch (values built as
        # Python lists, then one tensor, cost a step's largest host time at large batches), then one copy
        q, k = self.q, len(slots)
        ids, pos, writes = (v[: b * q].reshape(b, q) for v in self._views[:3])
        slot_ids, q_lens, kv_lens = (v[:b] for v in self._views[3:])
        ids[:k] = token_lists
        ids[k:] = 0
        slot_ids[:k] = slots
        slot_ids[k:] = self.scratch
        kv_lens[:k] = start_lens
        kv_lens[k:] = 0
        np.add(kv_lens[:, None], self._offsets, out=pos)
        np.add(pos, slot_ids[:, None] * self.max_len, out=writes)
        kv_lens += q
        q_lens[:] = q
        self.dev.copy_(self.host, non_blocking=self.dev.is_cuda)
        if self.tree_mask is not None:
            self.tree_mask.copy_(self.chain[0])
            self.tree_parents.copy_(self.chain[1])
        self.fills += 1

    def advance(self, n: int, tokens: torch.Tensor) -> None:
        """Decode inputs (q = 1), on the device: the first n requests take `tokens` ([n]) one position further, as a
        host fill of their next tokens would lay them out."""
        self.input_ids[:n].copy_(tokens)
        self._fields[1:3, :n] += 1  # positions and cache rows
        self.kv_lens[:n] += 1

    def keep(self, rows: torch.Tensor | None, n: int, of: int) -> None:
        """Decode inputs (q = 1) of `of` requests, on the device: those of `rows` ([n]; None: the first n) move to the
        front in that order, and the rest up to `of` aim at the scratch slot as a fill's padding does."""
        if rows is not None:
            self._fields[:, :n] = self._fields.index_select(1, rows)
        if of > n:
            self._fields[:, n:of] = self._padding[:, None]


class RaggedStaticBatch:
    """A ragged pass's graph inputs: up to `max_b` requests of 1..q tokens each, packed without padding between
    them into up to `max_t` rows — a ragged verify's (`ragged`, `verify`) or a graphed prefill's (q = max_t). A
    graph is captured per (batch bucket, token bucket) over prefix views; a fill packs the requests first, then
    rows past their tokens aim at the scratch slot and belong to no request, and bucket requests past the real
    ones own no rows (q_len 0): the kernels skip them, and what the unowned rows compute stays in those rows."""

    def __init__(self, max_b: int, max_t: int, q: int, device: torch.device, scratch_slot: int, max_len: int,
                 spare_len: int, verify: bool = True) -> None:
        """`spare_len`: the positions the unowned rows cycle through (within the rotary table's)."""
        max_b, max_t = _even(max_b), _even(max_t)
        self.max_b, self.max_t, self.q, self.scratch, self.max_len = max_b, max_t, q, scratch_slot, max_len
        self.spare_len, self.verify = min(spare_len, max_len), verify
        # ids, positions, cache rows (max_t each), then slots, row starts, q_lens, kv_lens (max_b each)
        self.dev = torch.zeros(3 * max_t + 4 * max_b, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.write_index, self.slot_ids, self.q_starts, self.q_lens, self.kv_lens = \
            self.dev.split([max_t] * 3 + [max_b] * 4)
        # until a fill, no request owns a row and every row aims at the scratch slot
        rows = torch.arange(max_t, device=device) % self.spare_len
        self.positions.copy_(rows)
        self.write_index.copy_(scratch_slot * max_len + rows)
        self.slot_ids.fill_(scratch_slot)
        self.host: torch.Tensor | None = None  # pinned, on the first fill

    def batch(self, b: int, t: int, num_kv_splits: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:t], positions=self.positions[:t], write_index=self.write_index[:t],
            slot_ids=self.slot_ids[:b], q_starts=self.q_starts[:b], q_lens=self.q_lens[:b], kv_lens=self.kv_lens[:b],
            # no request holds more than the bucket's rows: a prefill bucket's attention launches for those, not max_t
            max_q_len=min(self.q, t), num_kv_splits=num_kv_splits, verify=self.verify,
        )

    def fill(self, slots: list[int], start_lens: list[int], token_lists: list[list[int]], b: int, t: int) -> None:
        """From the host: request i appends token_lists[i] (1..q tokens) at start_lens[i], in a bucket of b
        requests and t rows."""
        k = len(slots)
        lens = np.fromiter(map(len, token_lists), dtype=np.int64, count=k)
        total = int(lens.sum())
        if k > b or total > t or (k and not 1 <= lens.min() <= lens.max() <= self.q):
            raise ValueError(f"a ragged bucket of {b} requests x {t} rows (1..{self.q} each) cannot take "
                             f"{k} requests of {total} rows")
        if self.host is None:
            self.host = torch.zeros(self.dev.shape, dtype=torch.int64, pin_memory=self.dev.is_cuda)
            self.host.copy_(self.dev)
        ids, pos, writes, slot_ids, q_starts, q_lens, kv_lens = (
            v.numpy() for v in self.host.split([self.max_t] * 3 + [self.max_b] * 4))
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]) if k else lens
        ids[:total] = np.fromiter((x for tokens in token_lists for x in tokens), dtype=np.int64, count=total)
        ids[total:t] = 0
        pos[:total] = np.arange(total) + np.repeat(np.asarray(start_lens, dtype=np.int64) - starts, lens)
        pos[total:t] = np.arange(total, t) % self.spare_len
        slot_ids[:k] = slots
        slot_ids[k:b] = self.scratch
        writes[:total] = pos[:total] + np.repeat(np.asarray(slots, dtype=np.int64) * self.max_len, lens)
        writes[total:t] = pos[total:t] + self.scratch * self.max_len
        q_starts[:k] = starts
        q_starts[k:b] = total
        q_lens[:k] = lens
        q_lens[k:b] = 0
        kv_lens[:k] = np.asarray(start_lens, dtype=np.int64) + lens
        kv_lens[k:b] = 0
        self.dev.copy_(self.host, non_blocking=self.dev.is_cuda)

    def lay_out(self, slots: torch.Tensor, starts: torch.Tensor, firsts: torch.Tensor, drafts: torch.Tensor,
                lengths: torch.Tensor, b: int, t: int) -> None:
        """`fill`'s layout made on the device (nothing waits for the host): request i ([n] tensors) appends its
        newest token firsts[i] and its first lengths[i] drafts (drafts [n, K], lengths <= K, 1 + sum(lengths) <= t)
        at starts[i], in a bucket of b requests and t rows."""
        n, k = drafts.shape
        dev = drafts.device
        q_lens = lengths.long() + 1
        ends = q_lens.cumsum(0)
        q_starts = ends - q_lens
        rows = torch.arange(t, device=dev)
        req = torch.searchsorted(ends, rows, right=True)  # each row's request; n past the last
        owned = req < n
        r = req.clamp(max=n - 1)
        j = rows - q_starts[r]  # the row's place in its request's block
        token = torch.where(j == 0, firsts[r], drafts[r, (j - 1).clamp(0, k - 1)])
        spare = rows % self.spare_len
        position = torch.where(owned, starts[r] + j, spare)
        self.input_ids[:t].copy_(torch.where(owned, token, 0))
        self.positions[:t].copy_(position)
        self.write_index[:t].copy_(torch.where(owned, slots[r], self.scratch) * self.max_len + position)
        pad = b - n
        self.slot_ids[:b].copy_(torch.cat([slots, slots.new_full((pad,), self.scratch)]))
        self.q_starts[:b].copy_(torch.cat([q_starts, ends[-1:].expand(pad)]))
        self.q_lens[:b].copy_(torch.cat([q_lens, q_lens.new_zeros(pad)]))
        self.kv_lens[:b].copy_(torch.cat([starts + q_lens, q_lens.new_zeros(pad)]))

