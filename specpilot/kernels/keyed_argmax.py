"""Keyed sampling's draw: per row, the token id maximising log p + g, where g is Gumbel noise hashed from (the
request's seed, the output position, the token id), so the token sampled at a position depends on nothing else.

The noise is splitmix64's finaliser over counters (int64 arithmetic wraps the same way on every device): 53
random bits per (position, id) make a uniform u in (0, 1), g = -log(-log u), all in float64. Tokens of
probability 0 score -inf; among equal scores the lowest id wins (torch.argmax's rule).

* ``keyed_gumbel`` / ``keyed_scores`` / ``keyed_argmax_reference`` - plain torch, [N, V] tensors of noise and
  scores; the CPU path and the reference.
* ``keyed_argmax_triton`` - one program per row walks the vocabulary in blocks, hashing and scoring in
  registers (no [N, V] noise in memory), keeping the block maxima's first index.
* ``keyed_argmax`` - Triton for CUDA tensors when triton imports, torch otherwise.

Each row's result depends on that row alone (batch-invariant); the grid depends only on shapes.
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_support import pick_backend, require_triton, tl, triton

__all__ = ["as_int64", "keyed_argmax", "keyed_argmax_reference", "keyed_argmax_triton", "keyed_gumbel",
           "keyed_scores"]

_MASK64 = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
BLOCK = 2048  # ids per step of a row's walk


def as_int64(value: int) -> int:
    """The low 64 bits of an integer as a signed int64 value."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN_I, _MIX1_I, _MIX2_I = (as_int64(c) for c in (GOLDEN, MIX1, MIX2))


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 30)) * _MIX1_I
    x = (x ^ _shr(x, 27)) * _MIX2_I
    return x ^ _shr(x, 31)


def _seed_tensor(seed: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    if isinstance(seed, torch.Tensor):
        return seed.to(torch.int64).expand(positions.shape[0])
    return torch.full(positions.shape, as_int64(seed), dtype=torch.int64, device=positions.device)


def keyed_gumbel(seed: int | torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, V] float64 Gumbel noise for output positions `positions` [N] of the request keyed by `seed` (or
    of row i's request, keyed by seed[i], for an int64 tensor [N] of seeds)."""
    key = _mix64(_seed_tensor(seed, positions) + _GOLDEN_I)
    row = _mix64(key ^ (positions.long() * _GOLDEN_I))
    ids = torch.arange(vocab, dtype=torch.int64, device=positions.device)
    bits = _shr(_mix64(row[:, None] + ids * _MIX1_I), 11)  # 53 random bits per (position, token)
    uniform = (bits.double() + 0.5) * 2.0**-53  # in (0, 1)
    return -torch.log(-torch.log(uniform))


def keyed_scores(probs: torch.Tensor, seed: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[N, V] log p + the Gumbel noise of row i's output position positions[i]; -inf where p is 0."""
    return torch.where(probs > 0, probs.double().log() + keyed_gumbel(seed, positions, probs.shape[-1]),
                       float("-inf"))


def keyed_argmax_reference(probs: torch.Tensor, seed: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return keyed_scores(probs, seed, positions).argmax(dim=-1)


if triton is not None:

    @triton.jit
    def _mix64_tl(x):
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB
        return x ^ (x >> 31)

    @triton.jit
    def _keyed_argmax_kernel(probs_ptr, seeds_ptr, positions_ptr, out_ptr, V, stride, BLOCK_V: tl.constexpr):
        r = tl.program_id(0)
        seed = tl.load(seeds_ptr + r).to(tl.uint64, bitcast=True)
        position = tl.load(positions_ptr + r).to(tl.uint64, bitcast=True)
        key = _mix64_tl(seed + 0x9E3779B97F4A7C15)
        row_key = _mix64_tl(key ^ (position * 0x9E3779B97F4A7C15))
        best = tl.full((), float("-inf"), tl.float64)
        best_id = tl.full((), 0, tl.int32)
        for start in range(0, V, BLOCK_V):
            ids = start + tl.arange(0, BLOCK_V)
            ok = ids < V
            p = tl.load(probs_ptr + r.to(tl.int64) * stride + ids, mask=ok, other=0.0)
            bits = _mix64_tl(row_key + ids.to(tl.uint64) * 0xBF58476D1CE4E5B9) >> 11
            uniform = (bits.to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2 ** -53
            score = tl.where(p > 0, tl.log(p.to(tl.float64)) - tl.log(-tl.log(uniform)), -float("inf"))
            top = tl.max(score, axis=0)
            first = tl.min(tl.where(score == top, ids, V), axis=0)
            take = top > best
            best_id = tl.where(take, first, best_id)
            best = tl.where(take, top, best)
        tl.store(out_ptr + r, best_id.to(tl.int64))


def keyed_argmax_triton(probs: torch.Tensor, seed: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    require_triton("keyed_argmax")
    if probs.dim() != 2 or probs.stride(1) != 1:
        raise ValueError(f"probs must be [N, V] with unit-stride rows, got {tuple(probs.shape)}")
    n, v = probs.shape
    out = torch.empty(n, dtype=torch.int64, device=probs.device)
    if n:
        seeds = _seed_tensor(seed, positions).contiguous()
        _keyed_argmax_kernel[(n,)](probs, seeds, positions.to(torch.int64).contiguous(), out, v, probs.stride(0),
                                   BLOCK_V=BLOCK)
    return out


def keyed_argmax(probs: torch.Tensor, seed: int | torch.Tensor, positions: torch.Tensor,
                 backend: str = "auto") -> torch.Tensor:
    """[N] the keyed sample of each row of `probs` [N, V] (row i: output position positions[i], keyed by
    seed or seed[i])."""
    if pick_backend(backend, probs) == "triton":
        return keyed_argmax_triton(probs, seed, positions)
    return keyed_argmax_reference(probs, seed, positions)
