"""Attention over a fixed-slot KV cache.

Cache layout (one per layer): ``k_cache`` / ``v_cache`` are ``[num_slots, max_len, num_kv_heads, head_dim]``, or
with an int32 ``page_table [num_slots, pages_per_slot]`` a pool of pages ``[num_pages, page_size, num_kv_heads,
head_dim]``: position ``p`` of slot ``s`` is row ``p % page_size`` of page ``page_table[s, p // page_size]`` (looked
up per key lane, so a page may hold any slot's positions and ``max_len = pages_per_slot * page_size``).
Request ``b`` owns slot ``slot_ids[b]``; its ``kv_lens[b]`` tokens sit at positions ``0 .. kv_lens[b]-1``.
Queries are flat and ragged: request ``b`` owns rows ``q_starts[b] : q_starts[b] + q_lens[b]`` of ``q``, and
their K/V are already in the cache, so query ``i`` sits at absolute position ``kv_lens[b] - q_lens[b] + i``.
An optional int64 ``tree_mask[T]`` replaces ``causal`` for tree verification (``q_lens <= 64``): row ``i`` of
request ``b`` sees every context key (position ``< kv_lens[b] - q_lens[b]``) and block row ``j`` of the same
request iff bit ``j`` of ``tree_mask[q_starts[b] + i]`` is set (its draft-tree ancestors and itself).

Two implementations share one contract:

* :func:`slot_attention_reference` - plain torch (padded, batched SDPA); the CPU production path.
* :func:`slot_attention_triton` - a flash-attention style Triton kernel for CUDA, with optional
  flash-decoding split over the key axis.
* :func:`slot_attention_invariant` - the batch-invariant Triton kernel (the target's default on CUDA): a
  query's output is bitwise a function of its own keys, whatever the pass (prefill, decode, chain or tree
  verify) and whatever requests share it. A query at position ``p`` reads its keys ``[0, p]`` as one fixed
  sequence: tiles of ``INVARIANT_BLOCK_N`` keys at absolute offsets, grouped into partials of ``SPLIT_KEYS`` keys
  at absolute offsets, merged in key order; a tile past a row's position is masked out of it whole, which leaves
  its running softmax bit for bit as it was, so a verify's rows may share tiles their later tokens need. A tree
  node reads the tiles that hold its ancestors (those from its context length rounded down to a tile) through
  ``tree_tail_rows``: lane ``i`` of such a tile is the key its chain would have there, so the node's tiles hold
  what the decode of the same token reads. Tile heights 16 and 32 take the same MMA layout (one per row) from
  head_dim 64 up (float32, whose dots are FMA loops, and smaller heads keep 16), and no FMA contraction is
  allowed, so the split-grid and single-program forms round the same (docs/ARCHITECTURE.md, "Batch invariance").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specpilot.kernels.triton_support import (
    HAS_TRITON,
    pick_backend,
    require_triton,
    tl,
    triton,
)

__all__ = [
    "HAS_TRITON",
    "INVARIANT_BLOCK_M",
    "InvariantLaunch",
    "SPLIT_KEYS",
    "TREE_TABLE_KEYS",
    "invariant_launch",
    "kv_splits",
    "slot_attention",
    "slot_attention_invariant",
    "slot_attention_reference",
    "slot_attention_triton",
    "slot_geometry",
    "tree_tail_rows",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
MAX_TREE_Q_LEN = 64  # one int64 of visibility bits per query row
# The batch-invariant kernel's fixed reduction structure (changing either changes rounding, never what is
# computed): keys per partial and per key tile, both at absolute offsets. Its row tiles are 16 or 32 high (the
# same bits from TALL_TILE_MIN_HEAD_DIM up); a tree node's table spans the two key tiles its ancestors can reach.
SPLIT_KEYS = 256
INVARIANT_BLOCK_N = 64
INVARIANT_BLOCK_M = 16
# 32-row tiles round as 16-row ones only from this head size up: at head_dim 32 some rows differ in their last
# bits on the H100 (docs/RESULTS.md, session 30), so such heads keep 16
TALL_TILE_MIN_HEAD_DIM = 64
TREE_TABLE_KEYS = 2 * INVARIANT_BLOCK_N
INVARIANT_SPLIT_GRID_MAX_Q = 64  # passes of at most this many queries per request spread splits over programs
# The invariant kernel's launch on CUDA, by kind of pass (every choice gives the same bits; the H100 sweep of
# session 27 in docs/RESULTS.md): 16-row programs per SM from which 32-row tiles pay, and work units per SM
# (programs weighted by block_m x head_dim / (16 x 64)) under which the key splits spread over programs. Tree
# programs walk their tokens' gathered tiles one after another, so they gain from spreading longest.
_BLOCK_M32_PROGRAMS_PER_SM = {"decode": 1, "chain": 1, "tree": 3}
_SPLIT_GRID_UNITS_PER_SM = {"decode": 2, "chain": 3, "tree": 8}


# --------------------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------------------


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    page_table: torch.Tensor | None = None,
) -> None:
    """Shape/dtype/device checks that need no host sync."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_slots, max_len, num_kv_heads, head_dim], got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, cache has {k_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q dtype must be one of {_FLOAT_DTYPES}, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"dtype mismatch: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    batch = slot_ids.shape[0] if slot_ids.dim() == 1 else -1
    for t, name in ((slot_ids, "slot_ids"), (q_starts, "q_starts"), (q_lens, "q_lens"), (kv_lens, "kv_lens")):
        if t.dim() != 1 or t.shape[0] != batch:
            raise ValueError(f"{name} must be 1-D of the same length as slot_ids, got shape {tuple(t.shape)}")
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    if page_table is not None:
        if page_table.dim() != 2 or page_table.dtype != torch.int32 or not page_table.is_contiguous():
            raise ValueError(f"page_table must be contiguous int32 [num_slots, pages_per_slot], got {page_table.dtype} "
                             f"{tuple(page_table.shape)}")
        if page_table.device != q.device:
            raise ValueError(f"page_table is on {page_table.device}, q is on {q.device}")


def slot_geometry(k_cache: torch.Tensor, page_table: torch.Tensor | None) -> tuple[int, int]:
    """(num_slots, max_len) of a cache: its first two dimensions, or through its page table."""
    if page_table is None:
        return k_cache.shape[0], k_cache.shape[1]
    return page_table.shape[0], page_table.shape[1] * k_cache.shape[1]


def _check_tree_mask(tree_mask: torch.Tensor, q: torch.Tensor) -> None:
    """tree_mask must be int64 [T] on q's device (one bit set per visible block row)."""
    if not isinstance(tree_mask, torch.Tensor):
        raise TypeError(f"tree_mask must be a torch.Tensor or None, got {type(tree_mask).__name__}")
    if tree_mask.dtype != torch.int64:
        raise TypeError(f"tree_mask must be int64, got {tree_mask.dtype}")
    if tree_mask.dim() != 1 or tree_mask.shape[0] != q.shape[0]:
        raise ValueError(f"tree_mask must be 1-D with one entry per q row ({q.shape[0]}), got {tuple(tree_mask.shape)}")
    if tree_mask.device != q.device:
        raise ValueError(f"tree_mask is on {tree_mask.device}, q is on {q.device}")


def _check_tree_q_len(max_q_len: int) -> None:
    if max_q_len > MAX_TREE_Q_LEN:
        raise ValueError(f"tree_mask needs q_len <= {MAX_TREE_Q_LEN}, got max q_len {max_q_len}")


def _check_lengths(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    slot_ids: list[int],
    q_starts: list[int],
    q_lens: list[int],
    kv_lens: list[int],
    page_table: torch.Tensor | None = None,
) -> None:
    """Value checks on host copies of the metadata (the reference syncs anyway to size its batches)."""
    num_slots, max_len = slot_geometry(k_cache, page_table)
    for b, (slot, start, q_len, kv_len) in enumerate(zip(slot_ids, q_starts, q_lens, kv_lens)):
        if not 0 <= slot < num_slots:
            raise ValueError(f"request {b}: slot id {slot} out of range [0, {num_slots})")
        if not 0 <= q_len <= kv_len <= max_len:
            raise ValueError(f"request {b}: need 0 <= q_len ({q_len}) <= kv_len ({kv_len}) <= max_len ({max_len})")
        if q_len and not (0 <= start and start + q_len <= q.shape[0]):
            raise ValueError(f"request {b}: query rows [{start}, {start + q_len}) outside q's {q.shape[0]} rows")


# --------------------------------------------------------------------------------------------------------------------
# Torch reference / CPU path
# --------------------------------------------------------------------------------------------------------------------


def _bucket_by_q_len(q_lens: list[int]) -> list[list[int]]:
    """Group requests whose q_len shares a power-of-two bucket.

    One padded SDPA per bucket keeps padding waste under 2x in the query axis, so a long prompt in the same
    step as many decodes does not pad every decode up to the prompt length.
    """
    buckets: dict[int, list[int]] = {}
    for b, q_len in enumerate(q_lens):
        if q_len > 0:
            buckets.setdefault(q_len.bit_length(), []).append(b)
    return list(buckets.values())


def _attend_bucket(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    max_q: int,
    max_kv: int,
    scale: float,
    causal: bool,
    tree_mask: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
) -> None:
    """Padded batched attention for one bucket of requests; writes its rows of ``out``."""
    device = q.device
    qi = torch.arange(max_q, device=device)
    kj = torch.arange(max_kv, device=device)
    q_valid = qi[None, :] < q_lens[:, None]  # [nb, max_q]
    # Padding query slots point at the request's last real row so the gather stays in bounds.
    rows = starts[:, None] + torch.minimum(qi[None, :], q_lens[:, None] - 1)

    # Likewise padding key slots repeat the last real key: cache rows past kv_len may hold garbage (even NaN,
    # which a mask cannot remove once it has entered q @ k^T).
    keys = torch.minimum(kj[None, :], kv_lens[:, None] - 1)

    q_b = q[rows].transpose(1, 2)  # [nb, H, max_q, D]
    if page_table is None:
        pages, rows_in_page = slots[:, None], keys
    else:
        page = k_cache.shape[1]
        pages, rows_in_page = page_table[slots[:, None], keys // page].long(), keys % page
    k_b = k_cache[pages, rows_in_page].transpose(1, 2)  # [nb, Hkv, max_kv, D]
    v_b = v_cache[pages, rows_in_page].transpose(1, 2)

    mask = kj[None, None, :] < kv_lens[:, None, None]  # [nb, 1, max_kv]
    no_keys = None
    if tree_mask is not None:
        # Key j is block row (j - ctx); padding query slots reuse their request's last row's bits.
        rel = kj[None, None, :] - (kv_lens - q_lens)[:, None, None]  # [nb, 1, max_kv]
        bits = (tree_mask[rows][:, :, None] >> rel.clamp(0, MAX_TREE_Q_LEN - 1)) & 1  # [nb, max_q, max_kv]
        mask = mask & ((rel < 0) | (bits != 0))
        # A row that sees no key gets zeros (as the Triton kernel writes), not SDPA's NaN.
        no_keys = ~mask.any(-1)  # [nb, max_q]
        mask = mask | no_keys[:, :, None]
    elif causal:
        # Padding query slots get a limit >= kv_len, so no row is fully masked (avoids NaN).
        last_key = (kv_lens - q_lens)[:, None, None] + qi[None, :, None]
        mask = mask & (kj[None, None, :] <= last_key)  # [nb, max_q, max_kv]
    o = F.scaled_dot_product_attention(q_b, k_b, v_b, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True)
    o = o.transpose(1, 2)  # [nb, max_q, H, D]
    if no_keys is not None:
        o = o.masked_fill(no_keys[:, :, None, None], 0.0)
    out[rows[q_valid]] = o[q_valid]


def slot_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    causal: bool = True,
    tree_mask: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch slot attention (one padded SDPA per q_len bucket). Rows of q owned by no request are zero.

    With ``tree_mask`` (int64 [T], see the module docstring) ``causal`` is ignored.
    """
    _check_inputs(q, k_cache, v_cache, slot_ids, q_starts, q_lens, kv_lens, page_table)
    if tree_mask is not None:
        _check_tree_mask(tree_mask, q)
    host = [t.tolist() for t in (slot_ids, q_starts, q_lens, kv_lens)]
    _check_lengths(q, k_cache, *host, page_table=page_table)
    q_lens_h, kv_lens_h = host[2], host[3]
    if tree_mask is not None:
        _check_tree_q_len(max(q_lens_h, default=0))

    out = torch.zeros_like(q)
    for bucket in _bucket_by_q_len(q_lens_h):
        idx = torch.tensor(bucket, device=q.device)
        _attend_bucket(
            q,
            k_cache,
            v_cache,
            out,
            slot_ids[idx].long(),
            q_starts[idx].long(),
            q_lens[idx].long(),
            kv_lens[idx].long(),
            max_q=max(q_lens_h[b] for b in bucket),
            max_kv=max(kv_lens_h[b] for b in bucket),
            scale=scale,
            causal=causal,
            tree_mask=tree_mask,
            page_table=page_table,
        )
    return out


# --------------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _online_update(acc, l_i, m_i, s, v_tile, DOT_PRECISION: tl.constexpr):
        """Fold one tile of (masked, exp2-domain) scores and its values into the running softmax."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None], input_precision=DOT_PRECISION)
        return acc, l_i, m_new

    @triton.jit
    def _partial(acc, l_i, m_i):
        """A finished partial as (normalized output, log2-sum-exp); an empty one is (0, -inf)."""
        has_keys = l_i > 0.0
        o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        lse = tl.where(has_keys, m_i + tl.log2(l_i), float("-inf"))
        return o, lse

    @triton.jit
    def _merge(m, denom, acc, lse, o):
        """Fold one partial (lse, o) into the running (max, denominator, weighted sum)."""
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        return m_new, denom * alpha + w, acc * alpha[:, None] + w[:, None] * o

    @triton.jit
    def _slot_bases(k_ptr, v_ptr, pages_ptr, slot, stride_pages, stride_ks, stride_vs, kv_head, stride_kh, stride_vh,
                    PAGED: tl.constexpr):
        """A (slot, kv head)'s K and V base pointers and its page-table row (unread without PAGED)."""
        if PAGED:
            return k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh, pages_ptr + slot * stride_pages
        return k_ptr + slot * stride_ks + kv_head * stride_kh, v_ptr + slot * stride_vs + kv_head * stride_vh, pages_ptr

    @triton.jit
    def _key_offsets(keys, ok, page_row, stride_ks, stride_kn, stride_vs, stride_vn, PAGE: tl.constexpr,
                     PAGED: tl.constexpr):
        """K and V element offsets of a slot's key positions `keys` (lanes with `ok` false are never read):
        with PAGED, through the slot's page-table row; else from its slot's base."""
        if PAGED:
            page = tl.load(page_row + keys // PAGE, mask=ok, other=0).to(tl.int64)
            within = keys % PAGE
            return page * stride_ks + within * stride_kn, page * stride_vs + within * stride_vn
        return keys.to(tl.int64) * stride_kn, keys.to(tl.int64) * stride_vn

    @triton.jit
    def _attend_key_tiles(
        acc,
        l_i,
        m_i,
        q_tile,
        k_base,
        v_base,
        page_row,
        stride_ks,
        stride_kn,
        stride_vs,
        stride_vn,
        qk_scale,
        key_limit,
        tree_bits,
        ctx,
        lo,
        hi,
        MASKED: tl.constexpr,
        TREE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE: tl.constexpr,
        PAGED: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Online-softmax update over the key tiles in [lo, hi).

        MASKED tiles may run past hi (never read: hi <= kv_len) or past a row's exclusive ``key_limit``;
        with TREE they also hide key ``col >= ctx`` unless bit ``col - ctx`` of the row's ``tree_bits`` is set.
        Unmasked tiles are whole and visible to every row.
        """
        dims = tl.arange(0, HEAD_DIM)
        for start in range(lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < hi
            k_off, v_off = _key_offsets(cols, col_ok, page_row, stride_ks, stride_kn, stride_vs, stride_vn, PAGE,
                                        PAGED)
            k_ptrs = k_base + k_off[:, None] + dims[None, :]
            v_ptrs = v_base + v_off[:, None] + dims[None, :]
            if MASKED:
                k_tile = tl.load(k_ptrs, mask=col_ok[:, None], other=0.0)
            else:
                k_tile = tl.load(k_ptrs)
            s = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * qk_scale
            if MASKED:
                visible = col_ok[None, :] & (cols[None, :] < key_limit[:, None])
                if TREE:
                    # Clamp the shift into [0, 63]: context keys (col < ctx) are visible whatever the bits.
                    rel = tl.minimum(tl.maximum(cols - ctx, 0), 63).to(tl.int64)
                    in_tree = ((tree_bits[:, None] >> rel[None, :]) & 1) != 0
                    visible = visible & ((cols[None, :] < ctx) | in_tree)
                s = tl.where(visible, s, float("-inf"))
            if MASKED:
                v_tile = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
            else:
                v_tile = tl.load(v_ptrs)
            acc, l_i, m_i = _online_update(acc, l_i, m_i, s, v_tile, DOT_PRECISION)
        return acc, l_i, m_i

    @triton.jit
    def _slot_attn_fwd_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        part_o_ptr,
        part_lse_ptr,
        slot_ptr,
        q_start_ptr,
        q_len_ptr,
        kv_len_ptr,
        tree_mask_ptr,
        pages_ptr,
        stride_pages,
        qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain
        num_rows,  # T * num_heads, the stride between kv splits in the partial buffers
        stride_qt,
        stride_qh,
        stride_ks,
        stride_kn,
        stride_kh,
        stride_vs,
        stride_vn,
        stride_vh,
        stride_ot,
        stride_oh,
        NUM_KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        CAUSAL: tl.constexpr,
        TREE: tl.constexpr,
        PAGE: tl.constexpr,
        PAGED: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # Program = (row block, request x kv head, kv split). A row is one (query token, head-in-group) pair,
        # so the GROUP query heads sharing a kv head read each K/V tile once.
        row_block = tl.program_id(0)
        req = tl.program_id(1) // NUM_KV_HEADS
        kv_head = tl.program_id(1) % NUM_KV_HEADS
        split = tl.program_id(2)

        q_len = tl.load(q_len_ptr + req)
        row_lo = row_block * BLOCK_M
        if row_lo >= q_len * GROUP:  # grid is sized for the longest request
            return
        q_start = tl.load(q_start_ptr + req)
        kv_len = tl.load(kv_len_ptr + req)
        slot = tl.load(slot_ptr + req).to(tl.int64)

        rows = row_lo + tl.arange(0, BLOCK_M)
        tok = rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = tok < q_len
        dims = tl.arange(0, HEAD_DIM)
        q_rows = (q_start + tok).to(tl.int64)
        q_tile = tl.load(
            q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )

        # Causal rows have their own exclusive key limit. The block's key end is that of its last real row, and
        # keys below its first row's limit are visible to every row: whole tiles there skip the mask.
        # Tree rows see all context keys; the request's own block keys always take the masked tiles.
        ctx = kv_len - q_len
        if TREE:
            tree_bits = tl.load(tree_mask_ptr + q_rows, mask=row_ok, other=0)
            key_limit = tl.zeros([BLOCK_M], dtype=tl.int32) + kv_len
            kv_end = kv_len
            full_end = ctx
        elif CAUSAL:
            key_limit = kv_len - q_len + tok + 1
            last_tok = (tl.minimum(row_lo + BLOCK_M, q_len * GROUP) - 1) // GROUP
            kv_end = kv_len - q_len + last_tok + 1
            full_end = kv_len - q_len + row_lo // GROUP + 1
            tree_bits = key_limit  # unused without TREE
        else:
            key_limit = tl.zeros([BLOCK_M], dtype=tl.int32) + kv_len
            kv_end = kv_len
            full_end = kv_len
            tree_bits = key_limit  # unused without TREE
        tiles_per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SPLITS)
        lo = split * tiles_per_split * BLOCK_N
        hi = tl.minimum(lo + tiles_per_split * BLOCK_N, kv_end)
        mid = lo + tl.maximum(tl.minimum(hi, full_end) - lo, 0) // BLOCK_N * BLOCK_N

        k_base, v_base, page_row = _slot_bases(k_ptr, v_ptr, pages_ptr, slot, stride_pages, stride_ks, stride_vs,
                                               kv_head, stride_kh, stride_vh, PAGED)
        # A finite floor instead of -inf keeps exp2(m_old - m_new) NaN-free for rows whose keys are all masked.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        acc, l_i, m_i = _attend_key_tiles(
            acc, l_i, m_i, q_tile, k_base, v_base, page_row, stride_ks, stride_kn, stride_vs, stride_vn, qk_scale,
            key_limit, tree_bits, ctx, lo, mid, MASKED=False, TREE=TREE, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, PAGE=PAGE,
            PAGED=PAGED, DOT_PRECISION=DOT_PRECISION,
        )
        acc, l_i, m_i = _attend_key_tiles(
            acc, l_i, m_i, q_tile, k_base, v_base, page_row, stride_ks, stride_kn, stride_vs, stride_vn, qk_scale,
            key_limit, tree_bits, ctx, mid, hi, MASKED=True, TREE=TREE, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, PAGE=PAGE,
            PAGED=PAGED, DOT_PRECISION=DOT_PRECISION,
        )

        o, lse = _partial(acc, l_i, m_i)
        if NUM_SPLITS == 1:
            out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
            tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            # Partials are contiguous [NUM_SPLITS, T * num_heads, (HEAD_DIM)]; an empty split stores lse = -inf.
            flat = split * num_rows + q_rows * (NUM_KV_HEADS * GROUP) + head
            tl.store(part_o_ptr + flat[:, None] * HEAD_DIM + dims[None, :], o, mask=row_ok[:, None])
            tl.store(part_lse_ptr + flat, lse, mask=row_ok)

    @triton.jit
    def _slot_attn_combine_kernel(
        part_o_ptr,
        part_lse_ptr,
        out_ptr,
        q_start_ptr,
        q_len_ptr,
        pos_ptr,
        num_rows,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_R: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        ROW_SPLITS: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        # Program = (row block, request); a request's (token, head) rows are contiguous in the flat layout.
        # Rows fold partials 0 .. n-1 in order: without ROW_SPLITS n = NUM_SPLITS (every partial); with it (the
        # invariant kernel) n is the row's own count of key splits, those up to its position, each of which has
        # keys (the split programs past a block's last key store nothing).
        req = tl.program_id(1)
        q_len = tl.load(q_len_ptr + req)
        row_lo = tl.program_id(0) * BLOCK_R
        if row_lo >= q_len * NUM_HEADS:
            return
        base = tl.load(q_start_ptr + req).to(tl.int64) * NUM_HEADS
        rows = base + row_lo + tl.arange(0, BLOCK_R)
        row_ok = rows < base + q_len * NUM_HEADS
        dims = tl.arange(0, HEAD_DIM)
        if ROW_SPLITS:
            pos = tl.load(pos_ptr + rows // NUM_HEADS, mask=row_ok, other=0).to(tl.int32)
            row_splits = tl.where(row_ok, pos // SPLIT + 1, 0)
        else:
            row_splits = tl.where(row_ok, NUM_SPLITS, 0)
        m = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
        denom = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
        for part in range(0, tl.max(row_splits, 0)):
            ok = row_splits > part
            lse = tl.load(part_lse_ptr + part * num_rows + rows, mask=ok, other=float("-inf"))
            o = tl.load(part_o_ptr + (part * num_rows + rows)[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None],
                        other=0.0)
            m, denom, acc = _merge(m, denom, acc, lse, o)
        out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
        # out is contiguous [T, NUM_HEADS, HEAD_DIM], i.e. flat row r at r * HEAD_DIM.
        out_ptrs = out_ptr + rows[:, None] * HEAD_DIM + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _gathered_tiles(
        acc, l_i, m_i, q_tile, tok, k_base, v_base, page_row, stride_ks, stride_kn, stride_vs, stride_vn, qk_scale,
        pos_ptr, table_ptr, q_start, tok_lo, tok_hi, gather_lo, lo, hi, BLOCK_N: tl.constexpr, TABLE: tl.constexpr,
        HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """A tree pass's key tiles in [max(lo, gather_lo), hi), token by token: lane i of a token's tile is its
        virtual key start + i, read from the cache row `tree_tail_rows` names, and folded into its rows only."""
        dims = tl.arange(0, HEAD_DIM)
        lanes = tl.arange(0, BLOCK_N)
        first = tl.maximum(lo, gather_lo)
        for t in range(tok_lo, tok_hi + 1):
            pos = tl.load(pos_ptr + q_start + t).to(tl.int32)
            table = table_ptr + (q_start + t).to(tl.int64) * TABLE - gather_lo
            for start in range(first, tl.minimum(hi, pos + 1), BLOCK_N):
                virtual = start + lanes
                lane_ok = virtual <= pos
                phys = tl.load(table + virtual, mask=lane_ok, other=0)
                k_off, v_off = _key_offsets(phys, lane_ok, page_row, stride_ks, stride_kn, stride_vs, stride_vn, PAGE,
                                            PAGED)
                k_tile = tl.load(k_base + k_off[:, None] + dims[None, :], mask=lane_ok[:, None], other=0.0)
                v_tile = tl.load(v_base + v_off[:, None] + dims[None, :], mask=lane_ok[:, None], other=0.0)
                s = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * qk_scale
                s = tl.where((tok == t)[:, None] & lane_ok[None, :], s, float("-inf"))
                acc, l_i, m_i = _online_update(acc, l_i, m_i, s, v_tile, DOT_PRECISION)
        return acc, l_i, m_i

    @triton.jit
    def _gathered_pair(t, j, first, hi, tok_hi, k_base, v_base, page_row, stride_ks, stride_kn, stride_vs, stride_vn,
                       pos_ptr, table_ptr, q_start, gather_lo, BLOCK_N: tl.constexpr, TABLE: tl.constexpr,
                       HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr):
        """Token t's j-th gathered tile from `first` on, loaded: (whether it folds at all, its live lanes, K, V).
        A token past tok_hi folds none and reads nothing."""
        dims = tl.arange(0, HEAD_DIM)
        pos = tl.load(pos_ptr + q_start + t, mask=t <= tok_hi, other=-1).to(tl.int32)
        start = first + j * BLOCK_N
        end = tl.minimum(hi, pos + 1)
        live = start < end
        virtual = start + tl.arange(0, BLOCK_N)
        lane_ok = virtual < end  # none when the tile starts past the token's keys (a tile ends by hi)
        table = table_ptr + (q_start + t).to(tl.int64) * TABLE - gather_lo
        phys = tl.load(table + virtual, mask=lane_ok, other=0)
        k_off, v_off = _key_offsets(phys, lane_ok, page_row, stride_ks, stride_kn, stride_vs, stride_vn, PAGE, PAGED)
        k_tile = tl.load(k_base + k_off[:, None] + dims[None, :], mask=lane_ok[:, None], other=0.0)
        v_tile = tl.load(v_base + v_off[:, None] + dims[None, :], mask=lane_ok[:, None], other=0.0)
        return live, lane_ok, k_tile, v_tile

    @triton.jit
    def _gathered_tiles_prefetched(
        acc, l_i, m_i, q_tile, tok, k_base, v_base, page_row, stride_ks, stride_kn, stride_vs, stride_vn, qk_scale,
        pos_ptr, table_ptr, q_start, tok_lo, tok_hi, gather_lo, lo, hi, BLOCK_N: tl.constexpr, TABLE: tl.constexpr,
        HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """`_gathered_tiles`' tiles in the same order, the next (token, tile) pair's table and K/V loaded before
        the current one folds, so a token's dependent loads (position, table, rows) overlap the previous fold
        instead of stalling it. A token's table reaches two tiles, so pairs (t, 0), (t, 1) cover it."""
        first = tl.maximum(lo, gather_lo)
        if first < tl.minimum(hi, gather_lo + TABLE):
            live, lane_ok, k_tile, v_tile = _gathered_pair(
                tok_lo, 0, first, hi, tok_hi, k_base, v_base, page_row, stride_ks, stride_kn, stride_vs, stride_vn,
                pos_ptr, table_ptr, q_start, gather_lo, BLOCK_N, TABLE, HEAD_DIM, PAGE, PAGED)
            for i in range(0, (tok_hi - tok_lo + 1) * 2):
                nxt = i + 1
                live_n, ok_n, k_n, v_n = _gathered_pair(
                    tok_lo + nxt // 2, nxt % 2, first, hi, tok_hi, k_base, v_base, page_row, stride_ks, stride_kn,
                    stride_vs, stride_vn, pos_ptr, table_ptr, q_start, gather_lo, BLOCK_N, TABLE, HEAD_DIM, PAGE,
                    PAGED)
                if live:
                    s = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * qk_scale
                    s = tl.where((tok == tok_lo + i // 2)[:, None] & lane_ok[None, :], s, float("-inf"))
                    acc, l_i, m_i = _online_update(acc, l_i, m_i, s, v_tile, DOT_PRECISION)
                live, lane_ok, k_tile, v_tile = live_n, ok_n, k_n, v_n
        return acc, l_i, m_i

    @triton.jit
    def _split_partial(q_tile, tok, k_base, v_base, page_row, stride_ks, stride_kn, stride_vs, stride_vn, qk_scale,
                       key_end, block_end, block_full, lo, pos_ptr, table_ptr, q_start, tok_lo, tok_hi, gather_lo,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, TABLE: tl.constexpr,
                       HEAD_DIM: tl.constexpr, TREE: tl.constexpr, PREFETCH: tl.constexpr, PAGE: tl.constexpr,
                       PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """The partial of keys [lo, lo + SPLIT): the tiles every row reads from the cache as they lie, each row's
        cut at its own key_end, then (TREE) the tiles from gather_lo on, read per token through its table."""
        hi = tl.minimum(lo + SPLIT, block_end)
        mid = lo + tl.maximum(tl.minimum(hi, block_full) - lo, 0) // BLOCK_N * BLOCK_N
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        acc, l_i, m_i = _attend_key_tiles(
            acc, l_i, m_i, q_tile, k_base, v_base, page_row, stride_ks, stride_kn, stride_vs, stride_vn, qk_scale,
            key_end, key_end, 0, lo, mid, MASKED=False, TREE=False, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, PAGE=PAGE,
            PAGED=PAGED, DOT_PRECISION=DOT_PRECISION,
        )
        acc, l_i, m_i = _attend_key_tiles(
            acc, l_i, m_i, q_tile, k_base, v_base, page_row, stride_ks, stride_kn, stride_vs, stride_vn, qk_scale,
            key_end, key_end, 0, mid, hi, MASKED=True, TREE=False, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, PAGE=PAGE,
            PAGED=PAGED, DOT_PRECISION=DOT_PRECISION,
        )
        if TREE and PREFETCH:
            acc, l_i, m_i = _gathered_tiles_prefetched(
                acc, l_i, m_i, q_tile, tok, k_base, v_base, page_row, stride_ks, stride_kn, stride_vs, stride_vn,
                qk_scale, pos_ptr, table_ptr, q_start, tok_lo, tok_hi, gather_lo, lo, lo + SPLIT, BLOCK_N, TABLE,
                HEAD_DIM, PAGE, PAGED, DOT_PRECISION,
            )
        elif TREE:
            acc, l_i, m_i = _gathered_tiles(
                acc, l_i, m_i, q_tile, tok, k_base, v_base, page_row, stride_ks, stride_kn, stride_vs, stride_vn,
                qk_scale, pos_ptr, table_ptr, q_start, tok_lo, tok_hi, gather_lo, lo, lo + SPLIT, BLOCK_N, TABLE,
                HEAD_DIM, PAGE, PAGED, DOT_PRECISION,
            )
        return _partial(acc, l_i, m_i)

    @triton.jit
    def _slot_attn_invariant_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, slot_ptr, q_start_ptr, q_len_ptr, kv_len_ptr,
        pos_ptr, table_ptr, pages_ptr, stride_pages, qk_scale, num_rows, stride_qt, stride_qh, stride_ks, stride_kn,
        stride_kh, stride_vs, stride_vn, stride_vh, stride_ot, stride_oh,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, TABLE: tl.constexpr, SPLIT_GRID: tl.constexpr,
        TREE: tl.constexpr, PER_TOKEN: tl.constexpr, PREFETCH: tl.constexpr, PAGE: tl.constexpr,
        PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        # Program = (row block, request x kv head, split). With SPLIT_GRID, each program stores its split's
        # partial for the combine kernel; otherwise one program folds the splits in the same order itself.
        # A row block is BLOCK_M consecutive (token, head-in-group) rows, or with PER_TOKEN one token's GROUP
        # rows (a tree pass's gathered tiles then serve that token alone, and its tokens run in parallel).
        row_block = tl.program_id(0)
        req = tl.program_id(1) // NUM_KV_HEADS
        kv_head = tl.program_id(1) % NUM_KV_HEADS
        part = tl.program_id(2)
        q_len = tl.load(q_len_ptr + req)
        lanes = tl.arange(0, BLOCK_M)
        if PER_TOKEN:
            if row_block >= q_len:
                return
            tok = row_block + lanes * 0
            head = kv_head * GROUP + lanes % GROUP
            row_ok = lanes < GROUP
            tok_lo = row_block
            tok_hi = row_block
        else:
            row_lo = row_block * BLOCK_M
            row_hi = q_len * GROUP
            if row_lo >= row_hi:
                return
            rows = row_lo + lanes
            tok = rows // GROUP
            head = kv_head * GROUP + rows % GROUP
            row_ok = rows < row_hi
            tok_lo = row_lo // GROUP
            tok_hi = (tl.minimum(row_lo + BLOCK_M, row_hi) - 1) // GROUP
        q_start = tl.load(q_start_ptr + req)
        slot = tl.load(slot_ptr + req).to(tl.int64)
        dims = tl.arange(0, HEAD_DIM)
        q_rows = (q_start + tok).to(tl.int64)
        q_tile = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                         mask=row_ok[:, None], other=0.0)
        keys = tl.where(row_ok, tl.load(pos_ptr + q_rows, mask=row_ok, other=0).to(tl.int32) + 1, 0)
        keys_end = tl.max(keys, 0)  # the block's splits: those up to its last row's position
        if TREE:
            # Every node of a request shares its context; the tiles from the one holding its first block key
            # on are read per token, those below it by all rows alike.
            gather_lo = (tl.load(kv_len_ptr + req) - q_len) // BLOCK_N * BLOCK_N
            key_end = tl.zeros([BLOCK_M], dtype=tl.int32) + gather_lo
        else:
            gather_lo = 0
            key_end = keys
        block_end = tl.max(key_end, 0)
        block_full = tl.min(tl.where(row_ok, key_end, block_end), 0)
        k_base, v_base, page_row = _slot_bases(k_ptr, v_ptr, pages_ptr, slot, stride_pages, stride_ks, stride_vs,
                                               kv_head, stride_kh, stride_vh, PAGED)
        flat = q_rows * (NUM_KV_HEADS * GROUP) + head

        if SPLIT_GRID:
            if part * SPLIT >= keys_end:  # past the block's last key: the combine reads no partial here
                return
            o, lse = _split_partial(q_tile, tok, k_base, v_base, page_row, stride_ks, stride_kn, stride_vs, stride_vn,
                                    qk_scale, key_end, block_end, block_full, part * SPLIT, pos_ptr, table_ptr,
                                    q_start, tok_lo, tok_hi, gather_lo, BLOCK_M, BLOCK_N, SPLIT, TABLE, HEAD_DIM, TREE,
                                    PREFETCH, PAGE, PAGED, DOT_PRECISION)
            at = part * num_rows + flat
            tl.store(part_o_ptr + at[:, None] * HEAD_DIM + dims[None, :], o, mask=row_ok[:, None])
            tl.store(part_lse_ptr + at, lse, mask=row_ok)
        else:
            # A split past a row's position is (0, -inf) to it: merging that changes none of its bits.
            m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
            denom = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            for lo in range(0, keys_end, SPLIT):
                o, lse = _split_partial(q_tile, tok, k_base, v_base, page_row, stride_ks, stride_kn, stride_vs,
                                        stride_vn, qk_scale, key_end, block_end, block_full, lo, pos_ptr, table_ptr,
                                        q_start, tok_lo, tok_hi, gather_lo, BLOCK_M, BLOCK_N, SPLIT, TABLE, HEAD_DIM,
                                        TREE, PREFETCH, PAGE, PAGED, DOT_PRECISION)
                m, denom, acc = _merge(m, denom, acc, lse, o)
            out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
            out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pass_kind(max_q_len: int, tree: bool) -> str:
    return "decode" if max_q_len == 1 else "tree" if tree else "chain"


def _split_the_grid(device: torch.device, max_q_len: int, kind: str, programs: int, block_m: int,
                    head_dim: int) -> bool:
    """Which form of the invariant kernel a pass takes (both give the same bits): the key splits spread over
    programs (then combined) for passes of up to INVARIANT_SPLIT_GRID_MAX_Q queries per request, on CUDA while
    their row-block programs' work is under _SPLIT_GRID_UNITS_PER_SM of the pass's kind (a decode or verify of
    few requests); else one program folds every split. The interpreter keeps both forms in use."""
    if max_q_len > INVARIANT_SPLIT_GRID_MAX_Q:
        return False
    if device.type != "cuda":
        return True
    units = programs * block_m * head_dim // (INVARIANT_BLOCK_M * 64)
    return units < _SPLIT_GRID_UNITS_PER_SM[kind] * _sm_count(device)


def kv_splits(device: torch.device, batch_size: int, num_kv_heads: int) -> int:
    """How many key splits a pass over `batch_size` requests captures: split each request's keys until
    (requests x kv heads x splits) roughly fills the GPU's SMs (1 off CUDA, where the split is unused)."""
    if device.type != "cuda":
        return 1
    return max(1, min(8, _sm_count(device) // (batch_size * num_kv_heads)))


# Shared memory a config may plan for (H100/H200 allow 227 KiB per block; leave room for layout conversions).
_SMEM_BUDGET = 200 * 1024


def _launch_config(rows_max: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) from the longest request's row count (q_len * group)."""
    if rows_max <= 64:
        # Decode / verify: few rows, memory bound - wide key tiles keep more bytes in flight.
        block_m, block_n, num_warps = max(16, triton.next_power_of_2(rows_max)), 128, 4
    else:
        block_m, block_n, num_warps = 64, 64, 4
    num_stages = 3
    elt = dtype.itemsize

    def smem() -> int:  # the Q tile plus (num_stages - 1) buffered K and V tiles
        return (block_m + 2 * (num_stages - 1) * block_n) * head_dim * elt

    while smem() > _SMEM_BUDGET and block_n > 16:
        block_n //= 2
    if smem() > _SMEM_BUDGET:
        num_stages = 2
    while smem() > _SMEM_BUDGET and block_m > 16:
        block_m //= 2
    return block_m, block_n, num_warps, num_stages


def _triton_prologue(name: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_ids: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor,
                     max_q_len: int | None, tree_mask: torch.Tensor | None,
                     page_table: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The Triton kernels' shared checks; returns (the output to fill, max_q_len), max_q_len 0 (or an empty
    output) when there is nothing to compute."""
    require_triton(name)
    _check_inputs(q, k_cache, v_cache, slot_ids, q_starts, q_lens, kv_lens, page_table)
    if tree_mask is not None:
        _check_tree_mask(tree_mask, q)
    head_dim = q.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"{name} needs a power-of-two head_dim >= 16, got {head_dim}")
    for t, tensor_name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        if t.stride(-1) != 1:
            raise ValueError(f"{tensor_name} must have a unit-stride last dimension")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    batch = slot_ids.shape[0]
    if max_q_len is None:
        max_q_len = int(q_lens.max()) if batch else 0
    if tree_mask is not None:
        _check_tree_q_len(max_q_len)
    return out, 0 if batch == 0 else max_q_len


def slot_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    causal: bool = True,
    max_q_len: int | None = None,
    num_kv_splits: int = 1,
    tree_mask: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton slot attention. Rows of q owned by no request are left unwritten.

    With ``max_q_len`` given, there is no host sync and the launch grid depends only on (T, B, max_q_len,
    num_kv_splits), so the call is CUDA-graph capturable. ``num_kv_splits > 1`` splits each request's keys
    across programs (flash-decoding) and merges the partial results in a second kernel. Metadata values
    (slot ids, q_len <= kv_len <= max_len) are trusted, not checked, since checking them would sync.
    With ``tree_mask`` (int64 [T], see the module docstring) ``causal`` is ignored and ``max_q_len`` must be <= 64.
    """
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    out, max_q_len = _triton_prologue("slot_attention_triton", q, k_cache, v_cache, slot_ids, q_starts, q_lens,
                                      kv_lens, max_q_len, tree_mask, page_table)
    if out.numel() == 0 or max_q_len == 0:
        return out
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    batch = slot_ids.shape[0]
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = _launch_config(max_q_len * group, head_dim, q.dtype)
    num_rows = num_tokens * num_heads
    if num_kv_splits > 1:
        part_o = torch.empty((num_kv_splits, num_rows, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_kv_splits, num_rows), dtype=torch.float32, device=q.device)
    else:  # unused by the kernel when NUM_SPLITS == 1
        part_o = part_lse = out

    grid = (triton.cdiv(max_q_len * group, block_m), batch * num_kv_heads, num_kv_splits)
    _slot_attn_fwd_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_o,
        part_lse,
        slot_ids,
        q_starts,
        q_lens,
        kv_lens,
        q_lens if tree_mask is None else tree_mask,  # a placeholder pointer without TREE
        q_lens if page_table is None else page_table,  # likewise without PAGED
        0 if page_table is None else page_table.stride(0),
        scale * math.log2(math.e),
        num_rows,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=num_kv_splits,
        CAUSAL=causal and tree_mask is None,
        TREE=tree_mask is not None,
        PAGE=k_cache.shape[1],
        PAGED=page_table is not None,
        # fp32 inputs would otherwise run the dots in tf32
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_kv_splits > 1:
        block_r = 16  # (token, head) rows per program: a verify block's rows spread over several SMs
        combine_grid = (triton.cdiv(max_q_len * num_heads, block_r), batch)
        _slot_attn_combine_kernel[combine_grid](
            part_o,
            part_lse,
            out,
            q_starts,
            q_lens,
            q_lens,  # positions: unread without ROW_SPLITS
            num_rows,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_R=block_r,
            NUM_SPLITS=num_kv_splits,
            ROW_SPLITS=False,
            SPLIT=1,
            num_warps=4,
        )
    return out


def tree_tail_rows(positions: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
    """int32 [T, TREE_TABLE_KEYS]: the cache row behind each virtual key a tree node reads per token (0 past its
    own position).

    Lane i stands for virtual key G + i, G the node's context length ctx rounded down to a key tile: one below
    ctx is that cache row; one at or past it is the node's ancestor at depth G + i - ctx, the (G + i - ctx)-th
    set bit of its visibility bits (a tree lists ancestors before children), whose K/V sit at cache row ctx +
    that bit. A node at depth d sees d + 1 block rows, so ctx = position - d. Made once per pass: every layer
    reads the same table.
    """
    nodes = torch.arange(MAX_TREE_Q_LEN, device=tree_mask.device)
    visible = (tree_mask[:, None] >> nodes) & 1
    rank = visible.cumsum(1) - visible  # visible rows below each node: its depth, where visible
    by_depth = torch.zeros(tree_mask.shape[0], MAX_TREE_Q_LEN + 1, dtype=torch.long, device=tree_mask.device)
    by_depth.scatter_(1, torch.where(visible.bool(), rank, MAX_TREE_Q_LEN), nodes.expand_as(visible))
    positions = positions.long()
    ctx = positions - visible.sum(1) + 1
    first = ctx // INVARIANT_BLOCK_N * INVARIANT_BLOCK_N
    virtual = first[:, None] + torch.arange(TREE_TABLE_KEYS, device=tree_mask.device)
    depth = virtual - ctx[:, None]
    rows = torch.where(depth >= 0, ctx[:, None] + by_depth.gather(1, depth.clamp(0, MAX_TREE_Q_LEN - 1)), virtual)
    return torch.where(virtual <= positions[:, None], rows, 0).to(torch.int32)


def tall_tiles_round_alike(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether 32-row tiles give the bits 16-row ones do (float32's FMA dots and small heads do not)."""
    return dtype != torch.float32 and head_dim >= TALL_TILE_MIN_HEAD_DIM


def _invariant_block_m(device: torch.device, rows_max: int, programs16: int, kind: str, dtype: torch.dtype,
                       head_dim: int) -> int:
    """(token, head) rows per program (the same bits at 16 and 32): 32 halves the programs re-reading a
    request's keys, which pays on CUDA once the 16-row programs (`programs16`) fill the SMs
    (_BLOCK_M32_PROGRAMS_PER_SM; a tree's more, as its per-token tiles cost every row of a program) and the
    taller tile pads few rows (48 rows take three 16-row tiles, two 32-row tiles would compute 64). Off CUDA
    every such pass takes 32, so the interpreter keeps both heights in use. float32 stays at 16: its dots are
    FMA loops whose register layout, and so its row sums' order, follow the tile height (16-bit dtypes take
    one MMA layout per row at either), and so do heads under TALL_TILE_MIN_HEAD_DIM."""
    padded16, padded32 = triton.cdiv(rows_max, 16) * 16, triton.cdiv(rows_max, 32) * 32
    if not tall_tiles_round_alike(dtype, head_dim) or rows_max < 32 or 16 * padded32 > 17 * padded16:
        return INVARIANT_BLOCK_M
    if device.type == "cuda" and programs16 < _BLOCK_M32_PROGRAMS_PER_SM[kind] * _sm_count(device):
        return INVARIANT_BLOCK_M
    return 32


def _per_token_tree(device: torch.device, tree: bool, group: int, programs16: int) -> bool:
    """A tree pass gives each token a program of its own on CUDA while the packed 16-row programs are under a
    quarter of the SMs (a verify of very few requests, latency-bound: a packed program walks each of its
    tokens' gathered tiles in turn); with more, packing saves re-reading the shared context (the H200 tree
    sweep in docs/RESULTS.md puts the crossover between the embedded model's B=1 and B=8)."""
    return tree and device.type == "cuda" and group <= INVARIANT_BLOCK_M and 4 * programs16 < _sm_count(device)


@dataclass(frozen=True)
class InvariantLaunch:
    """How the invariant kernel launches a pass (every choice gives the same bits)."""

    block_m: int  # (token, head) rows per program: 16 or 32
    per_token: bool  # a tree pass: one token's rows per program
    split_grid: bool  # the key splits spread over programs, then combined
    prefetch: bool = False  # a tree pass: each (token, tile)'s gathered loads issued before the previous folds


def invariant_launch(device: torch.device, batch: int, num_kv_heads: int, group: int, max_q_len: int,
                     head_dim: int, tree: bool, dtype: torch.dtype, block_m: int | None = None,
                     per_token: bool | None = None, split_grid: bool | None = None,
                     prefetch: bool | None = None) -> InvariantLaunch:
    """The launch the invariant kernel takes for a pass of `batch` requests of up to `max_q_len` queries, each
    choice its own unless pinned."""
    rows_max = max_q_len * group
    programs16 = triton.cdiv(rows_max, INVARIANT_BLOCK_M) * batch * num_kv_heads
    kind = _pass_kind(max_q_len, tree)
    block_m = block_m or _invariant_block_m(device, rows_max, programs16, kind, dtype, head_dim)
    per_token = _per_token_tree(device, tree, group, programs16) if per_token is None else per_token
    if split_grid is None:
        programs = (max_q_len if per_token else triton.cdiv(rows_max, block_m)) * batch * num_kv_heads
        split_grid = _split_the_grid(device, max_q_len, kind, programs,
                                     INVARIANT_BLOCK_M if per_token else block_m, head_dim)
    return InvariantLaunch(block_m, per_token, split_grid, bool(prefetch) and tree)


def slot_attention_invariant(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    tree_mask: torch.Tensor | None = None,
    tail_rows: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    split_grid: bool | None = None,
    per_token: bool | None = None,
    prefetch: bool | None = None,
) -> torch.Tensor:
    """Batch-invariant causal (or tree) slot attention: the module docstring's fixed reduction structure.

    ``positions`` [T] gives each query's position (a tree node's: committed length + depth). As with
    :func:`slot_attention_triton`, with ``max_q_len`` given nothing syncs and the grid depends only on shapes.
    Passes of up to INVARIANT_SPLIT_GRID_MAX_Q queries per request over few requests spread the key splits over
    programs and merge them in a second kernel; the rest (prefill, large batches) merge in-program, in the same
    order and arithmetic (`_split_the_grid`).
    A tree pass reads its nodes' ancestor tiles through ``tail_rows`` (:func:`tree_tail_rows` of ``positions``
    and ``tree_mask``): a model passes the one table its layers share, else it is made here.
    ``block_m`` ((token, head) rows per program, 16 or 32), ``split_grid`` (which form), ``per_token`` (a
    tree pass: one token's rows per program) and ``prefetch`` (a tree pass: the gathered tiles' loads a tile
    ahead; not chosen unless pinned, until the device measures it) pin the launch; every choice gives the same
    bits.
    """
    num_tokens, num_heads, head_dim = q.shape
    if positions.shape != (num_tokens,) or positions.dtype not in _INDEX_DTYPES:
        raise ValueError(f"positions must be int32/int64 [{num_tokens}], got {positions.dtype} {tuple(positions.shape)}")
    if block_m not in (None, 16, 32) or (block_m == 32 and not tall_tiles_round_alike(q.dtype, head_dim)):
        raise ValueError(f"block_m must be 16 or 32 (the heights with one MMA layout; 16 in float32 and under "
                         f"head_dim {TALL_TILE_MIN_HEAD_DIM}), got {block_m} (head_dim {head_dim}, {q.dtype})")
    out, max_q_len = _triton_prologue("slot_attention_invariant", q, k_cache, v_cache, slot_ids, q_starts, q_lens,
                                      kv_lens, max_q_len, tree_mask, page_table)
    if out.numel() == 0 or max_q_len == 0:
        return out
    if tree_mask is None:
        tail_rows = None
    elif tail_rows is None:
        tail_rows = tree_tail_rows(positions, tree_mask)
    elif (tail_rows.shape != (num_tokens, TREE_TABLE_KEYS) or tail_rows.dtype != torch.int32
          or not tail_rows.is_contiguous()):
        raise ValueError(f"tail_rows must be contiguous int32 [{num_tokens}, {TREE_TABLE_KEYS}], got "
                         f"{tail_rows.dtype} {tuple(tail_rows.shape)}")
    batch = slot_ids.shape[0]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_splits = triton.cdiv(slot_geometry(k_cache, page_table)[1], SPLIT_KEYS)
    num_rows = num_tokens * num_heads
    launch = invariant_launch(q.device, batch, num_kv_heads, group, max_q_len, head_dim, tail_rows is not None,
                              q.dtype, block_m, per_token, split_grid, prefetch)
    block_m, per_token, split_grid = launch.block_m, launch.per_token, launch.split_grid
    if per_token and (tail_rows is None or group > block_m):
        raise ValueError(f"per_token needs a tree pass (tree_mask) and at most block_m ({block_m}) query heads "
                         f"per kv head, got tree_mask={'set' if tail_rows is not None else None}, {group} heads")
    row_blocks = max_q_len if per_token else triton.cdiv(max_q_len * group, block_m)
    if split_grid:
        part_o = torch.empty((num_splits, num_rows, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, num_rows), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out
    grid = (row_blocks, batch * num_kv_heads, num_splits if split_grid else 1)
    _slot_attn_invariant_kernel[grid](
        q, k_cache, v_cache, out, part_o, part_lse, slot_ids, q_starts, q_lens, kv_lens, positions,
        q_lens if tail_rows is None else tail_rows,  # a placeholder pointer without TREE
        q_lens if page_table is None else page_table, 0 if page_table is None else page_table.stride(0),  # PAGED
        scale * math.log2(math.e), num_rows, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=INVARIANT_BLOCK_N,
        SPLIT=SPLIT_KEYS, TABLE=TREE_TABLE_KEYS, SPLIT_GRID=split_grid, TREE=tail_rows is not None,
        PER_TOKEN=per_token, PREFETCH=launch.prefetch, PAGE=k_cache.shape[1], PAGED=page_table is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2, enable_fp_fusion=False,
    )
    if split_grid:
        block_r = 16
        _slot_attn_combine_kernel[(triton.cdiv(max_q_len * num_heads, block_r), batch)](
            part_o, part_lse, out, q_starts, q_lens, positions, num_rows, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_R=block_r, NUM_SPLITS=num_splits, ROW_SPLITS=True, SPLIT=SPLIT_KEYS,
            num_warps=4, enable_fp_fusion=False,
        )
    return out


def slot_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    causal: bool = True,
    max_q_len: int | None = None,
    num_kv_splits: int = 1,
    backend: str = "auto",
    tree_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    tail_rows: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch: ``"triton"``, ``"torch"``, or ``"auto"`` (triton for CUDA tensors when importable).

    ``tree_mask`` (int64 [T], q_lens <= 64) replaces ``causal`` with per-row draft-tree visibility bits.
    ``positions`` (causal or tree passes only) asks for the batch-invariant kernel on the Triton backend;
    ``num_kv_splits`` is then unused (its splits are fixed by key position); ``tail_rows`` is that kernel's
    tree table (:func:`tree_tail_rows`), made once per pass by the caller.
    """
    if pick_backend(backend, q) == "triton":
        if positions is not None:
            if not causal and tree_mask is None:
                raise ValueError("the batch-invariant kernel takes causal or tree passes, not a non-causal block")
            return slot_attention_invariant(q, k_cache, v_cache, slot_ids, q_starts, q_lens, kv_lens, positions,
                                            scale, max_q_len, tree_mask, tail_rows, page_table)
        return slot_attention_triton(
            q, k_cache, v_cache, slot_ids, q_starts, q_lens, kv_lens, scale, causal, max_q_len, num_kv_splits,
            tree_mask=tree_mask, page_table=page_table,
        )
    if tree_mask is not None and max_q_len is not None:
        _check_tree_q_len(max_q_len)
    return slot_attention_reference(
        q, k_cache, v_cache, slot_ids, q_starts, q_lens, kv_lens, scale, causal, tree_mask=tree_mask,
        page_table=page_table,
    )
