"""The CUDA C++ B12 kernel under evaluation (benchmarks/b12_gemv.cu, issue 21): in both its forms (16 rows of W a
warp as the MMA's A operand, 8 as its B), its fragment-order planes decode, as the kernel's lanes read them, to
exactly the B12 matrix — alts, hard escapes, ±0, subnormals, infinities and NaN included — and the kernel compiles
for sm_90 where nvcc is installed. Its bitwise check against the bf16
kernel and its timing run on a GPU (benchmarks/gpu_b12_gemm.py --cuda-stages)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import b12_cuda  # noqa: E402

from specpilot.formats.b12 import encode  # noqa: E402
from specpilot.kernels.b12_gemm import b12_decode_reference  # noqa: E402


def outliers(n: int, k: int, count: int, seed: int) -> torch.Tensor:
    """Gaussian weights with far exponents scattered in (alts and hard escapes), specials among them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    idx = torch.randint(0, n * k, (count,), generator=g)
    w.view(-1)[idx] = torch.randn(count, generator=g) * 1e4
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40]).repeat(count // 10)
    w.view(-1)[idx[: specials.numel()]] = specials
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("rows", [16, 8])
@pytest.mark.parametrize("n,k,count", [(16, 128, 0), (48, 576, 40), (32, 1024, 300), (272, 256, 150)])
def test_fragment_order_decodes_to_the_b12_matrix(n, k, count, rows):
    chunk = b12_cuda.FORMS[rows]
    if k % chunk:
        pytest.skip(f"the {rows}-row form takes K % {chunk} == 0")
    planes = encode(outliers(n, k, count, seed=n + k))
    if count:
        assert planes.num_escapes > 0  # the kernel's patch path is exercised
    sm_frag, code_frag = b12_cuda.fragments(planes, rows)
    assert sm_frag.shape == (n // rows, k // chunk, 32, 32) and code_frag.shape == (n // rows, k // chunk, 32, 16)
    assert sm_frag.numel() + code_frag.numel() == planes.sm.numel() + planes.code.numel()  # the same 12 bits a weight
    decoded = b12_cuda.fragment_decode_reference(sm_frag, code_frag, planes, rows)
    assert torch.equal(decoded.view(torch.int16), b12_decode_reference(planes).view(torch.int16))


def test_a_lane_holds_its_mma_fragment():
    """Lane 4g + q's bytes of k16 step s: rows g and g + 8, columns 2q, 2q + 1 and 2q + 8, 2q + 9 (m16n8k16's A);
    in the 8-row form, row g's columns 2q, 2q + 1, 2q + 8, 2q + 9 (its B)."""
    n, k = 16, 128
    sm = (torch.arange(n).view(n, 1) * 64 + torch.arange(k)).to(torch.uint8)  # byte = (row * 64 + col) % 256
    planes = encode(torch.zeros(n, k, dtype=torch.bfloat16))
    planes = type(planes)(**{**vars(planes), "sm": sm})
    lane, s = 4 * 3 + 2, 1  # g = 3, q = 2
    a_bytes = b12_cuda.fragments(planes, 16)[0][0, 0, lane, 8 * s : 8 * s + 8].tolist()
    assert a_bytes == [(r * 64 + 16 * s + c) % 256 for c, r in ((4, 3), (5, 3), (4, 11), (5, 11), (12, 3), (13, 3),
                                                                (12, 11), (13, 11))]
    b_bytes = b12_cuda.fragments(planes, 8)[0][1, 0, lane, 4 * s : 4 * s + 4].tolist()  # rows 8..15: row 11
    assert b_bytes == [(11 * 64 + 16 * s + c) % 256 for c in (4, 5, 12, 13)]


def test_shapes_the_kernel_cannot_tile_are_refused():
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 64 == 0"):
        b12_cuda.fragments(encode(torch.zeros(24, 64, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 64 == 0"):
        b12_cuda.fragments(encode(torch.zeros(16, 96, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="8-row form takes N % 8 == 0 and K % 128 == 0"):
        b12_cuda.fragments(encode(torch.zeros(24, 64, dtype=torch.bfloat16)), 8)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_kernel_compiles_for_hopper_without_spilling(tmp_path):
    report = b12_cuda.compile_cubin(tmp_path / "b12_gemv.cubin")
    assert (tmp_path / "b12_gemv.cubin").stat().st_size > 0
    assert "0 bytes spill" in report and "bytes stack frame" in report
    assert all(" 0 bytes stack frame" in line for line in report.splitlines() if "stack frame" in line)
