"""Softmax top-k over a vocabulary: each row's k likeliest tokens and their probabilities, without
materialising the softmax.

Why: a block drafter needs, for every draft slot, its top-k tokens and their probabilities. torch's
softmax followed by topk over [rows, vocab] is ~20 kernels (a softmax, then a multi-block radix select)
and about 60 us for 15 rows of SmolLM2's 49,152 tokens on an H200, a tenth of a speculative step. Here it
is two launches: one program per (row, chunk of columns) finds the chunk's max, its sum of exponentials
and its top-k; one program per row merges them.

Three entry points share one contract (probabilities float32 [N, k] descending, token ids int64 [N, k];
among equal logits the lower token id comes first):

* ``softmax_topk_reference`` - plain torch; the CPU path.
* ``softmax_topk_triton`` - the two Triton kernels, for CUDA tensors.
* ``softmax_topk`` - Triton for CUDA tensors when triton imports, torch otherwise (``backend`` overrides).

Nothing syncs with the host and the grid depends only on shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_support import pick_backend, require_triton, tl, triton

__all__ = ["row_argmax", "softmax_topk", "softmax_topk_reference", "softmax_topk_triton", "top_k_indices"]

CHUNK = 4096  # columns per first-stage program: 12 chunks for a 49,152-token vocabulary


def _check(logits: torch.Tensor, k: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, vocab], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k must lie in 1..{logits.shape[1]} (the vocabulary), got {k}")


def softmax_topk_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check(logits, k)
    probs = torch.softmax(logits.float(), dim=-1)
    if k == 1:  # max breaks ties towards the lower id, as the contract says; topk does not promise it
        top, ids = probs.max(dim=-1, keepdim=True)
        return top, ids
    return probs.topk(k, dim=-1)


if triton is not None:

    @triton.jit
    def _chunk_topk_kernel(x_ptr, stride_row, n_cols, val_ptr, idx_ptr, max_ptr, sum_ptr,
                           NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr, K: tl.constexpr):
        row, chunk = tl.program_id(0), tl.program_id(1)
        offs = tl.arange(0, CHUNK)
        cols = chunk * CHUNK + offs
        x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < n_cols, other=float("-inf"))
        x = x.to(tl.float32)
        m = tl.max(x, 0)
        out = row * NUM_CHUNKS + chunk
        tl.store(max_ptr + out, m)
        tl.store(sum_ptr + out, tl.where(m == float("-inf"), 0.0, tl.sum(tl.exp(x - m), 0)))  # an all -inf chunk
        for j in tl.static_range(K):
            i = tl.argmax(x, 0, tie_break_left=True)
            tl.store(val_ptr + out * K + j, tl.max(x, 0))
            tl.store(idx_ptr + out * K + j, chunk * CHUNK + i)
            x = tl.where(offs == i, float("-inf"), x)

    @triton.jit
    def _merge_topk_kernel(val_ptr, idx_ptr, max_ptr, sum_ptr, probs_ptr, ids_ptr, vocab,
                           NUM_CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, K: tl.constexpr,
                           CANDIDATES_P2: tl.constexpr):
        row = tl.program_id(0)
        ch = tl.arange(0, CHUNKS_P2)
        m = tl.load(max_ptr + row * NUM_CHUNKS + ch, mask=ch < NUM_CHUNKS, other=float("-inf"))
        s = tl.load(sum_ptr + row * NUM_CHUNKS + ch, mask=ch < NUM_CHUNKS, other=0.0)
        top = tl.max(m, 0)
        total = tl.sum(s * tl.exp(m - top), 0)
        cand = tl.arange(0, CANDIDATES_P2)
        ok = cand < NUM_CHUNKS * K
        v = tl.load(val_ptr + row * NUM_CHUNKS * K + cand, mask=ok, other=float("-inf"))
        ids = tl.load(idx_ptr + row * NUM_CHUNKS * K + cand, mask=ok, other=0)
        for j in tl.static_range(K):
            best = tl.max(v, 0)
            tok = tl.min(tl.where(v == best, ids, vocab), 0)  # the lower id among equal logits
            tl.store(probs_ptr + row * K + j, tl.exp(best - top) / total)
            tl.store(ids_ptr + row * K + j, tok.to(tl.int64))
            v = tl.where((v == best) & (ids == tok), float("-inf"), v)


def softmax_topk_triton(logits: torch.Tensor, k: int, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    require_triton("softmax_topk_triton")
    _check(logits, k)
    if logits.stride(1) != 1:
        raise ValueError("logits must have a unit-stride last dimension")
    if chunk < k or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= k, got {chunk}")
    n, vocab = logits.shape
    chunks = triton.cdiv(vocab, chunk)
    dev = logits.device
    vals = torch.empty(n, chunks, k, dtype=torch.float32, device=dev)
    idx = torch.empty(n, chunks, k, dtype=torch.int32, device=dev)
    maxes = torch.empty(n, chunks, dtype=torch.float32, device=dev)
    sums = torch.empty(n, chunks, dtype=torch.float32, device=dev)
    probs = torch.empty(n, k, dtype=torch.float32, device=dev)
    ids = torch.empty(n, k, dtype=torch.int64, device=dev)
    if n == 0:
        return probs, ids
    _chunk_topk_kernel[(n, chunks)](logits, logits.stride(0), vocab, vals, idx, maxes, sums,
                                    NUM_CHUNKS=chunks, CHUNK=chunk, K=k, num_warps=4)
    _merge_topk_kernel[(n,)](vals, idx, maxes, sums, probs, ids, vocab, NUM_CHUNKS=chunks,
                             CHUNKS_P2=triton.next_power_of_2(chunks), K=k,
                             CANDIDATES_P2=triton.next_power_of_2(chunks * k), num_warps=1)
    return probs, ids


def softmax_topk(logits: torch.Tensor, k: int, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities (float32, descending) and token ids (int64) of each row's k likeliest tokens."""
    if pick_backend(backend, logits) == "triton":
        return softmax_topk_triton(logits, k)
    return softmax_topk_reference(logits, k)


def top_k_indices(x: torch.Tensor, k: int, backend: str = "auto") -> torch.Tensor:
    """Indices (int64 [N, k]) of each row's k largest values, largest first; the kernels compare the
    values themselves (only their outputs are probabilities), so values far below a row's maximum, whose
    probabilities underflow to 0, still rank exactly. Equal values may come in any order."""
    if pick_backend(backend, x) == "triton":
        return softmax_topk_triton(x, k)[1]
    _check(x, k)
    return x.topk(k, dim=-1).indices


def row_argmax(x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Each row's index of its largest value, the first among equal ones (torch.argmax's rule), int64 [N].
    Greedy decoding, AR and speculative alike, decides every token with it."""
    if pick_backend(backend, x) == "triton":
        return softmax_topk_triton(x, 1)[1].squeeze(1)
    _check(x, 1)
    return x.argmax(dim=-1)
