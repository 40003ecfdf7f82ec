"""The B12 GEMM (kernels/b12_gemm.py): its reference is the bf16 GEMM of the decoded matrix, and under the
Triton interpreter the kernel gives bitwise skinny_gemm's output on the decoded weights with the same tiles
(K across a short last block, bias or none, M = 1, 4, 16, K tiles of 128 and 64) whatever the escapes:
none at all, a few (the patch unrolled), or dense ones (many in one tile and in the short last block, a
whole row of them, inf and NaN: the patch loop), two escape groups of rows; on CUDA it gives invariant_gemm's
bits at every M, and its packed PTX decode the plain one's."""

from __future__ import annotations

import json

import pytest
import torch
from triton_interpret import interpreter_fixture, patch_dot

from specpilot.formats.b12 import decode, encode
from specpilot.kernels.b12_gemm import b12_gemm_reference
from specpilot.kernels.skinny_gemm import SkinnyConfig, skinny_gemm_reference

# M, N, K, bias, escapes
CASES = [(1, 40, 600, False, "few"), (4, 40, 600, True, "dense"), (16, 70, 512, False, "few"),
         (3, 17, 130, True, "dense"), (2, 33, 256, False, "none"), (1, 300, 512, False, "few")]  # 2 row groups
CONFIG = SkinnyConfig(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=2)
CONFIG_K64 = SkinnyConfig(block_n=16, block_k=64, split_k=1, num_warps=4, num_stages=2)  # the prefill tiles' K


def weights(n: int, k: int, escapes: str, g: torch.Generator) -> torch.Tensor:
    """Rows of varied scale. "none": exponents within one window (nothing listed); "few": pairs of weights
    far above their row's window here and there (a handful listed); "dense": besides, one tile full of distinct outlier
    exponents, the short last block's too, a row whose exponents span the range, inf and NaN."""
    if escapes == "none":
        mantissa = torch.rand(n, k, generator=g) + 1
        sign = torch.randint(0, 2, (n, k), generator=g) * 2 - 1
        return (sign * mantissa * 2.0 ** -torch.randint(3, 17, (n, k), generator=g)).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g)) * 0.02).to(torch.bfloat16)
    spots = torch.randint(0, n * k - 1, (12,), generator=g)  # two outlier exponents side by side: one listed
    w.view(-1)[spots] = torch.tensor(64.0, dtype=torch.bfloat16)
    w.view(-1)[spots + 1] = torch.tensor(-1024.0, dtype=torch.bfloat16)  # large: a wrong decode shows
    if escapes == "dense":
        outliers = 2.0 ** torch.arange(-60, 60, 4, dtype=torch.float64) * (torch.rand(30, generator=g) + 1)
        w[1, 3 : 3 + outliers.numel()] = outliers.to(torch.bfloat16)  # one tile, many exponents
        w[2:5, -9:] = outliers[:27].view(3, 9).to(torch.bfloat16)  # the last block's end
        spread = torch.randn(k, generator=g) * 2.0 ** torch.randint(-120, 120, (k,), generator=g)
        w[n - 1, ::2] = spread[::2].to(torch.bfloat16)  # a row of exponents all over
        w[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    return w


def make_case(m: int, n: int, k: int, bias: bool, escapes: str, seed: int = 0, device: str = "cpu"):
    """x, the weights' B12 planes (encoded on `device`) and the bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    w = weights(n, k, escapes, g).to(device)
    return x.to(device), encode(w), b.to(device) if b is not None else None


def test_cases_cover_every_patch_path():
    """No hard escapes (no patch code), a few a segment (unrolled), past the unrolled bound (a loop)."""
    most = {case[-1]: make_case(*case)[1].max_block_escapes for case in CASES}
    assert most["none"] == 0 and 1 <= most["few"] <= 8 and most["dense"] > 8


def test_reference_is_the_bf16_gemm_of_the_decoded_matrix():
    x, planes, b = make_case(4, 40, 600, True, "dense")
    assert planes.num_escapes >= 40
    got, expected = b12_gemm_reference(x, planes, b), skinny_gemm_reference(x, decode(planes), b)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))  # NaN included


def _triton_results() -> dict[str, bool]:
    from specpilot.kernels.b12_gemm import b12_gemm
    from specpilot.kernels.skinny_gemm import skinny_gemm

    patch_dot()
    out = {}
    for case in CASES:
        x, p, b = make_case(*case)
        for label, config in (("", CONFIG), (" k64", CONFIG_K64)):
            got = b12_gemm(x, p, b, config=config)
            expected = skinny_gemm(x, decode(p), b, config=config)
            out[f"{case}{label}"] = torch.equal(got.view(torch.int16), expected.view(torch.int16))
    return out


triton_results = interpreter_fixture(__file__)


@pytest.mark.parametrize("case", [str(c) for c in CASES] + [f"{c} k64" for c in CASES])
def test_triton_equals_the_bf16_kernel_on_the_decoded_weights(triton_results: dict[str, bool], case: str) -> None:
    assert triton_results[case]


if __name__ == "__main__":
    print(json.dumps(_triton_results()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k,escapes", [(6144, 4096, "few"), (4096, 14336, "few"), (1000, 600, "dense"),
                                         (512, 1024, "none")])
@pytest.mark.parametrize("m", [1, 4, 16, 33, 64, 100, 300])
def test_cuda_equals_invariant_gemm_on_the_decoded_weights(m, n, k, escapes):
    """The model's B12 path: at every M the rows are bitwise the bf16 weight's invariant path."""
    from specpilot.kernels.b12_gemm import b12_gemm
    from specpilot.kernels.skinny_gemm import invariant_gemm

    x, p, b = make_case(m, n, k, n == 1000, escapes, seed=m, device="cuda")
    got = b12_gemm(x, p, b)
    expected = invariant_gemm(x, decode(p), b)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k,escapes", [(6144, 4096, "few"), (1000, 600, "dense")])
@pytest.mark.parametrize("m", [1, 16])
def test_cuda_packed_decode_equals_the_plain_one(m, n, k, escapes):
    """The PTX decode CUDA runs gives the bits of the plain one the interpreter tests above."""
    from specpilot.kernels.b12_gemm import b12_gemm

    x, p, b = make_case(m, n, k, n == 1000, escapes, seed=m, device="cuda")
    got, plain = b12_gemm(x, p, b), b12_gemm(x, p, b, packed=False)
    assert torch.equal(got.view(torch.int16), plain.view(torch.int16))
