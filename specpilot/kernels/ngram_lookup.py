"""Prompt lookup on the device: continue the latest earlier occurrence of each request's last n tokens.

Why: a draft tree takes prompt lookup's continuation as one more path. Looked up on the host, it waits
for the step's tokens to reach the host, and the next tree cannot be built before that; looked up here,
from a token history the device keeps itself, the next draft (body, lookup, tree) is launched right
after acceptance and runs while the host is still reading the tokens.

Contract (the host lookup `drafters.ngram.NgramIndex.match`, for n from `max_n` down to `min_n`):
``history`` [S, W] int64 holds each slot's tokens from position 0; request i reads row ``slots[i]``
and knows its first ``lengths[i]`` tokens (clamped to 1..W). For the longest n with a match, the match
is the latest earlier n-gram ``history[s : s + n]`` equal to the last n tokens that has a token after
it (s + n <= length - 1); the continuation is ``history[s + n + j]`` for j < K, positions past the
last known token repeating it. Without a match the continuation is the last token repeated. Output
[n, K + 1] int64: the found flag (0 or 1), then the K tokens.

Method: for every end position e, m(e) = how many of the tokens ending at e match the tokens ending
the context (at most max_n); the answer maximises m(e) * W + e over e <= length - 2 with m(e) >= min_n.

Entry points: ``ngram_lookup_reference`` (plain torch; CPU), ``ngram_lookup_triton`` (one program per
request; CUDA) and the dispatcher ``ngram_lookup``. No host sync, grid fixed by shapes: graph-capturable.
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_support import pick_backend, require_triton, tl, triton

__all__ = ["ngram_lookup", "ngram_lookup_reference", "ngram_lookup_triton"]


def _check(history: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int) -> None:
    if history.dim() != 2 or history.dtype != torch.int64:
        raise ValueError(f"history must be int64 [slots, width], got {history.dtype} {tuple(history.shape)}")
    if slots.dim() != 1 or lengths.shape != slots.shape:
        raise ValueError(f"slots and lengths must be [n] each, got {tuple(slots.shape)} and {tuple(lengths.shape)}")
    if k < 1 or not 1 <= min_n <= max_n:
        raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n, got k={k}, min_n={min_n}, max_n={max_n}")


def ngram_lookup_reference(history: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int,
                           max_n: int) -> torch.Tensor:
    _check(history, slots, lengths, k, min_n, max_n)
    width = history.shape[1]
    rows = history.index_select(0, slots.long())
    lens = lengths.long().clamp(1, width)
    ends = torch.arange(width, device=history.device)
    run = torch.ones(rows.shape, dtype=torch.bool, device=history.device)
    matched = torch.zeros(rows.shape, dtype=torch.long, device=history.device)
    for i in range(max_n):
        here, last = ends - i, lens - 1 - i
        same = rows.gather(1, here.clamp(min=0).expand_as(rows)) == rows.gather(1, last.clamp(min=0)[:, None])
        run &= same & (here >= 0) & (last >= 0)[:, None]
        matched += run
    ok = (matched >= min_n) & (ends <= lens[:, None] - 2)
    key = torch.where(ok, matched * width + ends, -1).amax(1)
    found = key >= 0
    start = torch.where(found, key % width + 1, lens - 1)
    at = torch.minimum(start[:, None] + torch.arange(k, device=history.device), (lens - 1)[:, None])
    return torch.cat([found.long()[:, None], rows.gather(1, at)], 1)


if triton is not None:

    @triton.jit
    def _ngram_lookup_kernel(hist_ptr, stride_slot, width, slots_ptr, lens_ptr, out_ptr,
                             K: tl.constexpr, KP: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr,
                             BLOCK: tl.constexpr):
        i = tl.program_id(0)
        row = hist_ptr + tl.load(slots_ptr + i).to(tl.int64) * stride_slot
        length = tl.minimum(tl.maximum(tl.load(lens_ptr + i).to(tl.int64), 1), width)
        best = tl.full([], -1, tl.int64)
        for start in range(0, length - 1, BLOCK):
            ends = start + tl.arange(0, BLOCK).to(tl.int64)
            before = ends < length - 1  # an n-gram ending here has a token after it
            matched = tl.zeros([BLOCK], tl.int64)
            run = tl.full([BLOCK], 1, tl.int64)
            for j in tl.static_range(MAX_N):
                last = length - 1 - j
                tail = tl.load(row + tl.maximum(last, 0))
                ok = before & (ends >= j)  # implies last >= 1
                here = tl.load(row + ends - j, mask=ok, other=0)
                run = tl.where(ok & (here == tail), run, 0)
                matched += run
            key = tl.where(matched >= MIN_N, matched * width + ends, -1)
            best = tl.maximum(best, tl.max(key, 0))
        found = best >= 0
        first = tl.where(found, best % width + 1, length - 1)
        j = tl.arange(0, KP)
        tokens = tl.load(row + tl.minimum(first + j, length - 1))
        tl.store(out_ptr + i * (K + 1), found.to(tl.int64))
        tl.store(out_ptr + i * (K + 1) + 1 + j, tokens, mask=j < K)


def ngram_lookup_triton(history: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int,
                        max_n: int) -> torch.Tensor:
    require_triton("ngram_lookup_triton")
    _check(history, slots, lengths, k, min_n, max_n)
    if history.stride(1) != 1:
        history = history.contiguous()
    out = torch.empty(slots.shape[0], k + 1, dtype=torch.int64, device=history.device)
    if slots.shape[0]:
        _ngram_lookup_kernel[(slots.shape[0],)](history, history.stride(0), history.shape[1], slots, lengths, out,
                                                K=k, KP=triton.next_power_of_2(k), MIN_N=min_n, MAX_N=max_n,
                                                BLOCK=1024, num_warps=4)
    return out


def ngram_lookup(history: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int,
                 backend: str = "auto") -> torch.Tensor:
    """[n, k + 1]: per request the found flag, then prompt lookup's k tokens (see the module's contract)."""
    if pick_backend(backend, history) == "triton":
        return ngram_lookup_triton(history, slots, lengths, k, min_n, max_n)
    return ngram_lookup_reference(history, slots, lengths, k, min_n, max_n)
