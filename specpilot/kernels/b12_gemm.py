"""``y = x @ w.T (+ bias)`` with ``w`` stored as B12 planes (specpilot/formats/b12.py has the format), decoded
in registers tile by tile.

The kernel is invariant_gemm's (one program per ``BLOCK_N`` rows of ``w`` and ``BLOCK_M`` rows of ``x``, K walked
in ``BLOCK_K`` tiles in order, one fp32 accumulator fed by ``tl.dot``, no split-K; its tiles by M and N, with two
warpgroups for tiles of 128 rows or more, each the same 64-row wgmma) with the weight tile's load replaced by
its decode. A loop iteration takes one 256-column block, i.e. 256 / BLOCK_K tiles: the block's code bytes,
loaded once, give its first half's codes (low nibbles) and its second half's (high), so every plane byte is
read once, in 16-byte runs pipelined through shared memory (where K is a multiple of 16, which the JIT specializes
on; other K load byte by byte — benchmarks/b12_codegen.py shows the code either way). The decode takes four
weights a handful of integer instructions in byte lanes (packed PTX; the plain-integer twin is what the
interpreter runs), no division and no gather: exponent = code == 15 ? the row's block alt : base + code, the
alts loaded an iteration ahead.

Hard escapes cost nothing where absent: a program's rows lie in one group of 256, so each block's escapes
are one run of segments. The program loads every block's range and first entry before its K loop, with a
bit per block that has any; the loop carries no loaded offsets into later iterations' addresses (Triton does
not pipeline a loop that does) and tests one bit a block. A flagged block picks its range out of those vectors and writes each escape into its
decoded tile (``tl.where``) before the dot: unrolled up to the tensor's ``max_block_escapes`` (a power of two,
for few variants), a loop past a bound. A short last block runs peeled, masked, its code bytes addressed by
element.

Fed the same tiles, the dot sums the same products in the same order as invariant_gemm on the decoded bf16
matrix; that the MMA keeps them bitwise equal for register-made operands is what the CUDA test checks.

Entry points: ``b12_decode_reference`` (the planes back to bf16, plain torch; formats.b12.decode),
``b12_gemm_reference`` (decode, then skinny_gemm_reference), ``b12_gemm`` (Triton). Nothing syncs and the grid
depends only on shapes: graph-capturable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specpilot.kernels.skinny_gemm import (
    _SMEM_BUDGET,
    SkinnyConfig,
    block_m_for,
    invariant_config,
    skinny_gemm_reference,
)
from specpilot.kernels.triton_support import HAS_TRITON, require_triton, tl, triton

if TYPE_CHECKING:
    from specpilot.formats.b12 import B12Tensor

__all__ = ["BLOCK", "ESCAPE", "GROUP", "SEGMENT_ROWS", "as_int16", "b12_decode_reference", "b12_gemm", "b12_gemm_reference",
           "halves", "hard_escapes"]

BLOCK = 256  # weights of one row per code block
GROUP = 256  # rows whose escape segments are numbered together: a BLOCK_N tile (a divisor) lies in one group
SEGMENT_ROWS = 16  # rows per escape segment
ESCAPE = 15
UNROLLED_PATCHES = 8  # escapes a tile's block may need patched before the kernel loops over them instead


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


def b12_decode_reference(w: B12Tensor) -> torch.Tensor:
    """The bf16 [N, K] matrix of B12 planes, bit for bit."""
    n, k = w.shape
    codes = _unpack(w.code, k)
    s = w.sm.to(torch.int32)
    alt = w.alt.to(torch.int32).t()[:, torch.arange(k, device=s.device) // BLOCK]
    exponent = torch.where(codes == ESCAPE, alt, w.base[:, None].to(torch.int32) + codes)
    bits = ((s & 0x80) << 8) | (exponent << 7) | (s & 0x7F)
    rows, cols, raw = hard_escapes(w)
    bits[rows, cols] = raw
    return as_int16(bits).view(torch.bfloat16).reshape(n, k)


def hard_escapes(w: B12Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hard escapes' rows, columns and raw bits (int32 each; empty where there are none), from their
    segments: numbered (row // GROUP, block, row % GROUP // SEGMENT_ROWS)."""
    counts = w.exc_off.diff()
    group_block = torch.repeat_interleave(torch.arange(counts.numel(), device=w.exc.device), counts) // (
        GROUP // SEGMENT_ROWS)
    blocks = -(-w.shape[1] // BLOCK)
    entry = w.exc.to(torch.int32)
    return ((group_block // blocks) * GROUP + ((entry >> 8) & 0xFF), (group_block % blocks) * BLOCK + (entry & 0xFF),
            (entry >> 16) & 0xFFFF)


def b12_gemm_reference(x: torch.Tensor, w: B12Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return skinny_gemm_reference(x, b12_decode_reference(w), bias)


if HAS_TRITON:
    # In the kernels 256 is BLOCK and GROUP, 128 half a block, 16 SEGMENT_ROWS: literals, which the
    # interpreter's constexpr arithmetic takes on either side.

    # Four weights at once ($0, $1: two bf16 each) from their sign/mantissa bytes ($2), code bytes ($3) and
    # base and alt exponent bytes ($4, $5); byte lanes throughout, which never carry (base + code <= 255).
    # The exponents come as byte tiles like the others, so lane i of every operand is element i's whichever
    # layout Triton packs the four elements from (along a row or across rows). A lane whose code is 15 takes
    # the alt: code + 0x71 has its top bit set, which prmt's sign mode spreads over the lane. Then high byte = sign | exponent >> 1, low byte =
    # exponent << 7 | mantissa, interleaved into bf16 pairs. Not marked pure: Triton would otherwise move the
    # MMA operand's layout above it, onto the byte loads, which then read a byte or two at a time, and keep
    # the code bytes loaded twice.
    _DECODE = """{
    .reg .b32 cod, flg, msk, ex, hib, lob;
    NIBBLE
    add.u32 flg, cod, 0x71717171;
    prmt.b32 msk, flg, 0, 0xBA98;
    add.u32 ex, cod, $4;
    lop3.b32 ex, ex, $5, msk, 0xD8;
    shr.b32 hib, ex, 1;
    lop3.b32 hib, $2, hib, 0x80808080, 0xE4;
    shl.b32 lob, ex, 7;
    lop3.b32 lob, lob, $2, 0x80808080, 0xE4;
    prmt.b32 $0, lob, hib, 0x5140;
    prmt.b32 $1, lob, hib, 0x7362;
    }"""
    _DECODE_LOW = tl.constexpr(_DECODE.replace("NIBBLE", "and.b32 cod, $3, 0x0F0F0F0F;"))
    _DECODE_HIGH = tl.constexpr(_DECODE.replace("NIBBLE", "shr.b32 cod, $3, 4;\n    and.b32 cod, cod, 0x0F0F0F0F;"))
    _DECODE_OPERANDS = tl.constexpr("=r,=r,r,r,r,r")  # sm, codes, base and alt bytes: 4 a register

    @triton.jit
    def _or(a, b):
        return a | b

    @triton.jit
    def _decode(s, byte, base, alt, HIGH: tl.constexpr, PACKED: tl.constexpr):
        """bf16 weights of sign/mantissa bytes `s` and code bytes `byte` (their high nibbles if HIGH), rows of
        base and alt exponents ([BLOCK_N] int32): packed PTX, or the same in plain integer ops."""
        if PACKED:
            w = tl.inline_asm_elementwise(_DECODE_HIGH if HIGH else _DECODE_LOW, _DECODE_OPERANDS,
                                          [s, byte, tl.broadcast_to(base.to(tl.uint8)[:, None], s.shape),
                                           tl.broadcast_to(alt.to(tl.uint8)[:, None], s.shape)],
                                          dtype=tl.bfloat16, is_pure=False, pack=4)
        else:
            if HIGH:
                code = (byte >> 4).to(tl.int32)
            else:
                code = (byte & 15).to(tl.int32)
            si = s.to(tl.int32)
            exponent = tl.where(code == 15, alt[:, None], base[:, None] + code)
            bits = (si & 0x80) * 0xFF + si + exponent * 128  # sign << 15 | exponent << 7 | mantissa
            w = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        return w

    @triton.jit
    def _patch(w, entry, row0, col0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """`w` (rows row0.. of its group, columns col0.. of its block) with the hard escape `entry` written in,
        if it lies there."""
        r = ((entry >> 8) & 0xFF) - row0
        c = (entry & 0xFF) - col0
        if (r >= 0) & (r < BLOCK_N) & (c >= 0) & (c < BLOCK_K):
            hit = (tl.arange(0, BLOCK_N)[:, None] == r) & (tl.arange(0, BLOCK_K)[None, :] == c)
            w = tl.where(hit, (entry >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True), w)
        return w

    @triton.jit
    def _tile(acc, x_ptr, sm_ptr, code_ptr, exc_ptr, rows, offs_m, m_ok, base, alt, K, stride_xm, stride_code,
              block, codes, tail_half, patch, blocks, lo_v, hi_v, first_v, row0,
              J: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TAIL: tl.constexpr,
              PATCHES: tl.constexpr, PACKED: tl.constexpr):
        """acc + the dot of tile J of `block` (its columns J * BLOCK_K ..), decoded and patched, with x.
        `codes`: the block's [BLOCK_N, 128] code bytes (a full block's; the short block's load here)."""
        offs_k = tl.arange(0, BLOCK_K)
        within = J * BLOCK_K + offs_k
        cols = block * 256 + within
        k_ok = cols < K
        sm_ptrs = sm_ptr + rows[:, None] * K + cols[None, :]
        if TAIL:  # the short block's halves are tail_half long: nibbles picked element by element
            high = within >= tail_half
            s = tl.load(sm_ptrs, mask=k_ok[None, :], other=0)
            byte = tl.load(code_ptr + rows[:, None] * stride_code + block * 128
                           + tl.where(high, within - tail_half, within)[None, :], mask=k_ok[None, :], other=0)
            w = _decode(s, tl.where(high[None, :], byte >> 4, byte & 15), base, alt, False, PACKED)
        else:  # a tile lies in one half: the codes' column j is its element j's, in the half's nibble
            s = tl.load(sm_ptrs)
            if BLOCK_K == 128:
                byte = codes
            else:
                first, second = tl.split(tl.permute(tl.reshape(codes, (BLOCK_N, 2, 64)), (0, 2, 1)))
                if J % 2 == 0:
                    byte = first
                else:
                    byte = second
            w = _decode(s, byte, base, alt, J >= 128 // BLOCK_K, PACKED)
        if PATCHES != 0:
            if patch:  # rare: this block has hard escapes in these rows
                here = blocks == block
                lo = tl.sum(tl.where(here, lo_v, 0))
                hi = tl.sum(tl.where(here, hi_v, 0))
                w = _patch(w, tl.sum(tl.where(here, first_v, 0)), row0, J * BLOCK_K, BLOCK_N, BLOCK_K)
                if PATCHES < 0:
                    for e in range(lo + 1, hi):
                        w = _patch(w, tl.load(exc_ptr + e), row0, J * BLOCK_K, BLOCK_N, BLOCK_K)
                else:
                    for i in tl.static_range(1, PATCHES):
                        if lo + i < hi:
                            w = _patch(w, tl.load(exc_ptr + lo + i), row0, J * BLOCK_K, BLOCK_N, BLOCK_K)
        x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + cols[:, None]
        if TAIL:
            w = tl.where(k_ok[None, :], w, 0.0)  # as the bf16 kernel's masked load: +0 past K
            x_tile = tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        else:
            x_tile = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        return tl.dot(w, x_tile, acc)

    @triton.jit
    def _b12_gemm_kernel(
        x_ptr, sm_ptr, code_ptr, base_ptr, alt_ptr, exc_off_ptr, exc_ptr, bias_ptr, out_ptr,
        M, N, K, stride_xm, stride_code, stride_om, num_blocks, tail_half,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKS_P2: tl.constexpr,
        TAIL: tl.constexpr, PATCHES: tl.constexpr, PACKED: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N re-read row N - 1; their stores drop
        m_ok = offs_m < M
        base = tl.load(base_ptr + rows).to(tl.int32)
        # The rows lie in one group: block b's escapes are one run, segments seg0 + 16 b .. + BLOCK_N // 16.
        # Every block's range and first entry load here, and a bit per block says which have any: the K loop
        # carries no loaded offsets (which would stop its pipelining) and waits on none.
        row0 = pid_n * BLOCK_N % 256
        seg0 = pid_n * BLOCK_N // 256 * num_blocks * 16 + row0 // 16
        blocks = tl.arange(0, BLOCKS_P2)
        lo_v, hi_v, first_v, flagged = blocks, blocks, blocks, 0
        if PATCHES != 0:
            in_k = blocks < num_blocks
            lo_v = tl.load(exc_off_ptr + seg0 + blocks * 16, mask=in_k, other=0)
            hi_v = tl.load(exc_off_ptr + seg0 + blocks * 16 + BLOCK_N // 16, mask=in_k, other=0)
            first_v = tl.load(exc_ptr + lo_v, mask=hi_v > lo_v, other=0)
            bit = tl.full([BLOCKS_P2], 1, tl.int64) << tl.minimum(blocks, 63).to(tl.int64)  # 63: the rest
            flagged = tl.reduce(tl.where(hi_v > lo_v, bit, 0), 0, _or)
        alt_next = tl.load(alt_ptr + rows).to(tl.int32)  # a block's alts load an iteration ahead
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for block in range(0, num_blocks - TAIL):
            alt = alt_next
            alt_next = tl.load(alt_ptr + tl.minimum(block + 1, num_blocks - 1) * N + rows).to(tl.int32)
            patch = ((flagged >> tl.minimum(block, 63).to(tl.int64)) & 1) != 0
            codes = tl.load(code_ptr + rows[:, None] * stride_code + block * 128 + tl.arange(0, 128)[None, :])
            for j in tl.static_range(256 // BLOCK_K):
                acc = _tile(acc, x_ptr, sm_ptr, code_ptr, exc_ptr, rows, offs_m, m_ok, base, alt, K, stride_xm,
                            stride_code, block, codes, tail_half, patch, blocks, lo_v, hi_v, first_v, row0,
                            j, BLOCK_N, BLOCK_K, False, PATCHES, PACKED)
        if TAIL:
            block = num_blocks - 1
            patch = ((flagged >> tl.minimum(block, 63).to(tl.int64)) & 1) != 0
            for j in tl.static_range(256 // BLOCK_K):
                if block * 256 + j * BLOCK_K < K:  # the bf16 kernel has no tile past K either
                    acc = _tile(acc, x_ptr, sm_ptr, code_ptr, exc_ptr, rows, offs_m, m_ok, base, alt_next, K,
                                stride_xm, stride_code, block, 0, tail_half, patch, blocks, lo_v, hi_v, first_v, row0,
                                j, BLOCK_N, BLOCK_K, True, PATCHES, PACKED)

        n_ok = offs_n < N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def _patches(most: int) -> int:
    """The kernel's PATCHES for a tensor whose tiles' blocks hold at most `most` hard escapes: 0 (no patch
    code), the unrolled count (a power of two: few variants to compile) or -1 (a loop)."""
    return 0 if most == 0 else triton.next_power_of_2(most) if most <= UNROLLED_PATCHES else -1


def b12_stages(config: SkinnyConfig, block_m: int) -> int:
    """Blocks in flight per program: as many 256-column blocks (sign/mantissa and code bytes, and x's tiles)
    as the shared-memory budget holds, at most config.num_stages (1, no pipelining, for prefill's tiles)."""
    per_block = config.block_n * BLOCK * 3 // 2 + BLOCK * block_m * 2
    return max(1, min(config.num_stages, _SMEM_BUDGET // per_block))


def b12_warps(config: SkinnyConfig) -> int:
    """Warps per program: the tiles' own, but two warpgroups for tiles of 128 rows or more (each still one
    wgmma of 64 rows; with one, the decoded tile and its MMA copy overflow the registers)."""
    return max(config.num_warps, 8) if config.block_n >= 128 else config.num_warps


def b12_gemm(x: torch.Tensor, w: B12Tensor, bias: torch.Tensor | None = None, *, config: SkinnyConfig | None = None,
             block_m: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
             packed: bool | None = None) -> torch.Tensor:
    """Triton ``x @ decode(w).T + bias`` for bf16 ``x`` of any number of rows, on invariant_gemm's tiles for
    this shape, so its rows are bitwise invariant_gemm's on the decoded matrix. ``config`` and ``block_m`` pin
    other tiles, ``num_warps`` and ``num_stages`` (blocks in flight) the launch, ``packed`` the decode
    (default: the PTX one on CUDA, the plain one under the interpreter)."""
    require_triton("b12_gemm")
    (m, k), (n, wk) = x.shape, w.shape
    if x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"x must be bf16 with a unit-stride last dimension, got {x.dtype}")
    if k != wk:
        raise ValueError(f"b12_gemm takes x [M, K] and a B12 matrix of [N, K]; got x {tuple(x.shape)}, w {w.shape}")
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
    if (BLOCK // 2) % config.block_k or GROUP % config.block_n or config.block_n % SEGMENT_ROWS:
        raise ValueError(f"b12_gemm's tiles must divide a half block and an escape group into segments, got {config}")
    block_m = block_m or block_m_for(m)
    full, half = halves(k)
    blocks = full + (half > 0)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, block_m))
    _b12_gemm_kernel[grid](
        x, w.sm, w.code, w.base, w.alt, w.exc_off, w.exc if w.exc.numel() else w.exc_off,
        bias if bias is not None else x, out, m, n, k, x.stride(0), w.code.stride(0), out.stride(0), blocks, half,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCKS_P2=triton.next_power_of_2(blocks),
        TAIL=half > 0, PATCHES=_patches(w.max_block_escapes), PACKED=x.is_cuda if packed is None else packed,
        HAS_BIAS=bias is not None, num_warps=num_warps or b12_warps(config),
        num_stages=num_stages or b12_stages(config, block_m),
    )
    return out
