"""``y = x @ w.T (+ bias)`` with ``w`` stored as B12 planes (specpilot/formats/b12.py has the format), decoded
in registers tile by tile.

The kernel is invariant_gemm's (one program per ``BLOCK_N`` rows of ``w`` and ``BLOCK_M`` rows of ``x``, K walked
in ``BLOCK_K`` tiles in order, one fp32 accumulator fed by ``tl.dot``, no split-K; its tiles by M and N) with the
weight tile's load replaced by its decode: the sign/mantissa bytes, the row's base exponent plus the tile's
4-bit codes (a tile lies in one half of a code block, so its codes are one contiguous byte run shifted by a
constant; only the short last block reads them element by element), and escaped weights' raw bits gathered
from their row's segment (one predicated load each). Fed the same tiles, the dot sums the
same products in the same order as invariant_gemm on the decoded bf16 matrix; that the MMA keeps them bitwise equal
for u8-derived operands is what the H200 test checks (docs/RESULTS.md). The decode is per element in 32-bit
integer ops, which leaves the kernel ALU-bound well above the read time (docs/RESULTS.md has its speed).

Entry points: ``b12_decode_reference`` (the planes back to bf16, plain torch; formats.b12.decode),
``b12_gemm_reference`` (decode, then skinny_gemm_reference), ``b12_gemm`` (Triton). Nothing syncs and the grid
depends only on shapes: graph-capturable.
"""

from __future__ import annotations

import torch

from specpilot.kernels.skinny_gemm import (
    SkinnyConfig,
    block_m_for,
    fit_stages,
    invariant_config,
    skinny_gemm_reference,
)
from specpilot.kernels.triton_support import HAS_TRITON, require_triton, tl, triton

__all__ = ["BLOCK", "ESCAPE", "GROUP", "as_int16", "b12_decode_reference", "b12_gemm", "b12_gemm_reference", "halves"]

BLOCK = 256  # weights of one row per code block
GROUP = 16  # rows per escape segment
ESCAPE = 15


def halves(k: int) -> tuple[int, int]:
    """(full 256-blocks, the last block's half length: 0 without a short block)."""
    return k // BLOCK, -(-(k % BLOCK) // 2)


def as_int16(bits: torch.Tensor) -> torch.Tensor:
    """Values in [0, 65536) as the int16 of the same 16 bits."""
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16)


def _unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Nibble pairs [N, ceil(K / 2)] as codes [N, K] (int32), each block's halves from one byte."""
    n = packed.shape[0]
    full, half = halves(k)
    p = packed.to(torch.int32)
    c = p[:, : full * BLOCK // 2].reshape(n, full, 1, BLOCK // 2)
    parts = [torch.cat([c & 0xF, c >> 4], dim=2).reshape(n, full * BLOCK)]
    if half:
        t = p[:, full * BLOCK // 2 :]
        parts.append(torch.cat([t & 0xF, t >> 4], dim=1)[:, : k % BLOCK])
    return torch.cat(parts, dim=1)


def b12_decode_reference(sm: torch.Tensor, code: torch.Tensor, base: torch.Tensor, exc_off: torch.Tensor,
                         exc_val: torch.Tensor, k: int) -> torch.Tensor:
    """The bf16 [N, K] matrix of B12 planes, bit for bit."""
    n = sm.shape[0]
    codes = _unpack(code, k)
    s = sm.to(torch.int32)
    exponent = torch.where(codes == 0, 0, base[:, None].to(torch.int32) + codes)
    bits = ((s & 0x80) << 8) | ((exponent & 0xFF) << 7) | (s & 0x7F)
    rows, cols = (codes == ESCAPE).nonzero(as_tuple=True)
    if rows.numel():
        segment = (rows // GROUP) * -(-k // BLOCK) + cols // BLOCK
        bits[rows, cols] = exc_val[exc_off[segment].long() + s[rows, cols]].to(torch.int32) & 0xFFFF
    return as_int16(bits).view(torch.bfloat16).reshape(n, k)


def b12_gemm_reference(x: torch.Tensor, sm: torch.Tensor, code: torch.Tensor, base: torch.Tensor,
                       exc_off: torch.Tensor, exc_val: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return skinny_gemm_reference(x, b12_decode_reference(sm, code, base, exc_off, exc_val, x.shape[1]), bias)


if HAS_TRITON:

    @triton.jit
    def _b12_gemm_kernel(
        x_ptr, sm_ptr, code_ptr, base_ptr, exc_off_ptr, exc_val_ptr, bias_ptr, out_ptr,
        M, N, K, stride_xm, stride_code, stride_om, num_blocks, full_blocks, tail_half,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N re-read row N - 1; their stores drop
        m_ok = offs_m < M
        base = tl.load(base_ptr + rows).to(tl.int32)
        segment_row = (rows // 16) * num_blocks
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + offs_k
            k_ok = cols < K
            if EVEN_K:
                ok = rows[:, None] >= 0
            else:
                ok = k_ok[None, :] & (rows[:, None] >= 0)
            sm = tl.load(sm_ptr + rows[:, None] * K + cols[None, :], mask=ok, other=0).to(tl.int32)
            block = k // 256  # a tile lies in one half of one 256-block (BLOCK_K divides 128)
            if block < full_blocks:  # byte j of the block: element j's code low, element j + 128's high
                byte = tl.load(code_ptr + rows[:, None] * stride_code + (block * 128 + k % 128 + offs_k)[None, :],
                               mask=ok, other=0).to(tl.int32)
                code = (byte >> ((k % 256) // 128 * 4)) & 15
            else:  # the short last block: its halves are tail_half long
                within = cols % 256
                byte = tl.load(code_ptr + rows[:, None] * stride_code + (block * 128 + within % tail_half)[None, :],
                               mask=ok, other=0).to(tl.int32)
                code = tl.where((within >= tail_half)[None, :], byte >> 4, byte & 15)
            exponent = tl.where(code == 0, 0, base[:, None] + code)
            bits = ((sm & 0x80) << 8) | ((exponent & 0xFF) << 7) | (sm & 0x7F)
            escaped = (code == 15) & ok
            first = tl.load(exc_off_ptr + segment_row + block)  # the row's segment's first escape
            raw = tl.load(exc_val_ptr + first[:, None] + sm, mask=escaped, other=0).to(tl.int32) & 0xFFFF
            bits = tl.where(escaped, raw, bits)
            w_tile = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
            x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + cols[:, None]
            if EVEN_K:
                x_tile = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            else:
                x_tile = tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            acc = tl.dot(w_tile, x_tile, acc, input_precision=DOT_PRECISION)

        n_ok = offs_n < N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def b12_gemm(x: torch.Tensor, sm: torch.Tensor, code: torch.Tensor, base: torch.Tensor, exc_off: torch.Tensor,
             exc_val: torch.Tensor, bias: torch.Tensor | None = None, *, config: SkinnyConfig | None = None,
             block_m: int | None = None) -> torch.Tensor:
    """Triton ``x @ decode(planes).T + bias`` for bf16 ``x`` of any number of rows, on invariant_gemm's tiles
    for this shape (``config`` and ``block_m`` pin others), so its rows are bitwise invariant_gemm's on the
    decoded matrix."""
    require_triton("b12_gemm")
    (m, k), n = x.shape, sm.shape[0]
    if x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"x must be bf16 with a unit-stride last dimension, got {x.dtype}")
    if sm.shape != (n, k) or code.shape != (n, -(-k // 2)) or base.shape != (n,):
        raise ValueError(f"b12_gemm takes x [M, K] and planes of [N, K] = [{n}, {k}]; got x "
                         f"{tuple(x.shape)}, sm {tuple(sm.shape)}, code {tuple(code.shape)}, base {tuple(base.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [N] = [{n}], got {tuple(bias.shape)}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if config is None:
        config, chosen = invariant_config(m, n, k)
        block_m = block_m or chosen
    if config.split_k != 1:
        raise ValueError("b12_gemm takes split_k=1 (one K order, as invariant_gemm)")
    if 128 % config.block_k:
        raise ValueError(f"b12_gemm's K tiles must divide 128 (a half code block), got block_k {config.block_k}")
    block_m = block_m or block_m_for(m)
    full, half = halves(k)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, block_m))
    _b12_gemm_kernel[grid](
        x, sm, code, base, exc_off, exc_val if exc_val.numel() else exc_off.to(torch.int16),
        bias if bias is not None else x, out, m, n, k, x.stride(0), code.stride(0), out.stride(0),
        -(-k // BLOCK), full, half or 1, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, HAS_BIAS=bias is not None, DOT_PRECISION="tf32",
        num_warps=config.num_warps, num_stages=fit_stages(config, block_m, 2),
    )
    return out
