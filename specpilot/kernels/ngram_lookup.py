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

``append_and_lookup`` first appends each request's newly committed tokens (``tokens[i, :counts[i]]`` at
positions ``starts[i] + 1 ...``; none past the last column, which the caller keeps as a sink) and then
looks up with ``lengths = starts + 1 + counts`` (at most the columns before the sink): in one launch, the kernel's writes made visible to its
reads by a barrier.

Entry points: ``*_reference`` (plain torch; CPU), ``*_triton`` (one program per request; CUDA) and the
dispatchers ``ngram_lookup`` and ``append_and_lookup``. No host sync, grid fixed by shapes:
graph-capturable.
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_support import pick_backend, require_triton, tl, triton

__all__ = ["append_and_lookup", "append_and_lookup_reference", "append_and_lookup_triton", "ngram_lookup",
           "ngram_lookup_reference", "ngram_lookup_triton"]


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


def append_and_lookup_reference(history: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, tokens: torch.Tensor,
                                counts: torch.Tensor, k: int, min_n: int, max_n: int) -> torch.Tensor:
    _check(history, slots, starts, k, min_n, max_n)
    sink = history.shape[1] - 1
    pos = starts[:, None] + 1 + torch.arange(tokens.shape[1], device=history.device)
    col = torch.where((pos < (starts + 1 + counts)[:, None]) & (pos < sink), pos, sink)
    history.view(-1).index_copy_(0, (slots.long()[:, None] * history.shape[1] + col).flatten(), tokens.flatten())
    return ngram_lookup_reference(history, slots, (starts + 1 + counts).clamp(max=sink), k, min_n, max_n)


if triton is not None:

    @triton.jit
    def _ngram_lookup_kernel(hist_ptr, stride_slot, width, slots_ptr, lens_ptr, out_ptr, starts_ptr, tokens_ptr,
                             stride_tokens, counts_ptr, K: tl.constexpr, KP: tl.constexpr, MIN_N: tl.constexpr,
                             MAX_N: tl.constexpr, BLOCK: tl.constexpr, APPEND: tl.constexpr, Q: tl.constexpr,
                             QP: tl.constexpr):
        i = tl.program_id(0)
        row = hist_ptr + tl.load(slots_ptr + i).to(tl.int64) * stride_slot
        if APPEND:
            start = tl.load(starts_ptr + i).to(tl.int64)
            count = tl.load(counts_ptr + i).to(tl.int64)
            q = tl.arange(0, QP).to(tl.int64)
            new = tl.load(tokens_ptr + i * stride_tokens + q, mask=q < Q, other=0)
            tl.store(row + start + 1 + q, new, mask=(q < count) & (start + 1 + q < width - 1))
            tl.debug_barrier()  # the lookup below reads what every thread just wrote
            raw_length = tl.minimum(start + 1 + count, width - 1)  # the sink column is no token
        else:
            raw_length = tl.load(lens_ptr + i).to(tl.int64)
        length = tl.minimum(tl.maximum(raw_length, 1), width)
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


def _launch(history: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor | None, k: int, min_n: int, max_n: int,
            append: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    if history.stride(1) != 1:
        raise ValueError("history rows must be contiguous (the kernel writes and reads them in place)")
    out = torch.empty(slots.shape[0], k + 1, dtype=torch.int64, device=history.device)
    slots = slots.contiguous()  # the kernel reads per-request values at i
    lengths = lengths.contiguous() if lengths is not None else None
    starts, tokens, counts = append if append is not None else (slots, slots[:, None], slots)
    starts, counts = starts.contiguous(), counts.contiguous()
    if slots.shape[0]:
        _ngram_lookup_kernel[(slots.shape[0],)](
            history, history.stride(0), history.shape[1], slots, lengths if lengths is not None else slots, out,
            starts, tokens, tokens.stride(0), counts, K=k, KP=triton.next_power_of_2(k), MIN_N=min_n, MAX_N=max_n,
            BLOCK=1024, APPEND=append is not None, Q=tokens.shape[1], QP=triton.next_power_of_2(tokens.shape[1]),
            num_warps=4)
    return out


def ngram_lookup_triton(history: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int,
                        max_n: int) -> torch.Tensor:
    require_triton("ngram_lookup_triton")
    _check(history, slots, lengths, k, min_n, max_n)
    return _launch(history, slots, lengths, k, min_n, max_n, None)


def append_and_lookup_triton(history: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, tokens: torch.Tensor,
                             counts: torch.Tensor, k: int, min_n: int, max_n: int) -> torch.Tensor:
    require_triton("append_and_lookup_triton")
    _check(history, slots, starts, k, min_n, max_n)
    if tokens.stride(1) != 1:
        tokens = tokens.contiguous()
    return _launch(history, slots, None, k, min_n, max_n, (starts, tokens, counts))


def ngram_lookup(history: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int,
                 backend: str = "auto") -> torch.Tensor:
    """[n, k + 1]: per request the found flag, then prompt lookup's k tokens (see the module's contract)."""
    if pick_backend(backend, history) == "triton":
        return ngram_lookup_triton(history, slots, lengths, k, min_n, max_n)
    return ngram_lookup_reference(history, slots, lengths, k, min_n, max_n)


def append_and_lookup(history: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, tokens: torch.Tensor,
                      counts: torch.Tensor, k: int, min_n: int, max_n: int, backend: str = "auto") -> torch.Tensor:
    """Append the committed tokens, then `ngram_lookup` from the new ends (see the module's contract)."""
    if pick_backend(backend, history) == "triton":
        return append_and_lookup_triton(history, slots, starts, tokens, counts, k, min_n, max_n)
    return append_and_lookup_reference(history, slots, starts, tokens, counts, k, min_n, max_n)
