"""The B12 GEMM (kernels/b12_gemm.py): its reference is the bf16 GEMM of the decoded matrix, and under the
Triton interpreter the kernel gives bitwise skinny_gemm's output on the decoded weights with the same tiles
(K across a short last block, escapes in several segments, bias or none, M = 1, 4, 16, K tiles of 128 and 64);
on CUDA it gives invariant_gemm's bits at every M."""

from __future__ import annotations

import json

import pytest
import torch
from triton_interpret import interpreter_fixture, patch_dot

from specpilot.formats.b12 import decode, encode
from specpilot.kernels.b12_gemm import b12_gemm_reference
from specpilot.kernels.skinny_gemm import SkinnyConfig, skinny_gemm_reference

CASES = [(1, 40, 600, False), (4, 40, 600, True), (16, 70, 512, False), (3, 17, 130, True)]  # M, N, K, bias
CONFIG = SkinnyConfig(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=2)
CONFIG_K64 = SkinnyConfig(block_n=16, block_k=64, split_k=1, num_warps=4, num_stages=2)  # the prefill tiles' K


def make_case(m: int, n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g)) * 0.02).to(torch.bfloat16)
    w.view(-1)[torch.randint(0, n * k, (25,), generator=g)] = torch.tensor(3e-30, dtype=torch.bfloat16)  # escapes
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return x, encode(w), b


def test_reference_is_the_bf16_gemm_of_the_decoded_matrix():
    x, planes, b = make_case(4, 40, 600, True)
    assert planes.num_escapes >= 25
    got = b12_gemm_reference(x, planes.sm, planes.code, planes.base, planes.exc_off, planes.exc_val, b)
    assert torch.equal(got, skinny_gemm_reference(x, decode(planes), b))


def _triton_results() -> dict[str, bool]:
    from specpilot.kernels.b12_gemm import b12_gemm
    from specpilot.kernels.skinny_gemm import skinny_gemm

    patch_dot()
    out = {}
    for case in CASES:
        x, p, b = make_case(*case)
        got = b12_gemm(x, p.sm, p.code, p.base, p.exc_off, p.exc_val, b, config=CONFIG)
        expected = skinny_gemm(x, decode(p), b, config=CONFIG)
        out[str(case)] = torch.equal(got.view(torch.int16), expected.view(torch.int16))
        got = b12_gemm(x, p.sm, p.code, p.base, p.exc_off, p.exc_val, b, config=CONFIG_K64)
        expected = skinny_gemm(x, decode(p), b, config=CONFIG_K64)
        out[f"{case} k64"] = torch.equal(got.view(torch.int16), expected.view(torch.int16))
    return out


triton_results = interpreter_fixture(__file__)


@pytest.mark.parametrize("case", [str(c) for c in CASES] + [f"{c} k64" for c in CASES])
def test_triton_equals_the_bf16_kernel_on_the_decoded_weights(triton_results: dict[str, bool], case: str) -> None:
    assert triton_results[case]


if __name__ == "__main__":
    print(json.dumps(_triton_results()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 600)])
@pytest.mark.parametrize("m", [1, 4, 16, 33, 64, 100, 300])
def test_cuda_equals_invariant_gemm_on_the_decoded_weights(m, n, k):
    """The model's B12 path: at every M the rows are bitwise the bf16 weight's invariant path."""
    from specpilot.kernels.b12_gemm import b12_gemm
    from specpilot.kernels.skinny_gemm import invariant_gemm

    x, p, b = make_case(m, n, k, bias=n == 1000, seed=m)
    x, b = x.cuda(), b.cuda() if b is not None else None
    planes = [t.cuda() for t in (p.sm, p.code, p.base, p.exc_off, p.exc_val)]
    got = b12_gemm(x, *planes, b)
    expected = invariant_gemm(x, decode(p).cuda(), b)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
