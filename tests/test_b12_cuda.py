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
from specpilot.kernels.b12_gemm import as_int16, b12_decode_reference  # noqa: E402


def outliers(n: int, k: int, count: int, seed: int) -> torch.Tensor:
    """Gaussian weights with far exponents scattered in (alts and hard escapes), ±inf, NaN, -0 and subnormals among
    them."""
    return b12_cuda.outlier_matrix(n, k, count, [float("inf"), float("-inf"), float("nan"), -0.0, 1e-40], seed)


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


@pytest.mark.skipif(shutil.which("nvcc") is None or b12_cuda.CUOBJDUMP is None or not b12_cuda.CUOBJDUMP.exists(),
                    reason="needs nvcc and the triton wheel's cuobjdump")
def test_the_k_loop_count_finds_each_form_s_mmas_a_chunk(tmp_path):
    """k_loop_opcodes reads one chunk's body of every instantiation: a k16 step's MMA per n8 tile of x (16-row form),
    one per step (8-row form), and the pipelined form's two-chunk trip halved."""
    b12_cuda.compile_cubin(tmp_path / "b12_gemv.cubin")
    loops = b12_cuda.k_loop_opcodes(tmp_path / "b12_gemv.cubin")
    expected = {f"16 rows, M <= 8, STAGES={s}": 4 for s in (4, 8, 16)} | {
        f"16 rows, M > 8, STAGES={s}": 8 for s in (4, 8, 16)} | {
        f"{form}, STAGES={s}, M {m}": 8 for form in ("8 rows", "8 rows, pipelined") for s in (4, 8, 16)
        for m in ("<= 8", "> 8")}
    assert {name: ops.get("HMMA") for name, ops in loops.items()} == expected


# ---- the kernel's arithmetic, emulated from the PTX ISA's definitions (prmt, lop3, mma.m16n8k16 fragments) ----
def _prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32 default mode: result byte n is byte (sel & 7) of b:a, or that byte's sign spread if sel & 8."""
    pool = (b << 32 | a).to_bytes(8, "little")
    out = 0
    for n in range(4):
        sel = selector >> 4 * n & 0xF
        byte = pool[sel & 7]
        out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << 8 * n
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    return sum(1 << i for i in range(32) if lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1)) & 1)


def _decode4(sm: int, cod: int, base4: int, alt4: int) -> tuple[int, int]:
    """b12_gemv.cu's decode4, instruction by instruction."""
    m32 = 0xFFFFFFFF
    msk = _prmt((cod + 0x71717171) & m32, 0, 0xBA98)
    ex = _lop3((cod + base4) & m32, alt4, msk, 0xD8)
    hib = _lop3(sm, ex >> 1, 0x80808080, 0xE4)
    lob = _lop3((ex << 7) & m32, sm, 0x80808080, 0xE4)
    return _prmt(lob, hib, 0x5140), _prmt(lob, hib, 0x7362)


def _halves(reg: int) -> list[float]:
    """A 32-bit register as its two bf16 values, the lower half first (the fragment's element order)."""
    raw = torch.tensor([reg & 0xFFFF, reg >> 16], dtype=torch.int32)
    return as_int16(raw).view(torch.bfloat16).float().tolist()


def _word(data: torch.Tensor, index: int) -> int:
    return int.from_bytes(bytes(data[4 * index : 4 * index + 4].tolist()), "little")


def _lanes(planes, row: int, col0: int, rows: int) -> tuple[int, int]:
    """A lane's base and alt exponent bytes as the kernel packs them (row: g's; 16-row form: g + 8's in lanes 2, 3)."""
    alt = planes.alt[col0 // 256]
    if rows == 16:
        return (int(planes.base[row]) * 0x0101 | int(planes.base[row + 8]) * 0x01010000,
                int(alt[row]) * 0x0101 | int(alt[row + 8]) * 0x01010000)
    return int(planes.base[row]) * 0x01010101, int(alt[row]) * 0x01010101


def _emulate(x: torch.Tensor, planes, rows: int) -> torch.Tensor:
    """y = x @ W.T as the kernel computes it: per warp and chunk, each lane's words decoded into the registers the
    kernel hands mma.sync, read back through the PTX ISA's m16n8k16 fragment layouts (A 16x16 row-major, B 16x8,
    C 16x8), the product accumulated in fp32, C written where the kernel's epilogue writes it. Hard escapes left
    out (the fragment-order test covers their bits)."""
    sm_frag, code_frag = b12_cuda.fragments(planes, rows)
    m, (n, k) = x.shape[0], planes.shape
    chunk = b12_cuda.FORMS[rows]
    xf = x.float()
    out = torch.zeros(m, n)
    for tile in range(n // rows):
        acc = torch.zeros(16, 16 if rows == 16 else 8)  # C of each n8 tile side by side (16-row form: x rows 0..15)
        for c in range(k // chunk):
            col0 = c * chunk
            for s in range(chunk // 16):
                a_mat, b_mat = torch.zeros(16, 16), torch.zeros(16, 16 if rows == 16 else 8)
                for lane in range(32):
                    g, q = lane // 4, lane % 4
                    base4, alt4 = _lanes(planes, tile * rows + g, col0, rows)
                    sm, code = sm_frag[tile, c, lane], code_frag[tile, c, lane]
                    if rows == 16:  # words 2s + j of sm, code word s (low nibbles j = 0): A registers
                        regs = []
                        for j in range(2):
                            cod = _word(code, s) >> 4 * j & 0x0F0F0F0F
                            regs += _decode4(_word(sm, 2 * s + j), cod, base4, alt4)
                        a0, a2, a4, a6 = regs  # a[s][0..3]: (g, 2q), (g + 8, 2q), (g, 2q + 8), (g + 8, 2q + 8)
                        for reg, (r, kk) in zip((a0, a2, a4, a6), ((g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8),
                                                                     (g + 8, 2 * q + 8))):
                            a_mat[r, kk : kk + 2] = torch.tensor(_halves(reg))
                        for t in range(2):  # B of x rows 8t + g: k 2q, 2q + 1 and 2q + 8, 2q + 9
                            if 8 * t + g < m:
                                for kk in (2 * q, 2 * q + 8):
                                    b_mat[kk : kk + 2, 8 * t + g] = xf[8 * t + g, col0 + 16 * s + kk : col0 + 16 * s + kk + 2]
                    else:  # sm word s, code word s // 2 (low nibbles: even steps): B registers
                        cod = _word(code, s // 2) >> 4 * (s % 2) & 0x0F0F0F0F
                        b0, b2 = _decode4(_word(sm, s), cod, base4, alt4)
                        for reg, kk in ((b0, 2 * q), (b2, 2 * q + 8)):
                            b_mat[kk : kk + 2, g] = torch.tensor(_halves(reg))
                        for r in (g, g + 8):  # A: x rows g, g + 8 at k 2q.. and 2q + 8..
                            if r < m:
                                for kk in (2 * q, 2 * q + 8):
                                    a_mat[r, kk : kk + 2] = xf[r, col0 + 16 * s + kk : col0 + 16 * s + kk + 2]
                acc += a_mat @ b_mat
        for lane in range(32):  # the epilogue: C element (row, col) of lane 4g + q is c_i, i = 2 * (row >= 8) + (col & 1)
            g, q = lane // 4, lane % 4
            for i in range(4):
                if rows == 16:
                    for t in range(2):  # W rows as C's rows, x rows as its columns
                        xr, wr = 8 * t + 2 * q + (i & 1), tile * 16 + g + 8 * (i >> 1)
                        if xr < m:
                            out[xr, wr] = acc[g + 8 * (i >> 1), 8 * t + 2 * q + (i & 1)]
                else:  # x rows as C's rows, W rows as its columns
                    xr, wr = g + 8 * (i >> 1), tile * 8 + 2 * q + (i & 1)
                    if xr < m:
                        out[xr, wr] = acc[xr, 2 * q + (i & 1)]
    return out


@pytest.mark.parametrize("rows", [16, 8])
@pytest.mark.parametrize("m", [1, 3, 12])
def test_the_kernels_arithmetic_emulated_from_the_ptx_isa_gives_the_product(rows, m):
    """decode4's prmt/lop3 sequence and the registers the kernel hands mma.sync, read through the ISA's fragment
    layouts, give x @ W.T (fp32 sums: close, not bitwise), with alts; so a lane's bytes, the bf16 pairs' order and
    the epilogue's placement agree with what the hardware will do."""
    w = outliers(32, 256, 12, seed=7)
    w.view(-1)[~torch.isfinite(w.view(-1).float())] = 1.0  # no inf/NaN here: the product must be finite
    planes = encode(w)
    planes = type(planes)(**{**vars(planes), "exc": planes.exc[:0],
                             "exc_off": torch.zeros_like(planes.exc_off)})  # escapes aside (fragment test)
    dense = b12_decode_reference(planes).float()
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    torch.testing.assert_close(_emulate(x, planes, rows), x.float() @ dense.T, rtol=1e-4, atol=1e-4)
