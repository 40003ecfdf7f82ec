"""Warming the GEMMs of an engine without CUDA graphs: `variant_rows` names one row count per kernel variant, and
every row count up to the limit launches one of those variants (recorded on CPU, not run) — so after the warm-up
no pass compiles mid-step."""

import pytest
import torch
from triton_launches import LaunchRecorder

from specpilot.kernels import skinny_gemm as sg

# (n, k): a narrow, a wide and an uneven weight; the invariant path up to prefill's tiles, skinny_gemm to its limit
SHAPES = [(96, 64), (6400, 256), (100, 72)]


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("invariant, max_m", [(True, 2200), (False, 32)])
def test_the_warm_rows_launch_every_variant_that_any_row_count_does(n, k, invariant, max_m, monkeypatch):
    seen: dict[tuple, str] = {}
    phase = ["warm"]
    monkeypatch.setattr(sg, "_skinny_gemm_kernel", LaunchRecorder(seen, phase, "gemm"))
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    gemm = sg.invariant_gemm if invariant else sg.skinny_gemm
    rows = sg.variant_rows(n, k, max_m, invariant)
    for m in rows:
        gemm(torch.zeros(m, k, dtype=torch.bfloat16), w)
    assert len(seen) == len(rows)  # one variant a warm row: none wasted
    phase[0] = "run"
    for m in range(1, max_m + 1):
        gemm(torch.zeros(m, k, dtype=torch.bfloat16), w)
    assert [key for key, p in seen.items() if p == "run"] == []
    assert rows[:2] == [1, 2] and 16 in rows  # M = 1 and multiples of 16 are variants of their own


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("invariant", [True, False])
def test_after_warm_linears_no_product_compiles_on_cuda(invariant):
    from triton import knobs

    from specpilot.models.linear import Linear, warm_linears

    linear = Linear(256, 192).to("cuda", torch.bfloat16)
    linear.weight.normal_()
    linear.batch_invariant = invariant
    assert warm_linears([linear], 300) > 0
    compiled = []
    saved = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *_, **kwargs: compiled.append(kwargs.get("key"))
    try:
        for m in range(1, 301):
            linear(torch.randn(m, 256, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = saved
    assert compiled == []
