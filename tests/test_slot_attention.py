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
from triton_interpret import patch_bf16_dot, run_module

from specpilot.kernels.slot_attention import slot_attention, slot_attention_reference


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


def make_inputs(case: Case) -> dict:
    """Random inputs with gaps between requests' query rows and slots in random order.

    Cache entries no request owns (positions >= kv_len, unused slots) are NaN, so any read of them shows up.
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
    return dict(
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


def naive_attention(inp: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 per-request, per-head softmax(q k^T) v with explicit masks; returns (out, covered-rows mask)."""
    q = inp["q"].double()
    out = torch.zeros_like(q)
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    group = q.shape[1] // inp["k_cache"].shape[2]
    meta = zip(*(inp[k].tolist() for k in ("slot_ids", "q_starts", "q_lens", "kv_lens")))
    for slot, start, q_len, kv_len in meta:
        keys = inp["k_cache"][slot, :kv_len].double()
        values = inp["v_cache"][slot, :kv_len].double()
        qi = torch.arange(q_len)[:, None]
        kj = torch.arange(kv_len)[None, :]
        allowed = kj <= kv_len - q_len + qi if inp["causal"] else torch.ones(q_len, kv_len, dtype=torch.bool)
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
    # Prompt chunks after a cached prefix: tile boundaries fall between the rows' causal limits.
    Case("chunked-prefill", q_lens=(40, 100), kv_lens=(160, 180), seed=7),
    Case("chunked-prefill-bf16-split3", q_lens=(40, 100), kv_lens=(160, 180), dtype="bfloat16", num_kv_splits=3),
    # Group 3 does not divide the row block, so a block boundary splits one token's heads.
    Case("prefill-gqa3-split-token", q_lens=(50, 1), kv_lens=(60, 7), group=3, seed=6),
    Case("prefill-gqa3-bf16-split3", q_lens=(50, 16), kv_lens=(50, 90), group=3, dtype="bfloat16", num_kv_splits=3),
    Case("head128-gqa2-split3", q_lens=(8, 1), kv_lens=(40, 17), group=2, head_dim=128, num_kv_splits=3, seed=5),
]
TRITON_TOL = {"float32": 1e-4, "bfloat16": 3e-2}


def _triton_errors() -> dict[str, float]:
    """Runs in the interpreter subprocess: max |triton - reference| over covered rows, per case."""
    from specpilot.kernels.slot_attention import slot_attention_triton

    patch_bf16_dot()

    errors = {}
    for case in TRITON_CASES:
        inp = make_inputs(case)
        _, covered = naive_attention(inp)
        expected = call(slot_attention_reference, inp).float()
        # max_q_len given explicitly, as a CUDA-graph caller would
        got = call(slot_attention_triton, inp, max_q_len=max(case.q_lens), num_kv_splits=case.num_kv_splits)
        assert got.dtype == inp["q"].dtype
        errors[case.name] = (got.float() - expected)[covered].abs().max().item()
    return errors


@pytest.fixture(scope="module")
def triton_errors() -> dict[str, float]:
    pytest.importorskip("triton")
    return run_module(__file__)


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: c.name)
def test_triton_matches_reference(triton_errors: dict[str, float], case: Case) -> None:
    err = triton_errors[case.name]
    assert err <= TRITON_TOL[case.dtype], f"{case.name}: max abs error {err}"


if __name__ == "__main__":
    print(json.dumps(_triton_errors()))
