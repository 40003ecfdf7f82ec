"""Exact verification inside SGLang: each verify row's attention computed as SGLang's AR decode computes it.

Under `--enable-deterministic-inference` SGLang's Triton backend is batch-invariant, but it computes a decode
row with its split decode kernel (a fixed tile of positions per split, then a merge) and a TARGET_VERIFY row
with its one-pass extend kernel; the two sum in different orders, so in bf16 a verify row's logits can differ
from the decode row of the same token by a rounding step, and greedy ties flip. Everything else in the
forward is row-invariant there (SGLang's batch-invariant matmuls and norms, rotary by position).

So for SPECPILOT's TARGET_VERIFY passes the backend runs its own decode path (`forward_decode`: the same K/V
write, the same kernel call) on one decode row per verify row: row (request i, node j at depth d) reads the
request's cached positions, then the out-cache slots of j's ancestors and j itself in depth order —
seq_len_i + d + 1 keys, the sequence AR decode reads for that token — with the split count of that length.
The hooks below (SGLang's HookRegistry, AROUND, on TritonAttnBackend; `plugin.attention_backend_init` marks
the backends they act on) build that layout for eager passes and into the backend's CUDA-graph buffers for
graph replays (built outside the graph, as SGLang's own metadata is). The cost: every verify row reads its
whole context, D times the extend kernel's key reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

BACKEND = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend"
ROWS = "_specpilot_decode_rows"  # set on a backend by plugin.attention_backend_init
ROW_INDPTR = "_specpilot_row_indptr"  # the graphs' row offsets: SGLang's kv_indptr holds one per request slot


def supported(backend: Any) -> str | None:
    """Why this backend cannot run verify rows as decode rows, or None when it can."""
    if not backend.enable_deterministic:
        return "without --enable-deterministic-inference SGLang's own decode is not batch-invariant"
    if backend.page_size != 1:
        return f"--page-size {backend.page_size}: decode rows index single positions (page size 1)"
    if backend.sliding_window_size is not None and backend.sliding_window_size > 0:
        return "sliding-window attention"
    if backend.use_mla or backend.dcp_size > 1:
        return "MLA or decode context parallelism"
    if getattr(backend, "_translate_kv_loc", None) is not None:
        return "a unified KV pool"
    return None


def build_rows(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               depths: torch.Tensor, ancestors: torch.Tensor, out_cache_loc: torch.Tensor,
               kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> torch.Tensor:
    """Lay out one decode row per verify row into `kv_indptr` [>= bs * D + 1] and `kv_indices` (its last entry
    a scratch slot past every row's keys); returns the rows' key counts [bs * D].

    `depths` [bs, D] each node's depth (the newest committed token's 0), `ancestors` [bs, D, D] whether key
    node a is row node j or its ancestor, `out_cache_loc` [bs * D] the block's K/V slots in node order."""
    from sglang.kernels.ops.kvcache.kv_indices import create_flashinfer_kv_indices_triton

    bs, d = depths.shape
    n = bs * d
    seq_lens = seq_lens.long()
    lengths = (seq_lens[:, None] + depths.long() + 1).flatten()
    kv_indptr[0] = 0
    kv_indptr[1:n + 1] = lengths.cumsum(0)
    # each row's context: the request's cached positions, as AR decode reads them
    create_flashinfer_kv_indices_triton[(n,)](req_to_token, req_pool_indices.repeat_interleave(d),
                                              seq_lens.repeat_interleave(d), kv_indptr, None, kv_indices,
                                              req_to_token.stride(0))
    # then the row's path: key node a lands at the row's seq_len + depth(a); other nodes go to the scratch slot
    path_start = kv_indptr[:n].long().view(bs, d, 1) + seq_lens.view(bs, 1, 1)
    dest = torch.where(ancestors, path_start + depths.long().view(bs, 1, d), kv_indices.shape[0] - 1)
    kv_indices[dest.flatten()] = out_cache_loc.view(bs, 1, d).expand(bs, d, d).flatten().to(kv_indices.dtype)
    return lengths


def graph_state(init_cuda_graph_state: Any, backend: Any, max_bs: int, max_num_tokens: int, *args: Any,
                **kwargs: Any) -> Any:
    """SGLang sizes its graph buffers (attention partials, split counts, key indices) for max_num_tokens rows
    — a verify graph's bs * D; the row offsets need as many."""
    result = init_cuda_graph_state(backend, max_bs, max_num_tokens, *args, **kwargs)
    if getattr(backend, ROWS, False):
        setattr(backend, ROW_INDPTR, torch.zeros(max_num_tokens + 1, dtype=torch.int32, device=backend.device))
    return result


def eager_metadata(init_forward_metadata: Any, backend: Any, forward_batch: Any) -> Any:
    """An eager verify pass's rows in buffers of its own, replacing SGLang's extend layout."""
    result = init_forward_metadata(backend, forward_batch)
    if getattr(backend, ROWS, False) and forward_batch.forward_mode.is_target_verify():
        bs, d = _tree(forward_batch.spec_info)[0].shape
        n = bs * d
        # the host's lengths bound the keys without a device sync (a decode batch's seq_lens_sum can lag them)
        cpu_lens = forward_batch.seq_lens_cpu
        seq_lens_sum = bs * backend.max_context_len if cpu_lens is None else int(cpu_lens.sum())
        kv_indptr = torch.empty(n + 1, dtype=torch.int32, device=backend.device)
        kv_indices = torch.empty(seq_lens_sum * d + n * d + 1, dtype=torch.int64, device=backend.device)
        splits = torch.empty(n, dtype=torch.int32, device=backend.device)
        _fill(backend, forward_batch, kv_indptr, kv_indices, splits)
        backend.forward_metadata = dataclasses.replace(
            backend.forward_metadata, kv_indptr=kv_indptr, kv_indices=kv_indices, num_kv_splits=splits,
            attn_logits=torch.empty((n, backend.num_head, backend.max_kv_splits, backend.v_head_dim),
                                    dtype=torch.float32, device=backend.device),
            attn_lse=torch.empty((n, backend.num_head, backend.max_kv_splits), dtype=torch.float32,
                                 device=backend.device))
    return result


def graph_metadata(init_forward_metadata_out_graph: Any, backend: Any, forward_batch: Any,
                   in_capture: bool = False) -> Any:
    """At capture the metadata points the graph's decode kernels at the graph buffers; at replay SGLang
    reuses it and refills the buffers, so the rows are rewritten in place (after SGLang's own TARGET_VERIFY
    layout, which shares the key-index buffer)."""
    result = init_forward_metadata_out_graph(backend, forward_batch, in_capture=in_capture)
    if getattr(backend, ROWS, False) and forward_batch.forward_mode.is_target_verify():
        n = forward_batch.batch_size * _tree(forward_batch.spec_info)[0].shape[1]
        kv_indptr = getattr(backend, ROW_INDPTR)[:n + 1]
        _fill(backend, forward_batch, kv_indptr, backend.cuda_graph_kv_indices, backend.cuda_graph_num_kv_splits[:n])
        if in_capture:
            backend.forward_metadata = dataclasses.replace(
                backend.forward_metadata, kv_indptr=kv_indptr, kv_indices=backend.cuda_graph_kv_indices,
                num_kv_splits=backend.cuda_graph_num_kv_splits, attn_logits=backend.cuda_graph_attn_logits,
                attn_lse=backend.cuda_graph_attn_lse)
    return result


def verify_as_decode(forward_extend: Any, backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     layer: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    if getattr(backend, ROWS, False) and forward_batch.forward_mode.is_target_verify():
        return backend.forward_decode(q, k, v, layer, forward_batch, *args, **kwargs)
    return forward_extend(backend, q, k, v, layer, forward_batch, *args, **kwargs)


HOOKS = {f"{BACKEND}.init_cuda_graph_state": graph_state, f"{BACKEND}.init_forward_metadata": eager_metadata,
         f"{BACKEND}.init_forward_metadata_out_graph": graph_metadata, f"{BACKEND}.forward_extend": verify_as_decode}


def _fill(backend: Any, forward_batch: Any, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
          splits: torch.Tensor) -> None:
    """The rows of the batch (a CUDA graph's padded batch: requests past the live ones are single-node rows
    on the padding's slot 0) into the given buffers, and each row's split count, as decode picks it for a
    row of that length."""
    depths, ancestors = _tree(forward_batch.spec_info)
    bs = forward_batch.batch_size
    live, d = depths.shape
    out_cache_loc = forward_batch.out_cache_loc
    if live < bs:
        pad = bs - live
        depths = torch.cat([depths, depths.new_zeros(pad, d)])
        ancestors = torch.cat([ancestors, torch.eye(d, dtype=torch.bool, device=ancestors.device).expand(pad, d, d)])
        out_cache_loc = torch.cat([out_cache_loc, out_cache_loc.new_zeros(pad * d)])
    lengths = build_rows(backend.req_to_token, forward_batch.req_pool_indices[:bs], forward_batch.seq_lens[:bs],
                         depths, ancestors, out_cache_loc, kv_indptr, kv_indices)
    backend.get_num_kv_splits(splits, lengths)


def _tree(spec_info: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(depths [bs, D], ancestors [bs, D, D]) the worker's verify input carries (worker.to_verify_input)."""
    return spec_info.row_depths, spec_info.row_ancestors
