"""Moving a draft tree's accepted nodes' K/V to the positions they now hold, in every layer, in one launch.

Why: after tree verification request i's accepted nodes ``nodes[i, 1:counts[i]]`` (increasing, one per
depth) sit at cache rows ``base[i] + node``; the committed sequence needs them at ``base[i] + depth``.
As torch ops this is a gather of those rows from every layer's K and V and a scatter back (two kernels,
about 15 us per step on an H200 for one request); here one program per (request, K-or-V layer plane)
copies its rows in depth order.

In-place safety without a staging buffer: the node at depth d is >= d and nodes increase along the
path, so in ascending depth order no row is written before every read of it is done (the write at
``base + d`` can only hit the source of an earlier depth).

``kv`` is the cache's single tensor viewed as ``[planes, rows, width]`` (planes = K and V of every
layer, rows = slot * max_len + position, width = kv heads x head dim). Over a page pool, ``base`` and the
rows it names stay slot rows, and ``page_table`` (the cache's, flattened: entry ``r // page`` is the page
of slot row ``r``) maps each to ``page * page_size + r % page_size`` of ``kv``'s pages. Entry points:
``compact_accepted_reference`` (torch; CPU), ``compact_accepted_triton`` (CUDA), ``compact_accepted``.
No host sync, grid fixed by shapes: graph-capturable.
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_support import pick_backend, require_triton, tl, triton

__all__ = ["compact_accepted", "compact_accepted_reference", "compact_accepted_triton", "physical_rows"]


def physical_rows(rows: torch.Tensor, page_table: torch.Tensor | None, page_size: int) -> torch.Tensor:
    """Slot rows (slot * max_len + position) as rows of the pool `page_table` (flat) maps them into."""
    if page_table is None:
        return rows
    return page_table[rows // page_size].long() * page_size + rows % page_size


def compact_accepted_reference(kv: torch.Tensor, base: torch.Tensor, counts: torch.Tensor, nodes: torch.Tensor,
                               page_table: torch.Tensor | None = None, page_size: int = 1) -> None:
    depth = torch.arange(1, nodes.shape[1], device=nodes.device)
    dst = base[:, None] + depth
    src = torch.where(depth < counts[:, None], base[:, None] + nodes[:, 1:], dst)  # the rest onto themselves
    dst, src = (physical_rows(r.flatten(), page_table, page_size) for r in (dst, src))
    kv.index_copy_(1, dst, kv.index_select(1, src))


if triton is not None:

    @triton.jit
    def _physical_row(row, table_ptr, PAGE: tl.constexpr, PAGED: tl.constexpr):
        if PAGED:
            return tl.load(table_ptr + row // PAGE).to(tl.int64) * PAGE + row % PAGE
        return row

    @triton.jit
    def _compact_accepted_kernel(kv_ptr, stride_plane, stride_row, base_ptr, stride_base, counts_ptr, stride_counts,
                                 nodes_ptr, stride_nodes, table_ptr, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
                                 PAGE: tl.constexpr, PAGED: tl.constexpr):
        i = tl.program_id(0)
        plane = kv_ptr + tl.program_id(1).to(tl.int64) * stride_plane
        base = tl.load(base_ptr + i * stride_base).to(tl.int64)
        count = tl.load(counts_ptr + i * stride_counts).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        for d in range(1, count):
            node = tl.load(nodes_ptr + i * stride_nodes + d).to(tl.int64)
            src = _physical_row(base + node, table_ptr, PAGE, PAGED)
            dst = _physical_row(base + d, table_ptr, PAGE, PAGED)
            for c in range(0, WIDTH, BLOCK):
                m = c + cols < WIDTH
                row = tl.load(plane + src * stride_row + c + cols, mask=m)
                tl.store(plane + dst * stride_row + c + cols, row, mask=m)
            tl.debug_barrier()  # this depth's write lands before a later depth's reads


def compact_accepted_triton(kv: torch.Tensor, base: torch.Tensor, counts: torch.Tensor, nodes: torch.Tensor,
                            page_table: torch.Tensor | None = None, page_size: int = 1) -> None:
    require_triton("compact_accepted_triton")
    if kv.dim() != 3 or kv.stride(2) != 1:
        raise ValueError(f"kv must be [planes, rows, width] with contiguous rows, got {tuple(kv.shape)}")
    n = nodes.shape[0]
    if n:
        width = kv.shape[2]
        # base is a strided view in the engine (each request's first verify row)
        _compact_accepted_kernel[(n, kv.shape[0])](
            kv, kv.stride(0), kv.stride(1), base, base.stride(0), counts, counts.stride(0), nodes, nodes.stride(0),
            base if page_table is None else page_table,  # a placeholder pointer without PAGED
            WIDTH=width, BLOCK=min(triton.next_power_of_2(width), 1024), PAGE=page_size, PAGED=page_table is not None,
            num_warps=1 if width <= 256 else 4)


def compact_accepted(kv: torch.Tensor, base: torch.Tensor, counts: torch.Tensor, nodes: torch.Tensor,
                     page_table: torch.Tensor | None = None, page_size: int = 1, backend: str = "auto") -> None:
    """In place: request i's accepted nodes' rows move from base[i] + node to base[i] + depth, in every plane
    (slot rows, through `page_table` where one is given)."""
    if pick_backend(backend, kv) == "triton":
        compact_accepted_triton(kv, base, counts, nodes, page_table, page_size)
    else:
        compact_accepted_reference(kv, base, counts, nodes, page_table, page_size)
