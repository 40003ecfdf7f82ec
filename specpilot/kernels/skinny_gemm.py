"""GEMM ``y = x @ w.T (+ bias)`` built for decode and speculative verify, and batch-invariant at every M.

At decode and verify sizes (M = 1..64 rows) a linear layer is memory-bound: the time is the time to stream
``w`` ([N, K], row-major as ``nn.Linear`` stores it) from device memory once. cuBLAS reaches well under copy
bandwidth there, so this module offers a Triton kernel built for bandwidth, plus :func:`tune`, which times it
against cuBLAS per shape.

Kernel layout: program ``(tile, k_split)`` owns ``BLOCK_N`` rows of ``w`` (output columns), ``BLOCK_M`` rows of
``x`` and one of ``SPLIT_K`` equal slices of K. It walks its slice in ``[BLOCK_N, BLOCK_K]`` tiles, each row a
contiguous run of K, software-pipelined ``num_stages`` deep. ``w`` is the dot's left operand
(``acc[BLOCK_N, BLOCK_M] = w_tile @ x_tile.T``) and the rows of ``x`` are padded to ``BLOCK_M >= 16`` on the
right, so ``BLOCK_N`` - not M - sets the MMA's M dimension (>= 64 allows Hopper's wgmma). Tiles are ordered in
groups of ``GROUP_N`` column blocks so programs running together share weight and activation tiles in L2 when
M is large (prefill). With ``SPLIT_K > 1`` the slices write fp32 partials to a workspace and a second small
kernel sums them in a fixed order (deterministic, no zero-init, no atomics), adds the bias and casts.

Batch invariance: with ``split_k == 1`` each output element is one fp32 accumulator fed the same MMA k-steps in
K order, whatever the tile: on the H200, every tile shape tried (BLOCK_N 64-256, BLOCK_K 64/128, BLOCK_M
16-256, 4 or 8 warps) gives bitwise the same rows (docs/RESULTS.md, benchmarks/gpu_gemm_configs.py), so
:func:`invariant_gemm` may pick its tiles by M and N for speed - decode tiles up to 64 rows, compute-sized ones
beyond - while a row never depends on how many rows share the call (docs/ARCHITECTURE.md, "Batch
invariance"). Nothing syncs with the host and the grid depends only on shapes, so calls are CUDA-graph
capturable.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from specpilot.kernels.triton_support import HAS_TRITON, require_triton, tl, triton

__all__ = [
    "CANDIDATE_CONFIGS",
    "HAS_TRITON",
    "MAX_M",
    "SkinnyConfig",
    "default_config",
    "invariant_gemm",
    "replay_us",
    "rotated_copies",
    "skinny_gemm",
    "skinny_gemm_reference",
    "tune",
    "variant_rows",
]

MAX_M = 64  # the tuned (cuBLAS-or-Triton) decode path's limit; invariant_gemm takes any M
MAX_BLOCK_M = 256  # x rows per program: larger M runs more programs along M
GROUP_N = 8  # column blocks per tile group (L2 reuse at large M)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Shared memory the pipelined tiles may take (Hopper allows 227 KiB per block; the rest is epilogue scratch).
_SMEM_BUDGET = 192 * 1024


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int  # rows of w (output columns) per program
    block_k: int  # K elements per tile row: 128..512 keeps each row's load a long contiguous run
    split_k: int  # programs sharing one column block, each on a K slice
    num_warps: int
    num_stages: int  # tiles in flight per program (capped to fit shared memory at large M)


# Sized for H100/H200 on Llama-8B's N, K. On an H200 the depth of each program's pipeline (weight bytes in flight)
# mattered more than covering every SM: 64-wide tiles deep in stages for the smaller N, 128-wide for the larger;
# 32-row and BLOCK_K 512 tiles only keep up at small M (the padded x tile crowds out stages); split-K rarely won
# (docs/RESULTS.md: the skinny-GEMM sweeps).
CANDIDATE_CONFIGS: list[SkinnyConfig] = [
    SkinnyConfig(64, 128, 1, 4, 6),
    SkinnyConfig(64, 128, 1, 4, 8),
    SkinnyConfig(64, 128, 1, 8, 8),
    SkinnyConfig(64, 256, 1, 4, 4),
    SkinnyConfig(32, 128, 1, 4, 8),
    SkinnyConfig(32, 256, 1, 4, 6),
    SkinnyConfig(32, 512, 1, 4, 4),
    SkinnyConfig(128, 128, 1, 4, 4),
    SkinnyConfig(128, 128, 1, 4, 5),
    SkinnyConfig(128, 128, 1, 8, 4),
    SkinnyConfig(64, 128, 2, 4, 6),
    SkinnyConfig(64, 128, 2, 4, 8),
    SkinnyConfig(64, 256, 2, 4, 4),
    SkinnyConfig(64, 256, 4, 4, 4),
]


# --------------------------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------------------------


def skinny_gemm_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` in fp32, returned in ``x.dtype``."""
    y = x.float() @ w.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _skinny_gemm_kernel(
        x_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,  # [M, N] output when SPLIT_K == 1, else the fp32 [SPLIT_K, M, N] workspace
        M,
        N,
        K,
        k_span,  # K elements per split, a multiple of BLOCK_K
        stride_xm,
        stride_wn,
        stride_om,
        stride_os,
        GROUP_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # Grouped order: consecutive programs take GROUP_N column blocks, then the next BLOCK_M rows of x.
        tile = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_N * tl.cdiv(M, BLOCK_M)
        first_n = (tile // per_group) * GROUP_N
        group_size = tl.minimum(num_n - first_n, GROUP_N)
        pid_n = first_n + (tile % per_group) % group_size
        pid_m = (tile % per_group) // group_size
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        # Rows past N re-read row N-1 instead of being masked: loads stay unpredicated along K, stores drop them.
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        m_ok = offs_m < M
        k_lo = pid_k * k_span
        k_hi = tl.minimum(k_lo + k_span, K)

        w_ptrs = w_ptr + rows[:, None] * stride_wn + (k_lo + offs_k)[None, :]
        # x is read as its transpose [BLOCK_K, BLOCK_M]; rows past M load as zeros.
        x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + (k_lo + offs_k)[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                w_tile = tl.load(w_ptrs)
                x_tile = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            else:
                k_ok = k + offs_k < K
                w_tile = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                x_tile = tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            acc = tl.dot(w_tile, x_tile, acc, input_precision=DOT_PRECISION)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K

        n_ok = offs_n < N
        out_ptrs = out_ptr + pid_k * stride_os + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        mask = n_ok[:, None] & m_ok[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptrs, acc, mask=mask)

    @triton.jit
    def _split_k_reduce_kernel(
        ws_ptr,  # fp32 [SPLIT_K, M, N], contiguous
        bias_ptr,
        out_ptr,  # [M, N], contiguous
        MN,
        N,
        SPLIT_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < MN
        acc = tl.load(ws_ptr + offs, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT_K):  # fixed order: bitwise reproducible
            acc += tl.load(ws_ptr + s * MN + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------------------------------


def _check_inputs(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, max_m: int | None) -> None:
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"x must be [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"K mismatch: x has {x.shape[1]}, w has {w.shape[1]}")
    if max_m is not None and x.shape[0] > max_m:
        raise ValueError(f"skinny_gemm handles at most {max_m} rows, got M={x.shape[0]}")
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise TypeError(f"x and w must share one dtype of {_DTYPES}, got {x.dtype} and {w.dtype}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w must have a unit-stride last dimension")
    if bias is not None and (bias.shape != (w.shape[0],) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [N] = [{w.shape[0]}] vector, got shape {tuple(bias.shape)}")
    for t, name in ((w, "w"), (bias, "bias")):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x is on {x.device}")


def block_m_for(m: int) -> int:
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))


def fit_stages(config: SkinnyConfig, block_m: int, elt: int) -> int:
    """config.num_stages, lowered until the buffered w and x tiles fit in shared memory."""
    per_stage = (config.block_n + block_m) * config.block_k * elt
    return max(1, min(config.num_stages, _SMEM_BUDGET // per_stage))


def default_config(m: int, n: int, k: int) -> SkinnyConfig:
    """An untuned choice, close to the best candidate on every Llama-3.1-8B shape at small M on an H200
    (docs/RESULTS.md): 128-row blocks once N gives one and a half waves of them, else 64-row blocks 8 deep."""
    if triton.cdiv(n, 128) >= 200:
        return SkinnyConfig(block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=4)
    return SkinnyConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=8)


def skinny_gemm(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, config: SkinnyConfig | None = None
) -> torch.Tensor:
    """Triton ``x @ w.T + bias`` for ``x`` of 1..64 rows; fp32 accumulation, output in ``x.dtype``."""
    require_triton("skinny_gemm")
    _check_inputs(x, w, bias, MAX_M)
    return _launch(x, w, bias, config, None)


# invariant_gemm's tiles past the decode sizes, fastest by CUDA-graph replay on an H200 for Llama-3.1-8B's weight
# shapes (docs/RESULTS.md, benchmarks/gpu_gemm_configs.py): per row limit, (config, x rows per program) by the
# width of w - "narrow" N <= 4096, "mid" N <= 8192, "wide" beyond.
_INVARIANT_TILES: list[tuple[int, dict[str, tuple[SkinnyConfig, int]]]] = [
    (128, {"narrow": (SkinnyConfig(64, 128, 1, 4, 4), 64), "mid": (SkinnyConfig(64, 128, 1, 4, 5), 128),
           "wide": (SkinnyConfig(256, 64, 1, 8, 4), 128)}),
    (256, {"narrow": (SkinnyConfig(128, 128, 1, 8, 4), 64), "mid": (SkinnyConfig(128, 64, 1, 8, 4), 128),
           "wide": (SkinnyConfig(128, 64, 1, 8, 4), 256)}),
    (384, {"narrow": (SkinnyConfig(128, 64, 1, 8, 4), 128), "mid": (SkinnyConfig(128, 64, 1, 8, 4), 256),
           "wide": (SkinnyConfig(256, 64, 1, 8, 4), 128)}),
    (2048, {"narrow": (SkinnyConfig(128, 64, 1, 8, 4), 128), "mid": (SkinnyConfig(128, 64, 1, 8, 4), 256),
            "wide": (SkinnyConfig(128, 64, 1, 8, 4), 256)}),
]
_PREFILL_TILES = (SkinnyConfig(block_n=128, block_k=64, split_k=1, num_warps=8, num_stages=3), 256)


def invariant_config(m: int, n: int, k: int) -> tuple[SkinnyConfig, int | None]:
    """(tiles, x rows per program) of invariant_gemm by M and N: the decode tiles up to 64 rows, then the
    table above, then prefill's; no split-K anywhere (the tiles never change a row's bits)."""
    if m <= MAX_M:
        return default_config(m, n, k), None
    width = "narrow" if n <= 4096 else "mid" if n <= 8192 else "wide"
    for rows, tiles in _INVARIANT_TILES:
        if m <= rows:
            return tiles[width]
    return _PREFILL_TILES


def variant_rows(n: int, k: int, max_m: int, invariant: bool,
                 choose: Callable[[int], tuple[SkinnyConfig, int | None]] | None = None) -> list[int]:
    """The fewest row counts that launch every variant of this module's kernel that x @ w.T (w: [n, k]) meets
    at 1..max_m rows — invariant_gemm's (on the tiles `choose(m)` gives, invariant_config's by default), or
    skinny_gemm's: one per tiling, and per M being 1 or a multiple of 16 (Triton compiles a kernel per integer
    specialisation on its first launch). An engine without CUDA graphs runs them at start, so that no pass
    compiles mid-step."""
    if choose is None:
        choose = (lambda m: invariant_config(m, n, k)) if invariant else (lambda m: (default_config(m, n, k), None))
    rows, seen = [], set()
    for m in range(1, max_m + 1):
        config, block_m = choose(m)
        variant = (config, block_m or block_m_for(m), m == 1, m % 16 == 0)
        if variant not in seen:
            seen.add(variant)
            rows.append(m)
    return rows


def invariant_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                   block_m: int | None = None, config: SkinnyConfig | None = None) -> torch.Tensor:
    """Batch-invariant ``x @ w.T + bias`` for any number of rows: every row of the result is bitwise the same
    whatever the other rows are and however many there are (one config per weight shape, no split-K).
    ``block_m`` and ``config`` pin the tiles (tests and sweeps of the invariance; by default the tiles are
    default_config's and the rows per program grow with M)."""
    require_triton("invariant_gemm")
    _check_inputs(x, w, bias, None)
    if config is None:
        config, chosen = invariant_config(x.shape[0], w.shape[0], w.shape[1])
        block_m = block_m or chosen
    if config.split_k != 1:
        raise ValueError("split-K changes a row's summation order with the split; invariant_gemm takes split_k=1")
    return _launch(x, w, bias, config, block_m)


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig | None,
            block_m: int | None) -> torch.Tensor:
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    if config is None:
        config = default_config(m, n, k)

    block_m = block_m or block_m_for(m)
    k_tiles = triton.cdiv(k, config.block_k)
    split = min(config.split_k, k_tiles)  # more splits than tiles would only add empty programs
    k_span = triton.cdiv(k_tiles, split) * config.block_k
    split = triton.cdiv(k, k_span)  # e.g. 5 tiles over 4 splits -> spans of 2 tiles -> 3 splits
    if split > 1:
        dest = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    else:
        dest = out
    grid = (triton.cdiv(n, config.block_n) * triton.cdiv(m, block_m), split)
    _skinny_gemm_kernel[grid](
        x,
        w,
        bias if bias is not None else x,  # never read without HAS_BIAS
        dest,
        m,
        n,
        k,
        k_span,
        x.stride(0),
        w.stride(0),
        dest.stride(-2),
        dest.stride(0) if split > 1 else 0,
        GROUP_N=GROUP_N,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=split,
        EVEN_K=k % config.block_k == 0,
        HAS_BIAS=bias is not None,
        # fp32 operands would otherwise run the dot in tf32
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=fit_stages(config, block_m, x.element_size()),
    )
    if split > 1:
        block = 1024
        _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
            dest,
            bias if bias is not None else x,
            out,
            m * n,
            n,
            SPLIT_K=split,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=4,
        )
    return out


# --------------------------------------------------------------------------------------------------------------------
# Tuning (CUDA only)
# --------------------------------------------------------------------------------------------------------------------


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in fp64; NaN/inf anywhere gives inf."""
    diff = (got.double() - ref.double()).norm().item()
    return diff / max(ref.double().norm().item(), 1e-30) if math.isfinite(diff) else math.inf


def rotated_copies(w: torch.Tensor, count: int | None = None) -> list[torch.Tensor]:
    """``w`` and clones of it, ``count`` in all (default: enough that cycling through them passes twice the L2),
    for timings in which no call finds its weight cached."""
    if count is None:
        l2 = torch.cuda.get_device_properties(w.device).L2_cache_size
        count = max(1, math.ceil(2 * l2 / (w.numel() * w.element_size())))
    return [w] + [w.clone() for _ in range(count - 1)]


def replay_us(fn, copies: list[torch.Tensor], x: torch.Tensor) -> float:
    """Median µs per call of ``fn(x, w)`` replayed from a CUDA graph of back-to-back calls, as decode runs it.

    Successive calls read successive copies of w, so none finds w in L2. (``do_bench`` flushes L2 by zeroing a
    256 MB buffer instead; the dirty lines it leaves are written back during the next kernel, which on the H200
    made 10-50 µs timings jump by up to 2x between runs.)
    """
    from triton.testing import do_bench_cudagraph

    ws = itertools.cycle(copies)
    return do_bench_cudagraph(lambda: fn(x, next(ws)), rep=20, return_mode="median") * 1e3


def tune(
    x_shape_m: int,
    w: torch.Tensor,
    configs: list[SkinnyConfig] = CANDIDATE_CONFIGS,
    rotate: int | None = None,
) -> tuple[SkinnyConfig | None, dict]:
    """Time cuBLAS and each config on ``x[x_shape_m, K] @ w.T``; return (fastest correct config, or None if
    cuBLAS is faster) and the timing table.

    Times are CUDA-graph replays cycling through ``rotate`` copies of w (default: enough to exceed twice the L2),
    so no call finds w in cache. Configs that fail to compile or launch, or whose relative error exceeds the
    dtype's tolerance, are recorded and skipped.
    """
    if not w.is_cuda:
        raise RuntimeError("tune needs a CUDA weight; on CPU there is nothing to time")
    n, k = w.shape
    w_bytes = w.numel() * w.element_size()
    props = torch.cuda.get_device_properties(w.device)
    copies = rotated_copies(w, rotate)
    rotate = len(copies)
    gen = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(x_shape_m, k, device=w.device, dtype=w.dtype, generator=gen)
    ref = skinny_gemm_reference(x, w).float()
    tol = 1e-4 if w.dtype == torch.float32 else 1e-2

    def row(us: float, err: float) -> dict:
        return {"us": us, "tbps": w_bytes / us / 1e6, "rel_err": err}

    cublas = row(replay_us(torch.nn.functional.linear, copies, x), _rel_err(torch.nn.functional.linear(x, w), ref))
    table: dict = {
        "m": x_shape_m, "n": n, "k": k, "dtype": str(w.dtype).removeprefix("torch."), "w_bytes": w_bytes,
        "rotate": rotate, "device": props.name, "cublas": cublas, "configs": [],
    }
    best: SkinnyConfig | None = None
    best_us = cublas["us"]
    for cfg in configs:
        entry: dict = {"config": asdict(cfg)}
        table["configs"].append(entry)
        try:
            err = _rel_err(skinny_gemm(x, w, config=cfg), ref)
            entry.update(row(replay_us(lambda a, b: skinny_gemm(a, b, config=cfg), copies, x), err))
        except Exception as exc:  # compile/launch failures (e.g. out of shared memory) only drop the config
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        entry["ok"] = err <= tol
        if entry["ok"] and entry["us"] < best_us:
            best, best_us = cfg, entry["us"]
    table["best"] = asdict(best) if best is not None else None
    return best, table
