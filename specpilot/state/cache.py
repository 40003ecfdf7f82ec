"""One KV cache shared by all requests: a fixed slot of `max_len` positions per request.

Why fixed slots rather than paged blocks: a request's K/V are contiguous, so attention needs only a
slot id and a length (no block tables), rollback after a rejected draft is just a shorter length, and
CUDA graphs see the same addressing for every batch. The price is memory reserved up to `max_len` per
running request; `num_slots * max_len` is sized from the memory budget at start (engine/memory.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from specpilot.kernels.kv_compact import compact_accepted


class CacheState(Protocol):
    """What the speculative step needs of a request's cached state, whatever holds it (this slot cache
    today; a paged cache or a recurrent state later): slots to run requests in, and the commit of a
    verify pass's accepted draft nodes (a chain's are in place already; a tree's move)."""

    num_slots: int
    max_len: int
    scratch_slot: int

    @property
    def num_free(self) -> int: ...

    def allocate(self) -> int: ...

    def free(self, slot: int) -> None: ...

    def commit_accepted(self, base: torch.Tensor, counts: torch.Tensor, nodes: torch.Tensor) -> None: ...

    def copy_prefix(self, src: int, dst: int, length: int) -> None: ...


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (2, num_layers, num_slots + 1, max_len, num_kv_heads, head_dim)  # + a scratch slot for graph padding
        # one tensor for all K and V, so moving rows (tree verification) is one launch over every plane
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.k, self.v = list(self.kv[0].unbind(0)), list(self.kv[1].unbind(0))  # contiguous per-layer views
        self.num_slots = num_slots
        self.max_len = max_len
        self.scratch_slot = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("KV cache full: no free slot")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Slot dst's first `length` positions become slot src's, in every layer (one launch): samples of one
        prompt share its prefill."""
        self.kv[:, :, dst, :length] = self.kv[:, :, src, :length]

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] stored at flat rows (slot * max_len + position)."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, rows, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, rows, v)

    def commit_accepted(self, base: torch.Tensor, counts: torch.Tensor, nodes: torch.Tensor) -> None:
        """Tree verification: in every layer, request i's accepted draft nodes (`nodes[i, 1:counts[i]]`,
        one per depth) move from flat row base[i] + node to base[i] + depth (flat rows: slot * max_len +
        position; base[i]: its newest committed token's row). Device-side, one launch on CUDA."""
        planes = self.kv.shape[0] * self.kv.shape[1]
        flat = self.kv.view(planes, self.kv.shape[2] * self.kv.shape[3], -1)
        compact_accepted(flat, base, counts, nodes)
