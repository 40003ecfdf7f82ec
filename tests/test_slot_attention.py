"""Slot-cache attention: torch reference vs a naive float64 loop, Triton (interpreter) vs the reference.

The Triton cases run in one subprocess with TRITON_INTERPRET=1: triton reads that variable when a kernel is
decorated, so it cannot be switched on here once another test has imported the kernel module.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch
from triton_interpret import interpreter_fixture, patch_dot

from specpilot.kernels.slot_attention import (
    INVARIANT_BLOCK_N,
    TREE_TABLE_KEYS,
    slot_attention,
    slot_attention_reference,
    tree_tail_rows,
)


@dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_kv_heads: int = 2
    group: int = 1
    head_dim: int = 64
    causal: bool = True
    dtype: str = "float32"
    num_kv_splits: int = 1
    seed: int = 0
    tree: str | None = None  # "random" or "chain": pass a tree_mask (then causal is ignored)


def make_inputs(case: Case) -> dict:
    """Random inputs with gaps between requests' query rows and slots in random order.

    Cache entries no request owns (positions >= kv_len, unused slots) are NaN, so any read of them shows up.
    With ``case.tree``, ``tree_mask`` holds each request's draft-tree bits; rows no request owns hold noise.
    """
    g = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, case.dtype)
    batch = len(case.q_lens)
    num_heads = case.num_kv_heads * case.group
    num_slots, max_len = batch + 3, max(case.kv_lens) + 5

    gaps = torch.randint(0, 3, (batch,), generator=g).tolist()
    starts, row = [], 0
    for q_len, gap in zip(case.q_lens, gaps):
        row += gap
        starts.append(row)
        row += q_len
    num_tokens = row + 2

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    k_cache = torch.full((num_slots, max_len, case.num_kv_heads, case.head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slot_ids = torch.randperm(num_slots, generator=g)[:batch]
    for slot, kv_len in zip(slot_ids.tolist(), case.kv_lens):
        k_cache[slot, :kv_len] = randn(kv_len, case.num_kv_heads, case.head_dim)
        v_cache[slot, :kv_len] = randn(kv_len, case.num_kv_heads, case.head_dim)
    inp = dict(
        q=randn(num_tokens, num_heads, case.head_dim),
        k_cache=k_cache,
        v_cache=v_cache,
        slot_ids=slot_ids.to(torch.int32),
        q_starts=torch.tensor(starts, dtype=torch.int64),
        q_lens=torch.tensor(case.q_lens, dtype=torch.int32),
        kv_lens=torch.tensor(case.kv_lens, dtype=torch.int64),
        scale=1.0 / math.sqrt(case.head_dim),
        causal=case.causal,
    )
    if case.tree is not None:
        tree_mask = torch.randint(-(2**62), 2**62, (num_tokens,), generator=g)
        for start, q_len in zip(starts, case.q_lens):
            tree_mask[start : start + q_len] = tree_bits(q_len, case.tree, g)
        inp["tree_mask"] = tree_mask
    return inp


PAGE_SIZES = (16, 32, 64, 128)  # the --page-size values benchmarks/gpu_page_size.py compares


def paged(inp: dict, page_size: int, seed: int = 0) -> dict:
    """The same inputs over a page pool: every slot's positions cut into pages of `page_size`, the pages
    shuffled into a pool with spare NaN pages, and a page table naming them (the last page of a slot may run
    past its max_len; those rows are NaN too)."""
    g = torch.Generator().manual_seed(seed)
    k, v = inp["k_cache"], inp["v_cache"]
    num_slots, max_len = k.shape[:2]
    per_slot = -(-max_len // page_size)
    num_pages = num_slots * per_slot + 3
    order = torch.randperm(num_pages, generator=g)[: num_slots * per_slot]
    table = order.view(num_slots, per_slot).to(torch.int32)
    pools = []
    for cache in (k, v):
        pool = torch.full((num_pages, page_size, *cache.shape[2:]), float("nan"), dtype=cache.dtype)
        padded = torch.full((num_slots, per_slot * page_size, *cache.shape[2:]), float("nan"), dtype=cache.dtype)
        padded[:, :max_len] = cache
        pool[table.long().flatten()] = padded.view(num_slots * per_slot, page_size, *cache.shape[2:])
        pools.append(pool)
    return {**inp, "k_cache": pools[0], "v_cache": pools[1], "page_table": table}


def tree_bits(n: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """int64 [n] ancestors-or-self bits of a draft tree: node 0 is the root, parent[i] uniform in [0, i-1]
    ("random") or i - 1 ("chain", i.e. causal)."""
    bits: list[int] = []
    for i in range(n):
        parent = -1 if i == 0 else i - 1 if kind == "chain" else int(torch.randint(0, i, (1,), generator=g))
        bits.append((bits[parent] if parent >= 0 else 0) | (1 << i))
    # Two's complement int64: bit 63 is the sign bit; bits past 63 (only for n > 64) are dropped.
    bits = [b & ((1 << 64) - 1) for b in bits]
    return torch.tensor([b - (1 << 64) if b >= 1 << 63 else b for b in bits], dtype=torch.int64)


def naive_attention(inp: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 per-request, per-head softmax(q k^T) v with explicit masks; returns (out, covered-rows mask)."""
    q = inp["q"].double()
    out = torch.zeros_like(q)
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    group = q.shape[1] // inp["k_cache"].shape[2]
    meta = zip(*(inp[k].tolist() for k in ("slot_ids", "q_starts", "q_lens", "kv_lens")))
    tree_mask = inp.get("tree_mask")
    for slot, start, q_len, kv_len in meta:
        keys = inp["k_cache"][slot, :kv_len].double()
        values = inp["v_cache"][slot, :kv_len].double()
        qi = torch.arange(q_len)[:, None]
        kj = torch.arange(kv_len)[None, :]
        if tree_mask is not None:  # context keys, plus block row j iff bit j of the row's mask
            ctx = kv_len - q_len
            allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
            for i, m in enumerate(tree_mask[start : start + q_len].tolist()):
                allowed[i, ctx:] = torch.tensor([(m >> j) & 1 == 1 for j in range(q_len)])
        elif inp["causal"]:
            allowed = kj <= kv_len - q_len + qi
        else:
            allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
        for h in range(q.shape[1]):
            scores = q[start : start + q_len, h] @ keys[:, h // group].T * inp["scale"]
            probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            out[start : start + q_len, h] = probs @ values[:, h // group]
        covered[start : start + q_len] = True
    return out, covered


def call(fn, inp: dict, **kwargs) -> torch.Tensor:
    return fn(**inp, **kwargs)


# --------------------------------------------------------------------------------------------------------------------
# Reference vs naive loop
# --------------------------------------------------------------------------------------------------------------------

REFERENCE_CASES = [
    Case("single-prefill", q_lens=(33,), kv_lens=(33,)),
    Case("mixed-mha", q_lens=(1, 16, 45, 20), kv_lens=(70, 40, 60, 20), seed=1),
    Case("mixed-gqa3", q_lens=(1, 16, 45, 20, 1), kv_lens=(9, 16, 90, 20, 1), group=3, seed=2),
    Case("mixed-gqa4-noncausal", q_lens=(16, 1, 30, 16), kv_lens=(50, 5, 30, 17), group=4, causal=False, seed=3),
    Case("many-requests-gqa4", q_lens=(1,) * 10 + (16,) * 6 + (64, 8), kv_lens=tuple(range(20, 200, 10)), group=4),
    Case("decode-noncausal-gqa3", q_lens=(1, 1, 1), kv_lens=(1, 64, 13), group=3, causal=False, seed=4),
    Case("head128-bf16", q_lens=(16, 3, 24), kv_lens=(40, 3, 30), group=2, head_dim=128, dtype="bfloat16", seed=5),
]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=lambda c: c.name)
def test_reference_matches_naive(case: Case) -> None:
    inp = make_inputs(case)
    expected, covered = naive_attention(inp)
    got = call(slot_attention_reference, inp)
    assert got.dtype == inp["q"].dtype and got.shape == inp["q"].shape
    tol = 1e-4 if case.dtype == "float32" else 2e-2
    torch.testing.assert_close(got[covered].double(), expected[covered], atol=tol, rtol=tol)


# Random draft trees over ragged batches (incl. 0-context requests, q_len 1 and 16); causal is ignored.
TREE_REFERENCE_CASES = [
    Case("tree-mixed-mha", q_lens=(1, 16, 7, 12), kv_lens=(9, 16, 40, 12), tree="random", seed=11),
    Case("tree-gqa3-noncausal-flag", q_lens=(16, 5, 9, 1, 16), kv_lens=(70, 5, 30, 1, 33), group=3, causal=False,
         tree="random", seed=12),
    Case("tree-many-gqa4", q_lens=(3, 16, 8, 16, 2, 11), kv_lens=(3, 50, 8, 16, 90, 20), group=4, tree="random",
         seed=13),
    Case("tree-bf16-gqa2", q_lens=(16, 6), kv_lens=(24, 6), group=2, dtype="bfloat16", tree="random", seed=14),
    Case("tree-q64-sign-bit", q_lens=(64, 2), kv_lens=(70, 64), tree="random", seed=15),
]


@pytest.mark.parametrize("case", TREE_REFERENCE_CASES, ids=lambda c: c.name)
def test_reference_tree_mask_matches_naive(case: Case) -> None:
    inp = make_inputs(case)
    expected, covered = naive_attention(inp)
    got = call(slot_attention_reference, inp)
    tol = 1e-4 if case.dtype == "float32" else 2e-2
    torch.testing.assert_close(got[covered].double(), expected[covered], atol=tol, rtol=tol)
    # through the dispatcher too
    torch.testing.assert_close(call(slot_attention, inp, max_q_len=max(case.q_lens)), got)


@pytest.mark.parametrize("case", REFERENCE_CASES[:3] + TREE_REFERENCE_CASES[:1], ids=lambda c: c.name)
@pytest.mark.parametrize("page_size", [1, *PAGE_SIZES])
def test_reference_through_a_page_table_equals_contiguous_slots(case: Case, page_size: int) -> None:
    inp = make_inputs(case)
    assert torch.equal(call(slot_attention_reference, paged(inp, page_size)), call(slot_attention_reference, inp))


def test_page_table_validation() -> None:
    inp = paged(make_inputs(REFERENCE_CASES[0]), 16)
    with pytest.raises(ValueError, match="page_table must be contiguous int32"):
        call(slot_attention_reference, {**inp, "page_table": inp["page_table"].long()})
    with pytest.raises(ValueError, match="kv_len .* <= max_len"):
        call(slot_attention_reference, {**inp, "page_table": inp["page_table"][:, :1].contiguous()})


def test_reference_chain_tree_equals_causal() -> None:
    inp = make_inputs(Case("chain", q_lens=(1, 16, 9, 5), kv_lens=(20, 16, 40, 9), group=2, tree="chain", seed=16))
    tree_mask = inp.pop("tree_mask")
    owned = torch.zeros(inp["q"].shape[0], dtype=torch.bool)
    for start, q_len in zip(inp["q_starts"].tolist(), inp["q_lens"].tolist()):
        owned[start : start + q_len] = True
        assert tree_mask[start : start + q_len].tolist() == [(1 << (i + 1)) - 1 for i in range(q_len)]
    causal = call(slot_attention_reference, inp)
    tree = call(slot_attention_reference, inp, tree_mask=tree_mask)
    assert torch.equal(tree[owned], causal[owned])


def test_tree_tail_rows_name_each_lane_s_cache_row() -> None:
    """A node's table holds its keys in chain order from its context's last key tile on: context keys at their
    own rows, then its ancestors by depth (and itself) at ctx + their node index; lanes past it read row 0."""
    ctx = 190  # 62 keys into its key tile: deeper nodes reach the next one
    parents = [-1, 0, 0, 1, 2, 3, 3, 5]  # node 0 = the newest token; children follow their parents
    ancestry, depths = [], []
    for node, parent in enumerate(parents):
        ancestry.append([*(ancestry[parent] if parent >= 0 else []), node])
        depths.append(len(ancestry[-1]) - 1)
    bits = torch.tensor([sum(1 << a for a in line) for line in ancestry])
    positions = torch.tensor([ctx + d for d in depths])
    rows = tree_tail_rows(positions, bits)
    assert rows.dtype == torch.int32 and rows.shape == (len(parents), TREE_TABLE_KEYS)
    first = ctx // INVARIANT_BLOCK_N * INVARIANT_BLOCK_N
    for node, line in enumerate(ancestry):
        expected = list(range(first, ctx)) + [ctx + a for a in line]
        assert rows[node].tolist() == expected + [0] * (TREE_TABLE_KEYS - len(expected)), node
    # a chain's rows are its own positions
    chain = tree_tail_rows(torch.tensor([3, 4, 5]), torch.tensor([1, 3, 7]))
    assert chain[2].tolist() == [0, 1, 2, 3, 4, 5] + [0] * (TREE_TABLE_KEYS - 6)


def test_reference_tree_row_without_keys_is_zero() -> None:
    inp = make_inputs(Case("empty-row", q_lens=(3,), kv_lens=(3,), tree="chain"))
    start = inp["q_starts"][0]
    inp["tree_mask"][start + 1] = 0  # no context and no visible block row
    got = call(slot_attention_reference, inp)
    assert torch.equal(got[start + 1], torch.zeros_like(got[start + 1]))
    assert torch.isfinite(got[start : start + 3]).all()


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda d: d.update(tree_mask=d["tree_mask"].int()), TypeError, "tree_mask must be int64"),
        (lambda d: d.update(tree_mask=d["tree_mask"][:-1]), ValueError, "tree_mask must be 1-D"),
        (lambda d: d.update(tree_mask=d["tree_mask"][:, None]), ValueError, "tree_mask must be 1-D"),
        (lambda d: d.update(tree_mask=d["tree_mask"].tolist()), TypeError, "tree_mask must be a torch.Tensor"),
    ],
)
def test_tree_mask_validation(mutate, error: type[Exception], match: str) -> None:
    inp = make_inputs(Case("valid-tree", q_lens=(3, 2), kv_lens=(5, 2), tree="random"))
    mutate(inp)
    with pytest.raises(error, match=match):
        call(slot_attention_reference, inp)
    with pytest.raises(error, match=match):
        call(slot_attention, inp)


def test_tree_mask_q_len_limit() -> None:
    inp = make_inputs(Case("long-tree", q_lens=(65,), kv_lens=(70,), head_dim=16, tree="chain"))
    with pytest.raises(ValueError, match="q_len <= 64"):
        call(slot_attention_reference, inp)
    with pytest.raises(ValueError, match="q_len <= 64"):
        call(slot_attention, inp, max_q_len=65)


def test_triton_validates_tree_mask() -> None:
    pytest.importorskip("triton")
    from specpilot.kernels.slot_attention import slot_attention_triton

    inp = make_inputs(Case("tree", q_lens=(3, 2), kv_lens=(5, 2), tree="random"))
    with pytest.raises(ValueError, match="q_len <= 64"):  # from max_q_len alone: no sync, no launch
        call(slot_attention_triton, inp, max_q_len=65)
    with pytest.raises(TypeError, match="tree_mask must be int64"):
        call(slot_attention_triton, {**inp, "tree_mask": inp["tree_mask"].int()})
    with pytest.raises(ValueError, match="tree_mask must be 1-D"):
        call(slot_attention_triton, {**inp, "tree_mask": inp["tree_mask"][1:]})


def test_invariant_kernel_refuses_a_tile_height_that_would_change_bits() -> None:
    from specpilot.kernels.slot_attention import slot_attention_invariant

    inp = {k: v for k, v in make_inputs(Case("chain", q_lens=(3,), kv_lens=(5,))).items() if k != "causal"}
    positions = torch.zeros(inp["q"].shape[0], dtype=torch.int64)
    for dtype, block_m in ((torch.float32, 32), (torch.bfloat16, 64)):
        with pytest.raises(ValueError, match="block_m must be 16 or 32"):  # raised before any launch
            call(slot_attention_invariant, {**inp, "q": inp["q"].to(dtype)}, positions=positions, block_m=block_m)
    small = {k: v for k, v in make_inputs(Case("chain", q_lens=(3,), kv_lens=(5,), head_dim=32)).items() if k != "causal"}
    with pytest.raises(ValueError, match="under head_dim 64"):  # 32-row tiles round otherwise at head_dim 32
        call(slot_attention_invariant, {**small, "q": small["q"].to(torch.bfloat16)}, positions=positions, block_m=32)
    with pytest.raises(ValueError, match="per_token needs a tree pass"):  # a chain has no gathered tiles
        call(slot_attention_invariant, inp, positions=positions, per_token=True)


def test_small_heads_keep_16_row_tiles() -> None:
    """The launch the engine takes for a long prefill: 32-row tiles from head_dim 64 up, 16 below (the tiny
    test models' 32-wide heads, where the taller tile rounds some rows otherwise on the H100)."""
    from specpilot.kernels.slot_attention import invariant_launch

    cpu = torch.device("cpu")
    for head_dim, block_m in ((32, 16), (64, 32), (128, 32)):
        launch = invariant_launch(cpu, 4, 2, 2, 256, head_dim, False, torch.bfloat16)
        assert launch.block_m == block_m, head_dim


def test_dispatch_on_cpu_uses_torch() -> None:
    inp = make_inputs(REFERENCE_CASES[1])
    torch.testing.assert_close(call(slot_attention, inp), call(slot_attention_reference, inp), equal_nan=True)
    with pytest.raises(ValueError, match="backend"):
        call(slot_attention, inp, backend="cuda")


def test_zero_length_request_is_skipped() -> None:
    inp = make_inputs(Case("with-empty", q_lens=(4, 1), kv_lens=(8, 3)))
    inp["q_lens"][1] = 0
    expected, covered = naive_attention(inp)
    got = call(slot_attention_reference, inp)
    torch.testing.assert_close(got[covered].double(), expected[covered], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda d: d.update(q=d["q"][0]), ValueError, "q must be"),
        (lambda d: d.update(v_cache=d["v_cache"][:, :-1]), ValueError, "v_cache shape"),
        (lambda d: d.update(q=d["q"][:, :1]), ValueError, "multiple of num_kv_heads"),
        (lambda d: d.update(q=d["q"][..., :32]), ValueError, "head_dim mismatch"),
        (lambda d: d.update(k_cache=d["k_cache"].half()), TypeError, "dtype mismatch"),
        (lambda d: d.update(kv_lens=d["kv_lens"][:1]), ValueError, "kv_lens must be 1-D"),
        (lambda d: d.update(q_lens=d["q_lens"].float()), TypeError, "q_lens must be int32 or int64"),
        (lambda d: d.update(kv_lens=d["q_lens"] - 1), ValueError, "q_len"),
        (lambda d: d.update(slot_ids=d["slot_ids"] + 100), ValueError, "slot id"),
    ],
)
def test_reference_validates_inputs(mutate, error: type[Exception], match: str) -> None:
    inp = make_inputs(Case("valid", q_lens=(3, 2), kv_lens=(5, 2)))
    mutate(inp)
    with pytest.raises(error, match=match):
        call(slot_attention_reference, inp)


def test_triton_validates_head_dim() -> None:
    pytest.importorskip("triton")
    from specpilot.kernels.slot_attention import slot_attention_triton

    inp = make_inputs(Case("odd-head-dim", q_lens=(2,), kv_lens=(3,), head_dim=48))
    with pytest.raises(ValueError, match="power-of-two head_dim"):  # raised before any launch
        call(slot_attention_triton, inp)


# --------------------------------------------------------------------------------------------------------------------
# Triton (interpreter, subprocess) vs reference
# --------------------------------------------------------------------------------------------------------------------

# Decode/verify batches (q_len * group <= 64) take short-row, 128-key tiles; prompt-sized ones 64x64 tiles.
# kv_lens past two 128-key tiles make every one of 3 splits non-empty for some requests and empty for others.
TRITON_CASES = [
    Case("prefill-gqa4-causal", q_lens=(1, 16, 40, 23), kv_lens=(30, 50, 41, 23), group=4),
    Case("prefill-gqa4-causal-split3", q_lens=(1, 16, 40, 23), kv_lens=(30, 50, 41, 23), group=4, num_kv_splits=3),
    Case("mixed-mha-noncausal", q_lens=(5, 16, 1), kv_lens=(5, 70, 9), causal=False, seed=1),
    Case("mixed-mha-noncausal-split3", q_lens=(5, 16, 1), kv_lens=(5, 70, 9), causal=False, num_kv_splits=3, seed=1),
    Case("decode-gqa4-split3", q_lens=(1, 1, 1), kv_lens=(300, 2, 129), group=4, num_kv_splits=3, seed=2),
    Case("verify-gqa3-bf16", q_lens=(16, 4), kv_lens=(150, 4), group=3, dtype="bfloat16", seed=3),
    Case("verify-gqa3-bf16-split3", q_lens=(16, 4), kv_lens=(150, 4), group=3, dtype="bfloat16", num_kv_splits=3),
    Case("prefill-bf16-gqa4", q_lens=(24, 1), kv_lens=(24, 40), group=4, dtype="bfloat16", seed=4),
    # A DFlash draft block: non-causal, 8 splits of which the short request fills one (the combine's row blocks
    # of 16 cover a block's 16 tokens x 6 heads in six programs).
    Case("draft-gqa3-noncausal-split8", q_lens=(16, 16), kv_lens=(300, 20), group=3, causal=False,
         dtype="bfloat16", num_kv_splits=8, seed=8),
    # Prompt chunks after a cached prefix: tile boundaries fall between the rows' causal limits.
    Case("chunked-prefill", q_lens=(40, 100), kv_lens=(160, 180), seed=7),
    Case("chunked-prefill-bf16-split3", q_lens=(40, 100), kv_lens=(160, 180), dtype="bfloat16", num_kv_splits=3),
    # Group 3 does not divide the row block, so a block boundary splits one token's heads.
    Case("prefill-gqa3-split-token", q_lens=(50, 1), kv_lens=(60, 7), group=3, seed=6),
    Case("prefill-gqa3-bf16-split3", q_lens=(50, 16), kv_lens=(50, 90), group=3, dtype="bfloat16", num_kv_splits=3),
    Case("head128-gqa2-split3", q_lens=(8, 1), kv_lens=(40, 17), group=2, head_dim=128, num_kv_splits=3, seed=5),
]
# Tree verification: decode-config (q_len * group <= 64) and prompt-config (> 64 rows, several row blocks)
# tiles; blocks straddling a 128-key tile (kv 140, q 16: ctx 124), 0-context requests, bit 63 (q_len 64).
TREE_TRITON_CASES = [
    Case(f"tree-{name}-split{splits}", q_lens=q_lens, kv_lens=kv_lens, group=group, dtype=dtype, tree=tree,
         num_kv_splits=splits, seed=20 + seed)
    for splits in (1, 2)
    for seed, (name, q_lens, kv_lens, group, dtype, tree) in enumerate([
        ("gqa4", (16, 1, 5, 9), (140, 1, 5, 300), 4, "float32", "random"),
        ("gqa3-rows96", (32, 7), (150, 7), 3, "float32", "random"),
        ("gqa2-bf16", (16, 12), (16, 200), 2, "bfloat16", "random"),
        ("q64-chain", (64, 3), (64, 130), 1, "float32", "chain"),
        ("q64-random", (64,), (100,), 2, "float32", "random"),
    ])
]
TRITON_TOL = {"float32": 1e-4, "bfloat16": 3e-2}
PAGED_CASES = [TRITON_CASES[0], TRITON_CASES[4], TRITON_CASES[9], TREE_TRITON_CASES[0]]


def _triton_errors() -> dict[str, float]:
    """Runs in the interpreter subprocess: max |triton - reference| over covered rows, per case."""
    from specpilot.kernels.slot_attention import slot_attention_triton

    patch_dot()

    errors = {}
    for case in TRITON_CASES + TREE_TRITON_CASES:
        inp = make_inputs(case)
        _, covered = naive_attention(inp)
        expected = call(slot_attention_reference, inp).float()
        # max_q_len given explicitly, as a CUDA-graph caller would
        got = call(slot_attention_triton, inp, max_q_len=max(case.q_lens), num_kv_splits=case.num_kv_splits)
        assert got.dtype == inp["q"].dtype
        errors[case.name] = (got.float() - expected)[covered].abs().max().item()
    for case in PAGED_CASES:  # through a page table: the same bits as over contiguous slots
        inp = make_inputs(case)
        kwargs = dict(max_q_len=max(case.q_lens), num_kv_splits=case.num_kv_splits)
        expected = call(slot_attention_triton, inp, **kwargs)
        _, covered = naive_attention(inp)
        for page_size in PAGE_SIZES:
            got = call(slot_attention_triton, paged(inp, page_size, seed=page_size), **kwargs)
            errors[f"paged{page_size}-{case.name}"] = float(not torch.equal(got[covered], expected[covered]))
    return errors


triton_errors = interpreter_fixture(__file__)


@pytest.mark.parametrize("case", TRITON_CASES + TREE_TRITON_CASES, ids=lambda c: c.name)
def test_triton_matches_reference(triton_errors: dict[str, float], case: Case) -> None:
    err = triton_errors[case.name]
    assert err <= TRITON_TOL[case.dtype], f"{case.name}: max abs error {err}"


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: c.name)
def test_triton_through_a_page_table_gives_the_same_bits(triton_errors: dict[str, float], case: Case,
                                                          page_size: int) -> None:
    assert triton_errors[f"paged{page_size}-{case.name}"] == 0.0


if __name__ == "__main__":
    print(json.dumps(_triton_errors()))


# The H100 sweep of session 27 (docs/RESULTS.md, gpu_attention_backends.py --invariant-forms, context 1024): per
# (shape, batch, pass) the launch that measured fastest, or within 3% of it, as (block_m, split_grid).
# llama8b: 8 kv heads, group 4, head_dim 128; embedded: 3 kv heads, group 3, head_dim 64.
H100_FASTEST = {
    ("llama8b", 8, "decode"): (16, True), ("llama8b", 16, "decode"): (16, True),
    ("llama8b", 32, "decode"): (16, False), ("llama8b", 8, "chain"): (32, False),
    ("llama8b", 16, "chain"): (32, False), ("llama8b", 32, "chain"): (32, False),
    ("llama8b", 8, "tree"): (16, True), ("llama8b", 16, "tree"): (32, True), ("llama8b", 32, "tree"): (32, False),
    ("llama8b", 64, "tree"): (32, False), ("embedded", 64, "decode"): (16, True),
    ("embedded", 32, "chain"): (16, True), ("embedded", 64, "chain"): (16, False),
    ("embedded", 32, "tree"): (16, True), ("embedded", 64, "tree"): (16, True),
}


@pytest.mark.parametrize("case", list(H100_FASTEST))
def test_invariant_launch_takes_the_forms_the_sweep_measured_fastest(case, monkeypatch) -> None:
    import specpilot.kernels.slot_attention as sa

    monkeypatch.setattr(sa, "_sm_count", lambda device: 132)  # an H100's (and an H200's) SMs
    shape, batch, kind = case
    kv_heads, group, head_dim = {"llama8b": (8, 4, 128), "embedded": (3, 3, 64)}[shape]
    launch = sa.invariant_launch(torch.device("cuda"), batch, kv_heads, group, 1 if kind == "decode" else 16,
                                 head_dim, kind == "tree", torch.bfloat16)
    assert (launch.block_m, launch.split_grid) == H100_FASTEST[case]
    assert not launch.per_token
