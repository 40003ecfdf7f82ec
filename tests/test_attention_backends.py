"""benchmarks/gpu_attention_backends.py's inputs to FlashInfer, on CPU: its page indices and custom masks, read as
FlashInfer's docs define them, attend to what the torch reference attends to over our page table; its random
draft trees and their deepest paths are well formed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_attention_backends as bench  # noqa: E402

from specpilot.kernels.slot_attention import slot_attention_reference  # noqa: E402
from specpilot.state.tree import chain_layout  # noqa: E402

Q = bench.VERIFY_Q


def attend_as_flashinfer(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, indptr: torch.Tensor,
                         indices: torch.Tensor, last: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Request b's keys: the rows of pages indices[indptr[b]:indptr[b+1]], of the last only its first last[b];
    its mask: the next q_len x kv_len entries of the flat mask, row-major, True = attend."""
    page, group = k_pool.shape[1], q.shape[1] // k_pool.shape[2]
    out, offset = [], 0
    for b in range(len(indptr) - 1):
        pages = indices[indptr[b] : indptr[b + 1]].long()
        kv_len = (len(pages) - 1) * page + int(last[b])
        k, v = (pool[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, 1) for pool in (k_pool, v_pool))
        visible = mask[offset : offset + Q * kv_len].view(Q, kv_len)
        offset += Q * kv_len
        scores = torch.einsum("qhd,khd->hqk", q[b * Q : (b + 1) * Q], k) * scale
        out.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v))
    assert offset == mask.numel()
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["tree", "chain"])
def test_flashinfer_pages_and_mask_attend_as_the_reference(kind: str) -> None:
    torch.manual_seed(0)
    ctx = [48, 129, 100]  # kv lengths 64 (a full last page), 145 and 116 (three and two pages)
    cache, slots = bench.paged_cache(1, len(ctx), 160, 2, 8, torch.device("cpu"))
    table = cache.page_table[: len(ctx)]
    table.copy_(table.flatten()[torch.randperm(table.numel())].view_as(table))  # pages out of order
    p = bench.make_passes(cache, slots, ctx, 4, bench.random_trees(len(ctx), Q, torch.Generator().manual_seed(0)))[kind]
    b = p.batch
    kv_lens = b.kv_lens.tolist()
    indptr, indices, last = bench.flashinfer_pages(cache.page_table, b.slot_ids.tolist(), kv_lens,
                                                   cache.pages.page_size)
    assert all(t.dtype == torch.int32 for t in (indptr, indices, last))  # FlashInfer's index type
    # the chain's reference is causal: its mask from a chain's ancestor bits must be too
    bits = b.tree_mask if kind == "tree" else chain_layout(torch.zeros(len(ctx), Q - 1)).ancestors.reshape(-1)
    mask = bench.flashinfer_custom_mask(bits, Q, kv_lens)
    q, k, v = p.q.float(), cache.k[0].float(), cache.v[0].float()
    got = attend_as_flashinfer(q, k, v, indptr, indices, last, mask, p.scale)
    ref = slot_attention_reference(q, k, v, b.slot_ids, b.q_starts, b.q_lens, b.kv_lens, p.scale,
                                   tree_mask=b.tree_mask, page_table=cache.page_table)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_random_trees_and_their_deepest_paths() -> None:
    trees = bench.random_trees(64, Q, torch.Generator().manual_seed(1))
    for parents, depths, ancestors in zip(trees.parents.tolist(), trees.depths.tolist(), trees.ancestors.tolist()):
        assert ancestors[0] == 1
        for node, parent in enumerate(parents, 1):
            assert parent < node and ancestors[node] == ancestors[parent] | 1 << node
            assert depths[node - 1] == ancestors[node].bit_count() - 1
        path = bench.deepest_path(parents)
        assert path[0] == 0 and all(parents[child - 1] == parent for parent, child in zip(path, path[1:]))
        assert len(path) - 1 == max(depths)
