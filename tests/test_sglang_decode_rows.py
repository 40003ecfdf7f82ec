"""Verify rows as decode rows inside SGLang (specpilot/sglang_ext/decode_rows.py), on CPU.

SGLang's own decode kernel (decode_attention_fwd, in Triton's CPU interpreter, fp32 — the interpreter does not
run its bf16 path) computes every verify row of a tree block laid out by `build_rows`; each row's output must
be, bit for bit, what the same kernel gives AR decode of that row's sequence alone (its request's cached
positions, then its path, a batch of one) — across a split-tile boundary (contexts of 37 and 300 positions at
SGLang's deterministic tile of 256) — and one attention layer end to end through SGLang's own backend code and
KV pool: the hooked forward_extend of a TARGET_VERIFY pass against forward_decode of each row alone. Also: the
layout against a plain listing of each row's keys, a CUDA graph's padded batch, the hooks' eager, capture and
replay paths, the backends the rows refuse, and the hooks SGLang's load_plugins() installs.

The module reruns itself with SGLang's CPU test set on the path (test_sglang_plugin.py says why it lives apart).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specpilot.sglang_ext.layout import verify_tensors

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))
from test_sglang_plugin import CASES, make_case, report_under_sglang  # noqa: E402

SEQ_LENS = [37, 300]  # one request inside the first 256-position tile, one across it
HEADS, KV_HEADS, HEAD_DIM, SLOTS, TILE = 4, 2, 16, 1024, 256
METHODS = ["__init__", "init_cuda_graph_state", "init_forward_metadata", "init_forward_metadata_out_graph",
           "forward_extend"]


def _block() -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(verify tensors of a top-2 tree block for two requests, req_to_token, req_pool_indices, out_cache_loc):
    the requests' cached positions and the block's nodes on distinct K/V slots."""
    newest, drafts, tree, _, _ = make_case(next(c for c in CASES if c.name == "tree-top2"))
    seq_lens = torch.tensor(SEQ_LENS)
    tensors = verify_tensors(newest, drafts, tree, seq_lens, int(seq_lens.sum()))
    slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(3))
    req_to_token = torch.zeros(3, 512, dtype=torch.int32)
    req_pool_indices = torch.tensor([2, 1])
    for i, (row, n) in enumerate(zip(req_pool_indices.tolist(), SEQ_LENS)):
        req_to_token[row, :n] = slots[sum(SEQ_LENS[:i]):sum(SEQ_LENS[:i]) + n]
    out_cache_loc = slots[-tensors.draft_token.numel():]
    return tensors, req_to_token, req_pool_indices, out_cache_loc


def _listed_rows(tensors: Any, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                 out_cache_loc: torch.Tensor) -> list[list[int]]:
    """Each verify row's keys, listed one by one: its request's cached positions, then its path in depth order."""
    bs, d = tensors.depths.shape
    rows = []
    for i in range(bs):
        for j in range(d):
            path = sorted((int(tensors.depths[i, a]), int(out_cache_loc[i * d + a])) for a in range(d)
                          if tensors.ancestors[i, j, a])
            rows.append(req_to_token[req_pool_indices[i], :SEQ_LENS[i]].tolist() + [loc for _, loc in path])
    return rows


def _backend(req_to_token: torch.Tensor) -> Any:
    """SGLang's Triton backend as deterministic inference sets up the parts the rows use (its split counts)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    backend = object.__new__(TritonAttnBackend)
    backend.req_to_token, backend.enable_deterministic, backend.split_tile_size = req_to_token, True, TILE
    backend.static_kv_splits, backend.device_core_count = False, 0
    return backend


def _decode(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], rows: list[list[int]], backend: Any,
            max_splits: int) -> torch.Tensor:
    """SGLang's decode kernel over `rows` (each a row's keys) in one batch, split counts as decode picks them."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    n = len(rows)
    lengths = torch.tensor([len(r) for r in rows])
    indptr = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    splits = torch.empty(n, dtype=torch.int32)
    backend.get_num_kv_splits(splits, lengths)
    o = torch.zeros_like(q)
    decode_attention_fwd(q, *kv, o, indptr, torch.tensor(sum(rows, []), dtype=torch.int64),
                         torch.zeros(n, HEADS, max_splits, HEAD_DIM), torch.zeros(n, HEADS, max_splits), splits,
                         max_splits, HEAD_DIM ** -0.5, 1.0, 1.0)
    return o


def _under_sglang() -> dict[str, Any]:
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.plugins import load_plugins

    from specpilot.sglang_ext import decode_rows

    load_plugins()
    report: dict[str, Any] = {"hooked": {m: hasattr(getattr(TritonAttnBackend, m), "__wrapped__") for m in METHODS}}
    tensors, req_to_token, req_pool_indices, out_cache_loc = _block()
    bs, d = tensors.depths.shape
    n = bs * d
    backend = _backend(req_to_token)
    indptr = torch.empty(n + 1, dtype=torch.int32)
    indices = torch.full((sum(SEQ_LENS) * d + n * d + 1,), -1, dtype=torch.int64)
    lengths = decode_rows.build_rows(req_to_token, req_pool_indices, torch.tensor(SEQ_LENS), tensors.depths,
                                     tensors.ancestors, out_cache_loc, indptr, indices)
    built = [indices[indptr[r]:indptr[r + 1]].tolist() for r in range(n)]
    listed = _listed_rows(tensors, req_to_token, req_pool_indices, out_cache_loc)
    report["layout"] = {"built_is_listed": built == listed, "lengths": lengths.tolist(),
                        "lengths_listed": [len(r) for r in listed]}
    splits = torch.empty(n, dtype=torch.int32)
    backend.get_num_kv_splits(splits, lengths)
    report["splits"] = sorted(set(splits.tolist()))

    g = torch.Generator().manual_seed(5)
    kv = (torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=g), torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=g))
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g)
    max_splits = -(-max(map(len, listed)) // TILE)
    o = torch.zeros_like(q)
    decode_attention_fwd(q, *kv, o, indptr, indices, torch.zeros(n, HEADS, max_splits, HEAD_DIM),
                         torch.zeros(n, HEADS, max_splits), splits, max_splits, HEAD_DIM ** -0.5, 1.0, 1.0)
    alone = torch.cat([_decode(q[r:r + 1], kv, [listed[r]], backend, max_splits) for r in range(n)])
    report["attention"] = {"rows_equal_ar_decode_alone": torch.equal(o, alone),
                           "one_split_per_tile_differs": not torch.equal(
                               o, _decode(q, kv, listed, _backend_fixed(req_to_token), max_splits)),
                           "finite": bool(torch.isfinite(o).all())}

    # a CUDA graph's padded batch: one more request than the live ones (SGLang pads with slot row 0, length 1)
    padded_pool_indices = torch.cat([req_pool_indices, req_pool_indices.new_zeros(1)])
    fb = SimpleNamespace(batch_size=bs + 1, req_pool_indices=padded_pool_indices,
                         seq_lens=torch.tensor(SEQ_LENS + [1]), out_cache_loc=out_cache_loc,
                         spec_info=SimpleNamespace(row_depths=tensors.depths, row_ancestors=tensors.ancestors))
    padded_indptr = torch.empty(n + d + 1, dtype=torch.int32)
    padded_indices = torch.full_like(indices, -1)
    padded_splits = torch.empty(n + d, dtype=torch.int32)
    decode_rows._fill(backend, fb, padded_indptr, padded_indices, padded_splits)
    report["padded"] = {"live_rows_unchanged": [padded_indices[padded_indptr[r]:padded_indptr[r + 1]].tolist()
                                                for r in range(n)] == built,
                        "padding_lengths": torch.diff(padded_indptr)[n:].tolist(),
                        "padding_splits": padded_splits[n:].tolist()}
    report["hooks"] = _hook_results(tensors, req_to_token, req_pool_indices, out_cache_loc, built)
    report["layer"] = _layer_results(tensors, req_to_token, req_pool_indices, out_cache_loc, listed)
    report["refused"] = {name: decode_rows.supported(SimpleNamespace(**{**_SUPPORTED, **change}))
                         for name, change in {"supported": {}, "nondeterministic": {"enable_deterministic": False},
                                              "paged": {"page_size": 16}, "window": {"sliding_window_size": 4096},
                                              "mla": {"use_mla": True}}.items()}
    return report


def _hook_results(tensors: Any, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                  out_cache_loc: torch.Tensor, built: list[list[int]]) -> dict[str, Any]:
    """The hooks around the backend's own methods (stood in for by what they leave behind): eager metadata, a
    graph's capture then replay, and the verify pass's route to the decode path."""
    from sglang.srt.layers.attention.triton_backend import ForwardMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from specpilot.sglang_ext import decode_rows

    bs, d = tensors.depths.shape
    n, max_splits = bs * d, 2
    backend = _backend(req_to_token)
    setattr(backend, decode_rows.ROWS, True)
    backend.device, backend.num_head, backend.v_head_dim, backend.max_kv_splits = "cpu", HEADS, HEAD_DIM, max_splits
    backend.max_context_len = req_to_token.shape[1]
    blank = ForwardMetadata(*[None] * 13)

    def sglangs_own(b: Any, *args: Any, **kwargs: Any) -> None:
        b.forward_metadata = blank

    def graph_buffers(b: Any, max_bs: int, max_num_tokens: int) -> None:
        b.cuda_graph_kv_indices = torch.zeros(max_num_tokens * b.max_context_len, dtype=torch.int64)
        b.cuda_graph_num_kv_splits = torch.full((max_num_tokens,), max_splits, dtype=torch.int32)
        b.cuda_graph_attn_logits = torch.zeros(max_num_tokens, HEADS, max_splits, HEAD_DIM)
        b.cuda_graph_attn_lse = torch.zeros(max_num_tokens, HEADS, max_splits)

    fb = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, req_pool_indices=req_pool_indices,
                         seq_lens=torch.tensor(SEQ_LENS), seq_lens_cpu=torch.tensor(SEQ_LENS),
                         out_cache_loc=out_cache_loc,
                         spec_info=SimpleNamespace(row_depths=tensors.depths, row_ancestors=tensors.ancestors))

    def rows_of(md: Any) -> list[list[int]]:
        return [md.kv_indices[md.kv_indptr[r]:md.kv_indptr[r + 1]].tolist() for r in range(n)]

    decode_rows.eager_metadata(sglangs_own, backend, fb)
    eager = backend.forward_metadata
    result = {"eager_rows": rows_of(eager) == built, "eager_partials": list(eager.attn_logits.shape)}
    decode_rows.graph_state(graph_buffers, backend, bs + 1, (bs + 1) * d)
    decode_rows.graph_metadata(sglangs_own, backend, fb, in_capture=True)
    captured = backend.forward_metadata
    row_indptr = getattr(backend, decode_rows.ROW_INDPTR)
    result["capture_on_graph_buffers"] = (captured.kv_indices is backend.cuda_graph_kv_indices
                                          and captured.attn_logits is backend.cuda_graph_attn_logits
                                          and captured.kv_indptr.data_ptr() == row_indptr.data_ptr())
    result["capture_rows"] = rows_of(captured) == built
    chain = SimpleNamespace(row_depths=torch.arange(d).expand(bs, d),
                            row_ancestors=torch.ones(d, d, dtype=torch.bool).tril().expand(bs, d, d))
    decode_rows.graph_metadata(lambda b, *a, **k: None, backend, SimpleNamespace(**{**vars(fb), "spec_info": chain}))
    result["replay_refills_in_place"] = rows_of(captured)[d - 1] == built[0][:SEQ_LENS[0]] + out_cache_loc[:d].tolist()

    routes = []
    backend.forward_decode = lambda *args, **kwargs: routes.append("decode")
    for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND):
        decode_rows.verify_as_decode(lambda *args, **kwargs: routes.append("extend"), backend, None, None, None, None,
                                     SimpleNamespace(forward_mode=mode))
    result["routes"] = routes
    return result


def _layer_results(tensors: Any, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                   out_cache_loc: torch.Tensor, listed: list[list[int]]) -> dict[str, Any]:
    """One attention layer end to end through SGLang's own code: the hooked forward_extend of a TARGET_VERIFY pass
    (its K/V written into SGLang's KV pool, then its decode rows) against forward_decode of each row alone, as
    AR decodes that token with its path's K/V already cached."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.srt.layers.attention.triton_backend import ForwardMetadata, TritonAttnBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from specpilot.sglang_ext import decode_rows

    bs, d = tensors.depths.shape
    n, max_splits = bs * d, 2
    layer = RadixAttention(HEADS, HEAD_DIM, HEAD_DIM ** -0.5, KV_HEADS, 0)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(n, HEADS * HEAD_DIM, generator=g)  # as RadixAttention hands them to the backend
    k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    context = (torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=g), torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=g))

    def backend_on(pool: Any) -> Any:
        backend = _backend(req_to_token)
        backend.token_to_kv_pool, backend.decode_attention_fwd = pool, decode_attention_fwd
        backend.use_mla, backend.dcp_size, backend.use_pdl, backend.page_size = False, 1, False, 1
        backend.swa_v_head_dim, backend.max_kv_splits, backend.device = None, max_splits, "cpu"
        backend.num_head, backend.v_head_dim, backend.max_context_len = HEADS, HEAD_DIM, req_to_token.shape[1]
        return backend

    def pool_with_context() -> Any:
        pool = MHATokenToKVPool(SLOTS, 1, torch.float32, KV_HEADS, HEAD_DIM, 1, "cpu", False, enable_alt_stream=False)
        pool.get_key_buffer(0)[:SLOTS].copy_(context[0])
        pool.get_value_buffer(0)[:SLOTS].copy_(context[1])
        return pool

    verifier = backend_on(pool_with_context())
    setattr(verifier, decode_rows.ROWS, True)
    fb = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, req_pool_indices=req_pool_indices,
                         seq_lens=torch.tensor(SEQ_LENS), seq_lens_cpu=torch.tensor(SEQ_LENS),
                         out_cache_loc=out_cache_loc, positions=None,
                         spec_info=SimpleNamespace(row_depths=tensors.depths, row_ancestors=tensors.ancestors))
    blank = ForwardMetadata(*[None] * 13)
    decode_rows.eager_metadata(lambda b, _: setattr(b, "forward_metadata", blank), verifier, fb)
    verified = TritonAttnBackend.forward_extend(verifier, q, k, v, layer, fb)

    ar_pool = pool_with_context()  # the block's K/V cached as the earlier AR steps wrote them
    ar_pool.get_key_buffer(0)[out_cache_loc] = k
    ar_pool.get_value_buffer(0)[out_cache_loc] = v
    ar = backend_on(ar_pool)
    decoded = []
    for r, keys in enumerate(listed):
        splits = torch.empty(1, dtype=torch.int32)
        ar.get_num_kv_splits(splits, torch.tensor([len(keys)]))
        ar.forward_metadata = dataclasses.replace(
            blank, kv_indptr=torch.tensor([0, len(keys)], dtype=torch.int32), kv_indices=torch.tensor(keys),
            num_kv_splits=splits, attn_logits=torch.zeros(1, HEADS, max_splits, HEAD_DIM),
            attn_lse=torch.zeros(1, HEADS, max_splits))
        row = SimpleNamespace(forward_mode=ForwardMode.DECODE, out_cache_loc=out_cache_loc[r:r + 1], positions=None)
        decoded.append(ar.forward_decode(q[r:r + 1], k[r:r + 1], v[r:r + 1], layer, row))
    return {"verify_is_ar_decode": torch.equal(verified, torch.cat(decoded)),
            "pools_equal": torch.equal(verifier.token_to_kv_pool.get_key_buffer(0), ar_pool.get_key_buffer(0))}


_SUPPORTED = {"enable_deterministic": True, "page_size": 1, "sliding_window_size": None, "use_mla": False,
              "dcp_size": 1, "_translate_kv_loc": None}


def _backend_fixed(req_to_token: torch.Tensor) -> Any:
    """The backend outside deterministic inference with static splits: every row at the maximum split count."""
    backend = _backend(req_to_token)
    backend.enable_deterministic, backend.static_kv_splits, backend.max_kv_splits = False, True, 2
    return backend


@pytest.fixture(scope="module")
def rows() -> dict[str, Any]:
    return report_under_sglang(__file__)


def test_load_plugins_hooks_the_triton_backends_verify(rows: dict[str, Any]) -> None:
    assert rows["hooked"] == {m: True for m in METHODS}


def test_each_row_lists_its_requests_context_then_its_path(rows: dict[str, Any]) -> None:
    assert rows["layout"]["built_is_listed"]
    assert rows["layout"]["lengths"] == rows["layout"]["lengths_listed"]
    assert rows["splits"] == [1, 2]  # 37 + depth + 1 keys in one tile; 300 + ... in two


def test_verify_rows_are_bitwise_ar_decode_of_their_paths(rows: dict[str, Any]) -> None:
    attention = rows["attention"]
    assert attention["finite"] and attention["rows_equal_ar_decode_alone"]
    assert attention["one_split_per_tile_differs"]  # the split count matters: the test can tell


def test_a_graphs_padding_rows_are_single_keyed_and_leave_the_live_rows(rows: dict[str, Any]) -> None:
    d = len(rows["padded"]["padding_lengths"])
    assert rows["padded"]["live_rows_unchanged"]
    assert rows["padded"]["padding_lengths"] == [2] * d and rows["padded"]["padding_splits"] == [1] * d


def test_the_hooks_lay_rows_out_eagerly_and_into_a_graphs_buffers(rows: dict[str, Any]) -> None:
    hooks = rows["hooks"]
    assert hooks["eager_rows"] and hooks["eager_partials"] == [16, HEADS, 2, HEAD_DIM]
    assert hooks["capture_on_graph_buffers"] and hooks["capture_rows"]
    assert hooks["replay_refills_in_place"]  # a chain's last row: the whole block, in the captured buffers
    assert hooks["routes"] == ["decode", "extend"]  # only TARGET_VERIFY passes run the decode path


def test_a_verify_layer_through_sglangs_code_is_ar_decode_bit_for_bit(rows: dict[str, Any]) -> None:
    """The hooked forward_extend writes the block's K/V into SGLang's pool, then attends each row as
    forward_decode attends that token alone."""
    assert rows["layer"] == {"verify_is_ar_decode": True, "pools_equal": True}


def test_backends_the_rows_cannot_serve_say_why(rows: dict[str, Any]) -> None:
    refused = rows["refused"]
    assert refused["supported"] is None
    assert "--enable-deterministic-inference" in refused["nondeterministic"]
    assert "--page-size 16" in refused["paged"]
    assert "sliding-window" in refused["window"] and "MLA" in refused["mla"]


if __name__ == "__main__":
    from test_sglang_plugin import _define_torchvision_ops

    TORCHVISION_OPS = _define_torchvision_ops()  # before SGLang's import; a global, so they stay defined
    print(json.dumps(_under_sglang()))
