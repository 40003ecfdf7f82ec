"""Fused elementwise kernels for the decoder layer: residual add + RMSNorm, (QK-norm +) RoPE + KV-cache write, and
SiLU-and-mul.

Why: at decode sizes each of the ~45 small elementwise ops per layer costs a launch (~2-3 us even inside a CUDA
graph) while moving only kilobytes. Each op here is one launch that reads its inputs once.

Every op has three entry points sharing one contract:

* ``*_reference`` - plain torch, written as the unfused model code computes it; the CPU path.
* ``*_triton`` - the fused Triton kernel for CUDA tensors.
* the dispatcher (``rms_norm``, ``rope_and_cache_write``, ``silu_and_mul``) - Triton for CUDA tensors when triton
  imports, torch otherwise (``backend`` overrides).

Numerics follow the unfused torch code: math in fp32, and rounding to the activation dtype at the same points
(e.g. RMSNorm rounds the normalized value to x's dtype before the weight multiply). Kernels launch with FMA
contraction off so fp32 products and sums round like torch's separate ops. No function syncs with the host and
launch grids depend only on shapes, so all are CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_support import (
    HAS_TRITON,
    pick_backend,
    require_triton,
    tl,
    triton,
)

__all__ = [
    "HAS_TRITON",
    "MAX_NORM_DIM",
    "rms_norm",
    "rms_norm_reference",
    "rms_norm_triton",
    "rope_and_cache_write",
    "rope_and_cache_write_reference",
    "rope_and_cache_write_triton",
    "silu_and_mul",
    "silu_and_mul_reference",
    "silu_and_mul_triton",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
# The Triton RMSNorm keeps a whole row in registers (one block of next_pow2(H) lanes).
MAX_NORM_DIM = 16384


# --------------------------------------------------------------------------------------------------------------------
# Validation (shapes, dtypes and devices only: nothing that syncs)
# --------------------------------------------------------------------------------------------------------------------


def _check_float(t: torch.Tensor, name: str) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} dtype must be one of {_FLOAT_DTYPES}, got {t.dtype}")


def _check_same_device(ref: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} is on {t.device}, expected {ref.device}")


def _check_unit_stride(**tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit-stride last dimension (got strides {t.stride()})")


def _check_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    _check_float(x, "x")
    _check_float(weight, "weight")
    if weight.shape != x.shape[1:]:
        raise ValueError(f"weight must be [{x.shape[1]}] to match x, got shape {tuple(weight.shape)}")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"residual dtype {residual.dtype} != x dtype {x.dtype}")
    _check_same_device(x, weight=weight, residual=residual)


def _check_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
) -> None:
    if k.dim() != 3:
        raise ValueError(f"k must be [T, num_kv_heads, head_dim], got shape {tuple(k.shape)}")
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    if q.dim() != 3 or q.shape[0] != num_tokens or q.shape[2] != head_dim:
        raise ValueError(f"q must be [{num_tokens}, num_heads, {head_dim}] to match k, got shape {tuple(q.shape)}")
    if head_dim % 2:
        raise ValueError(f"rotate-half RoPE needs an even head_dim, got {head_dim}")
    _check_float(q, "q")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} != q dtype {q.dtype}")
    if cos.dim() != 2 or cos.shape[1] != head_dim or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must both be [max_pos, {head_dim}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    _check_float(cos, "cos")
    _check_float(sin, "sin")
    for name, t in (("positions", positions), ("rows", rows)):
        if t.shape != (num_tokens,):
            raise ValueError(f"{name} must be [{num_tokens}], got shape {tuple(t.shape)}")
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or t.shape[2:] != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be [slots, max_len, {num_kv_heads}, {head_dim}], got shape {tuple(t.shape)}"
            )
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (rows are addressed as slot * max_len + pos)")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("pass both q_norm_weight and k_norm_weight, or neither")
    if q_norm_weight is not None:
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            if w.shape != (head_dim,):
                raise ValueError(f"{name} must be [{head_dim}], got shape {tuple(w.shape)}")
            # the unfused path rounds the normed q/k to promote(weight, x) dtype before RoPE; keep that x's dtype
            if w.dtype != q.dtype:
                raise TypeError(f"{name} dtype {w.dtype} != q dtype {q.dtype}")
    _check_same_device(
        q, k=k, v=v, cos=cos, sin=sin, positions=positions, rows=rows, k_cache=k_cache, v_cache=v_cache,
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
    )


def _check_silu_and_mul(gate_up: torch.Tensor) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2 * I], got shape {tuple(gate_up.shape)}")
    _check_float(gate_up, "gate_up")


# --------------------------------------------------------------------------------------------------------------------
# Torch references / CPU path
# --------------------------------------------------------------------------------------------------------------------


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis, exactly as specpilot.models.transformer.RMSNorm computes it."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [T, heads, D] with per-token cos/sin [T, D], as RotaryTable.apply computes it."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual), or (RMSNorm(x), x) without a residual."""
    _check_rms_norm(x, weight, residual)
    if residual is not None:
        x = x + residual
    return _rms_norm_torch(x, weight, eps), x


def rope_and_cache_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Optional per-head RMSNorm on q and k, RoPE on both, rotated k and v into the caches' flat rows.

    Returns the rotated q as a new contiguous [T, Hq, D] tensor; q, k, v are not modified.
    """
    _check_rope(q, k, v, cos, sin, positions, rows, k_cache, v_cache, q_norm_weight, k_norm_weight)
    if q_norm_weight is not None:
        q, k = _rms_norm_torch(q, q_norm_weight, eps), _rms_norm_torch(k, k_norm_weight, eps)
    cos_t, sin_t = cos[positions], sin[positions]
    q, k = _rope_torch(q, cos_t, sin_t), _rope_torch(k, cos_t, sin_t)
    num_kv_heads, head_dim = k.shape[1:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, rows.long(), k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, rows.long(), v)
    return q.contiguous()


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:]."""
    _check_silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# --------------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _inv_rms(sum_sq, n, eps):
        return tl.math.rsqrt(sum_sq / n + eps)

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        res_out_ptr,
        stride_x,
        stride_res,
        stride_out,
        stride_res_out,
        n_cols,
        eps,
        BLOCK: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
            # x + residual rounds to the activation dtype, as the unfused residual add does
            s = (x + r).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=mask)
            x = s.to(tl.float32)
        normed = (x * _inv_rms(tl.sum(x * x, axis=0), n_cols, eps)).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = w * normed.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _load_head(src, w_ptr, offs, mask, eps, HALF: tl.constexpr, QK_NORM: tl.constexpr):
        """One head's two halves as fp32, per-head RMSNorm'd (rounded like the unfused RMSNorm) if QK_NORM."""
        dtype = src.dtype.element_ty
        x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        if QK_NORM:
            inv = _inv_rms(tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0), 2 * HALF, eps)
            w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
            x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        return x1, x2

    @triton.jit
    def _store_rotated(dst, x1, x2, cos1, cos2, sin1, sin2, offs, mask, HALF: tl.constexpr):
        """Rotate-half: out = x * cos + [-x2, x1] * sin, rounded to dst's dtype."""
        dtype = dst.dtype.element_ty
        tl.store(dst + offs, (x1 * cos1 - x2 * sin1).to(dtype), mask=mask)
        tl.store(dst + HALF + offs, (x2 * cos2 + x1 * sin2).to(dtype), mask=mask)

    @triton.jit
    def _rope_cache_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        q_out_ptr,
        k_cache_ptr,
        v_cache_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        rows_ptr,
        q_w_ptr,
        k_w_ptr,
        eps,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cos,
        stride_sin,
        NUM_Q_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        QK_NORM: tl.constexpr,
    ):
        # Program = (token, head): heads [0, NUM_Q_HEADS) rotate a q head into q_out, the next NUM_KV_HEADS rotate
        # a k head and copy its v head into the cache row. One head per program keeps decode (T ~ 1..64) parallel.
        t = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs = tl.arange(0, BLOCK_HALF)
        mask = offs < HALF
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos1 = tl.load(cos_ptr + pos * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + pos * stride_cos + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + pos * stride_sin + offs, mask=mask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + pos * stride_sin + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        if head < NUM_Q_HEADS:
            x1, x2 = _load_head(q_ptr + t * stride_qt + head * stride_qh, q_w_ptr, offs, mask, eps, HALF, QK_NORM)
            dst = q_out_ptr + (t * NUM_Q_HEADS + head) * (2 * HALF)
            _store_rotated(dst, x1, x2, cos1, cos2, sin1, sin2, offs, mask, HALF)
        else:
            kv_head = head - NUM_Q_HEADS
            x1, x2 = _load_head(k_ptr + t * stride_kt + kv_head * stride_kh, k_w_ptr, offs, mask, eps, HALF, QK_NORM)
            # contiguous caches: flat row r, head h starts at (r * NUM_KV_HEADS + h) * HEAD_DIM
            cache_off = (tl.load(rows_ptr + t).to(tl.int64) * NUM_KV_HEADS + kv_head) * (2 * HALF)
            _store_rotated(k_cache_ptr + cache_off, x1, x2, cos1, cos2, sin1, sin2, offs, mask, HALF)
            v_src = v_ptr + t * stride_vt + kv_head * stride_vh
            tl.store(v_cache_ptr + cache_off + offs, tl.load(v_src + offs, mask=mask), mask=mask)
            tl.store(v_cache_ptr + cache_off + HALF + offs, tl.load(v_src + HALF + offs, mask=mask), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dtype = out_ptr.dtype.element_ty
        gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        # F.silu rounds to the activation dtype before the product, as the unfused silu(gate) * up does
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (act * up).to(dtype), mask=mask)


def _row_warps(block: int) -> int:
    """Warps for a one-row block: ~16 elements per thread, 1..16 warps."""
    return min(max(block // 512, 1), 16)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton rms_norm: one program per row. Returns new tensors (inputs are not modified), except that without a
    residual the second result is x itself."""
    require_triton("rms_norm_triton")
    _check_rms_norm(x, weight, residual)
    num_rows, hidden = x.shape
    if hidden > MAX_NORM_DIM:
        raise ValueError(f"rms_norm_triton supports H <= {MAX_NORM_DIM}, got {hidden}")
    _check_unit_stride(x=x, weight=weight, residual=residual)
    out = torch.empty((num_rows, hidden), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    if num_rows == 0:
        return out, res_out
    res_in = residual if residual is not None else x  # unread when HAS_RESIDUAL is False
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_rows,)](
        x,
        res_in,
        weight,
        out,
        res_out,
        x.stride(0),
        res_in.stride(0),
        out.stride(0),
        res_out.stride(0),
        hidden,
        eps,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=_row_warps(block),
        enable_fp_fusion=False,
    )
    return out, res_out


def rope_and_cache_write_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Triton rope_and_cache_write: one launch over (token, head). q, k, v may be strided views (e.g. splits of a
    fused qkv output) as long as each head is contiguous. Positions and rows are trusted, not range-checked."""
    require_triton("rope_and_cache_write_triton")
    _check_rope(q, k, v, cos, sin, positions, rows, k_cache, v_cache, q_norm_weight, k_norm_weight)
    _check_unit_stride(q=q, k=k, v=v, cos=cos, sin=sin)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_heads + num_kv_heads == 0:
        return q_out
    qk_norm = q_norm_weight is not None
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    _rope_cache_kernel[(num_tokens, num_heads + num_kv_heads)](
        q,
        k,
        v,
        q_out,
        k_cache,
        v_cache,
        cos,
        sin,
        positions,
        rows,
        q_norm_weight if qk_norm else cos,  # unread without QK_NORM
        k_norm_weight if qk_norm else cos,
        eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_Q_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_HALF=block_half,
        QK_NORM=qk_norm,
        num_warps=min(max(block_half // 64, 1), 4),
        enable_fp_fusion=False,
    )
    return q_out


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton silu_and_mul over (row, column block); gate_up may have a row stride."""
    require_triton("silu_and_mul_triton")
    _check_silu_and_mul(gate_up)
    _check_unit_stride(gate_up=gate_up)
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (num_rows, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4, enable_fp_fusion=False
    )
    return out


# --------------------------------------------------------------------------------------------------------------------
# Dispatchers
# --------------------------------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm over x [T, H].

    With ``residual``: ``s = x + residual`` (in x's dtype); returns ``(RMSNorm(s), s)``. Without: returns
    ``(RMSNorm(x), x)``. The output dtype is ``promote(weight.dtype, x.dtype)`` as in the RMSNorm module.
    ``backend``: ``"triton"``, ``"torch"``, or ``"auto"`` (triton for CUDA tensors when importable).
    """
    if pick_backend(backend, x) == "triton":
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)


def rope_and_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    backend: str = "auto",
) -> torch.Tensor:
    """(Per-head RMSNorm +) rotate-half RoPE on q [T, Hq, D] and k [T, Hkv, D] at ``positions``, then rotated k and
    v into flat cache rows: ``k_cache.view(-1, Hkv, D)[rows[t]] = k_rot[t]`` (likewise v).

    ``cos`` / ``sin`` are [max_pos, D] tables (RotaryTable.cos / .sin). ``q_norm_weight`` / ``k_norm_weight`` (both
    or neither, [D], q's dtype) apply Qwen3-style QK-norm with ``eps`` first. Hq may be 0 (k/v-only writes).
    Returns the rotated q as a new contiguous [T, Hq, D] tensor; q, k, v are left unchanged.
    """
    if pick_backend(backend, q) == "triton":
        return rope_and_cache_write_triton(
            q, k, v, cos, sin, positions, rows, k_cache, v_cache, q_norm_weight, k_norm_weight, eps
        )
    return rope_and_cache_write_reference(
        q, k, v, cos, sin, positions, rows, k_cache, v_cache, q_norm_weight, k_norm_weight, eps
    )


def silu_and_mul(gate_up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``; gate_up [T, 2I] -> [T, I] in gate_up's dtype."""
    if pick_backend(backend, gate_up) == "triton":
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_reference(gate_up)
