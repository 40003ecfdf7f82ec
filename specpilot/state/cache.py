"""One KV cache shared by all requests: a pool of pages that request slots address through a page table.

A request's positions sit in its slot (slot rows: slot * max_len + position, as the engine computes them);
the pages behind them come from one PageTable (state/pages.py) that every cache of an engine reads, so the
target's cache and its drafter's hold the same positions in the same page numbers. Attention reads keys
through the table; writes and tree compaction map slot rows to pool rows once per pass.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch

from specpilot.kernels.kv_compact import compact_accepted
from specpilot.state.batch import ForwardBatch
from specpilot.state.pages import PAGE_SIZE, PageTable


class CacheState(Protocol):
    """What the speculative step needs of a request's cached state, whatever holds it (this paged cache
    today; a recurrent state later): slots to run requests in, and the commit of a verify pass's accepted
    draft nodes (a chain's are in place already; a tree's move)."""

    num_slots: int
    max_len: int
    scratch_slot: int

    @property
    def num_free(self) -> int: ...

    def can_hold(self, length: int, share: tuple[int, int] | None = None) -> bool: ...

    def allocate(self, length: int | None = None, share: tuple[int, int] | None = None) -> int: ...

    def free(self, slot: int) -> None: ...

    def commit_accepted(self, base: torch.Tensor, counts: torch.Tensor, nodes: torch.Tensor) -> None: ...

    def copy_prefix(self, src: int, dst: int, length: int) -> None: ...

    def commit_paths(self, slots: list[int], paths: list[list[int]]) -> None: ...


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, pages: PageTable) -> None:
        self.pages = pages
        device = pages.table.device
        # + the scratch page; one tensor for all K and V, so moving rows (tree verification) is one launch
        shape = (2, num_layers, pages.num_pages + 1, pages.page_size, num_kv_heads, head_dim)
        # On the host, uninitialised: the system commits a page of the pool when a request first writes it, so
        # the process holds what its requests use (nothing reads a position before it is written: attention
        # reads a slot's first kv_len positions only, and graph padding runs on CUDA)
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        self.kv = alloc(shape, dtype=dtype, device=device)
        self.k, self.v = list(self.kv[0].unbind(0)), list(self.kv[1].unbind(0))  # contiguous per-layer views
        self.num_slots, self.max_len, self.scratch_slot = pages.num_slots, pages.max_len, pages.scratch_slot

    @classmethod
    def whole_slots(cls, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, device: torch.device, page_size: int = PAGE_SIZE) -> KVCache:
        """A cache of its own table, whose pool holds every slot's max_len positions."""
        return cls(num_layers, num_kv_heads, head_dim, dtype, PageTable(num_slots, max_len, None, device, page_size))

    @property
    def page_table(self) -> torch.Tensor:
        return self.pages.table

    @property
    def pool_tokens(self) -> int:
        return self.pages.num_pages * self.pages.page_size

    @property
    def num_free(self) -> int:
        return self.pages.num_free

    def can_hold(self, length: int, share: tuple[int, int] | None = None) -> bool:
        return self.pages.can_hold(length, share)

    def allocate(self, length: int | None = None, share: tuple[int, int] | None = None) -> int:
        return self.pages.allocate(length, share)

    def free(self, slot: int) -> None:
        self.pages.free(slot)

    def paged(self, batch: ForwardBatch) -> ForwardBatch:
        """`batch` with its K/V writes at pool rows (a pass's layers share the mapping)."""
        return replace(batch, write_index=self.pages.physical(batch.write_index))

    def _rows(self) -> torch.Tensor:
        """Every plane's pool rows: [2 * layers, pages * page_size, kv heads * head dim]."""
        return self.kv.view(self.kv.shape[0] * self.kv.shape[1], self.kv.shape[2] * self.kv.shape[3], -1)

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [length, kv heads, head dim] of a slot's first `length` positions."""
        rows = self.pages.physical(torch.arange(length, device=self.kv.device) + slot * self.max_len)
        flat_k, flat_v = (t.view(-1, *t.shape[2:]) for t in (self.k[layer], self.v[layer]))
        return flat_k[rows], flat_v[rows]

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Slot dst's first `length` positions become slot src's, in every layer (one launch): samples of one
        prompt share its prefill. Pages the slots share already hold them."""
        span = torch.arange(length, device=self.kv.device)
        src_rows, dst_rows = (self.pages.physical(span + s * self.max_len) for s in (src, dst))
        apart = src_rows != dst_rows
        rows = self._rows()
        rows.index_copy_(1, dst_rows[apart], rows.index_select(1, src_rows[apart]))

    def commit_paths(self, slots: list[int], paths: list[list[int]]) -> None:
        """After a verify, request slots[i] keeps the verify rows paths[i] (0, then its accepted draft nodes).
        K/V need nothing more (a chain's rows are in place, a tree's were moved by commit_accepted); a hybrid
        target's cache commits its recurrent state here."""

    def commit_accepted(self, base: torch.Tensor, counts: torch.Tensor, nodes: torch.Tensor) -> None:
        """Tree verification: in every layer, request i's accepted draft nodes (`nodes[i, 1:counts[i]]`,
        one per depth) move from slot row base[i] + node to base[i] + depth (slot rows: slot * max_len +
        position; base[i]: its newest committed token's row). Device-side, one launch on CUDA."""
        compact_accepted(self._rows(), base, counts, nodes, self.pages.flat, self.pages.page_size)
