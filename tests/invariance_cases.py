"""Batch-invariance scenarios for the GEMM and attention kernels, shared by the CPU interpreter tests and the
CUDA tests: each returns, per comparison, how many output elements differ from the one-request baseline
(0 means bitwise equal).

Attention: one request's 16 new tokens after `ctx` context keys, computed as 16 decode passes (the baseline),
as one chain verify, as a chain verify beside other requests, inside a whole-prompt prefill, and as the path
of a draft tree whose other nodes hold unrelated K/V - a node's row must equal the decode of the token at its
depth; then the verify, prefill and tree passes again over page pools of every page size
benchmarks/gpu_page_size.py compares (pages shuffled), which must give the same bits. GEMM: rows of x alone,
in small batches and in a large one.
"""

from __future__ import annotations

import math

import torch

from specpilot.kernels.skinny_gemm import invariant_config, invariant_gemm
from specpilot.kernels.slot_attention import slot_attention_invariant

NEW = 16  # tokens per verify block
PAGES = (16, 32, 64, 128)  # page sizes: within a key tile, one tile (the default), two tiles


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(-1) != b.view(-1)).sum())


def _attend(q, k, v, slots, starts, q_lens, kv_lens, positions, tree_mask=None, **launch) -> torch.Tensor:
    dev = q.device

    def t(x: list[int], dtype=torch.int32) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=dev)

    return slot_attention_invariant(q, k, v, t(slots), t(starts), t(q_lens), t(kv_lens), t(positions, torch.int64),
                                    scale=1.0 / math.sqrt(q.shape[-1]), max_q_len=max(q_lens),
                                    tree_mask=None if tree_mask is None else t(tree_mask, torch.int64), **launch)


def paged_cache(k: torch.Tensor, v: torch.Tensor, page: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """k and v [slots, max_len, ...] cut into pages of `page` (max_len a multiple of it), shuffled into a pool
    with a spare page: the k_cache, v_cache and page_table of the same cache."""
    slots, max_len = k.shape[:2]
    per_slot = max_len // page
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(slots * per_slot + 1, generator=g)[: slots * per_slot].view(slots, per_slot)
    pools = []
    for cache in (k, v):
        pool = torch.zeros(slots * per_slot + 1, page, *cache.shape[2:], dtype=cache.dtype, device=cache.device)
        pool[table.flatten().to(cache.device)] = cache.reshape(slots * per_slot, page, *cache.shape[2:])
        pools.append(pool)
    return {"k": pools[0], "v": pools[1], "page_table": table.to(torch.int32).to(k.device)}


def _tree_with_path() -> tuple[list[int], list[int]]:
    """Parents of 16 nodes whose odd nodes continue one path from the root (node 0) and whose even nodes hang
    off random earlier nodes; returns (ancestor-or-self bits per node, the path's nodes by depth)."""
    g = torch.Generator().manual_seed(3)
    parents, path = [-1], [0]
    for i in range(1, NEW):
        if i % 2:
            parents.append(path[-1])
            path.append(i)
        else:
            parents.append(int(torch.randint(0, i, (1,), generator=g)))
    bits: list[int] = []
    for i, p in enumerate(parents):
        bits.append((bits[p] if p >= 0 else 0) | (1 << i))
    return bits, path


def attention_report(device: str, dtype: torch.dtype, ctx: int = 250, kv_heads: int | None = None, group: int = 3,
                     head_dim: int = 64, crowd: int | None = None) -> dict[str, int]:
    """`crowd`: how many other verifies (and twice as many decodes each side) share the large batches; on CUDA
    (the default there) enough that one program folds every split; the interpreter's programs take one path
    whatever their number, so a few do there. `kv_heads`: 2 on CUDA, 1 in the interpreter, whose time goes
    by programs (its accuracy case in test_batch_invariance keeps two). The default `ctx` puts the block's
    keys across a key tile and a split boundary (a tree node's ancestor tiles then span two partials)."""
    on_cuda = torch.device(device).type == "cuda"
    crowd = crowd if crowd is not None else (23 if on_cuda else 3)
    kv_heads = kv_heads if kv_heads is not None else (2 if on_cuda else 1)
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    heads, length = kv_heads * group, ctx + NEW
    slot_len = -(-(max(length, 300) + 8) // max(PAGES)) * max(PAGES)
    k = randn(4, slot_len, kv_heads, head_dim)
    v = randn(4, slot_len, kv_heads, head_dim)
    q_new = randn(NEW, heads, head_dim)
    new_pos = list(range(ctx, length))
    report: dict[str, int] = {}

    decode = torch.cat([_attend(q_new[i : i + 1], k, v, [0], [0], [1], [ctx + i + 1], [ctx + i]) for i in range(NEW)])
    chain = _attend(q_new, k, v, [0], [0], [NEW], [length], new_pos)
    report["chain verify"] = _differing(chain, decode)
    tall = {} if dtype == torch.float32 else {"32-row tiles": {"block_m": 32}}  # float32 keeps 16 (its FMA dots)
    for name, form in tall.items():
        report[f"chain verify, {name}"] = _differing(_attend(q_new, k, v, [0], [0], [NEW], [length], new_pos, **form),
                                                     decode)

    # Beside a decode and a 5-token verify of other slots, in the middle of the batch.
    others = randn(1 + 5, heads, head_dim)
    mixed_q = torch.cat([others[:1], q_new, others[1:]])
    mixed = _attend(mixed_q, k, v, [2, 0, 3], [0, 1, 1 + NEW], [1, NEW, 5], [40, length, 300],
                    [39, *new_pos, *range(295, 300)])
    report["chain verify in a batch"] = _differing(mixed[1 : 1 + NEW], decode)

    # Large batches: the chain verify beside `crowd` other verifies, and one of its tokens decoded between
    # 2 x `crowd` other decodes on each side.
    many_q = torch.cat([q_new, randn(crowd * NEW, heads, head_dim)])
    many = _attend(many_q, k, v, [0, *([2, 3] * crowd)[:crowd]], list(range(0, (crowd + 1) * NEW, NEW)),
                   [NEW] * (crowd + 1), [length, *range(100, 100 + crowd * 9, 9)],
                   [*new_pos, *(p for n in range(crowd) for p in range(100 + 9 * n - NEW, 100 + 9 * n))])
    report["chain verify in a large batch"] = _differing(many[:NEW], decode)
    side = 2 * crowd
    crowd_q = torch.cat([randn(side, heads, head_dim), q_new[5:6], randn(side, heads, head_dim)])
    beside = _attend(crowd_q, k, v, [2] * side + [0] + [3] * side, list(range(2 * side + 1)), [1] * (2 * side + 1),
                     [*range(20, 20 + side), ctx + 6, *range(200, 200 + side)],
                     [*range(19, 19 + side), ctx + 5, *range(199, 199 + side)])
    report["decode in a large batch"] = _differing(beside[side], decode[5])

    # The whole prompt in one pass (the single-program form of the splits).
    prompt_q = torch.cat([randn(ctx, heads, head_dim), q_new])
    prefill = _attend(prompt_q, k, v, [0], [0], [length], [length], list(range(length)))
    report["prefill"] = _differing(prefill[ctx:], decode)

    # Slot 1: the same context; the path's nodes hold the chain's K/V and queries, the others noise.
    bits, path = _tree_with_path()
    k[1, :ctx], v[1, :ctx] = k[0, :ctx], v[0, :ctx]
    tree_q = randn(NEW, heads, head_dim)
    depth = [bin(b).count("1") - 1 for b in bits]
    for d, node in enumerate(path):
        k[1, ctx + node], v[1, ctx + node], tree_q[node] = k[0, ctx + d], v[0, ctx + d], q_new[d]
    tree_pos = [ctx + d for d in depth]
    on_path = torch.tensor(path, device=device) + 1
    tree_forms = {"packed rows": {"per_token": False}, "a program per token": {"per_token": True},
                  "packed rows, loads a tile ahead": {"per_token": False, "prefetch": True}} | tall
    for name, form in tree_forms.items():
        tree = _attend(torch.cat([others[:1], tree_q]), k, v, [2, 1], [0, 1], [1, NEW], [40, length],
                       [39, *tree_pos], tree_mask=[1, *bits], **form)
        report[f"tree verify, {name}"] = _differing(tree[on_path], decode[: len(path)])

    for page in PAGES:
        pool = paged_cache(k, v, page)
        pk, pv, table = pool["k"], pool["v"], pool["page_table"]
        paged_chain = _attend(mixed_q, pk, pv, [2, 0, 3], [0, 1, 1 + NEW], [1, NEW, 5], [40, length, 300],
                              [39, *new_pos, *range(295, 300)], page_table=table)
        report[f"paged {page}: chain verify in a batch"] = _differing(paged_chain[1 : 1 + NEW], decode)
        paged_prefill = _attend(prompt_q, pk, pv, [0], [0], [length], [length], list(range(length)),
                                page_table=table)
        report[f"paged {page}: prefill"] = _differing(paged_prefill[ctx:], decode)
        for name, form in tree_forms.items():
            tree = _attend(torch.cat([others[:1], tree_q]), pk, pv, [2, 1], [0, 1], [1, NEW], [40, length],
                           [39, *tree_pos], tree_mask=[1, *bits], page_table=table, **form)
            report[f"paged {page}: tree verify, {name}"] = _differing(tree[on_path], decode[: len(path)])
    return report


def gemm_report(device: str, dtype: torch.dtype, n: int = 200, k: int = 300, m: int = 300,
                pinned: bool = False) -> dict[str, int]:
    """Rows of x @ w.T alone and in batches of 5, 40 and m against the same rows of the m-row result. Each
    call picks its own tiles by M, or with `pinned` every call takes the decode tiles, 16 rows per program
    (the interpreter's dot sums each K tile apart and adds it to the accumulator, so there the K tile, unlike
    on the GPU, changes the rounding)."""
    config, block_m = (invariant_config(1, n, k)[0], 16) if pinned else (None, None)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = torch.randn(n, k, generator=g).to(dtype).to(device)
    bias = torch.randn(n, generator=g).to(dtype).to(device)
    full = invariant_gemm(x, w, bias, block_m=block_m, config=config)
    report = {}
    for rows in ((7, 8), (3, 8), (10, 50), (0, m)):
        part = invariant_gemm(x[rows[0] : rows[1]], w, bias, block_m=block_m, config=config)
        report[f"rows {rows[0]}:{rows[1]}"] = _differing(part, full[rows[0] : rows[1]])
    return report
