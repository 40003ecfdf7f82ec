"""H200: the invariant kernels' tile choices - which are bitwise equal, and how fast each runs - timed by CUDA-graph
replay over enough weight (or KV) copies that nothing stays in L2, the way a verify graph meets them.

GEMM: Llama-3.1-8B's weight shapes at decode, verify and prefill sizes; each candidate's rows are checked against
the decode tiles' (the rows a decode pass computes) and timed beside cuBLAS and today's `invariant_config`.
Attention: one layer at Llama-3.1-8B's and the embedded model's heads, today's fastest kernel (batch-sized key
splits) beside the invariant one at several tile heights, whose outputs are checked against 16-row tiles'; then
a 16-node tree verify, the invariant kernel's packed rows beside a program per token (checked equal).

    python benchmarks/gpu_gemm_configs.py [--out DIR] [--old-attention PATH] [--model embedded] [--m 1 16 64]
        [--skip-gemm] [--skip-attention]

``--old-attention``: an older slot_attention.py, timed and checked beside today's invariant kernel.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402

from specpilot.kernels.skinny_gemm import SkinnyConfig, default_config, invariant_config, invariant_gemm  # noqa: E402
from specpilot.kernels.slot_attention import (  # noqa: E402
    kv_splits,
    slot_attention_invariant,
    slot_attention_triton,
    tree_tail_rows,
)

MODEL_SHAPES = {
    "llama-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                 "lm_head": (128256, 4096)},
    "embedded": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                 "lm_head": (49152, 576)},  # SmolLM2-135M
}
M_VALUES = (16, 64, 128, 256, 512, 8192)
# (config, rows of x per program)
CANDIDATES = [
    (SkinnyConfig(64, 128, 1, 4, 4), 64),
    (SkinnyConfig(128, 64, 1, 4, 4), 64),
    (SkinnyConfig(128, 128, 1, 4, 3), 64),
    (SkinnyConfig(128, 64, 1, 8, 4), 64),
    (SkinnyConfig(256, 64, 1, 8, 3), 64),
    (SkinnyConfig(128, 64, 1, 4, 4), 128),
    (SkinnyConfig(128, 64, 1, 8, 4), 128),
    (SkinnyConfig(128, 128, 1, 8, 3), 128),
    (SkinnyConfig(256, 64, 1, 8, 3), 128),
    (SkinnyConfig(256, 128, 1, 8, 2), 128),
    (SkinnyConfig(64, 64, 1, 4, 4), 128),
    (SkinnyConfig(128, 64, 1, 8, 3), 256),
    (SkinnyConfig(128, 64, 1, 4, 5), 32),
    (SkinnyConfig(64, 128, 1, 4, 6), 32),
    (SkinnyConfig(128, 128, 1, 4, 4), 32),
    (SkinnyConfig(128, 64, 1, 8, 4), 256),
    (SkinnyConfig(256, 64, 1, 8, 4), 128),
    (SkinnyConfig(128, 128, 1, 8, 4), 64),
    (SkinnyConfig(64, 128, 1, 8, 4), 64),
    (SkinnyConfig(64, 256, 1, 4, 3), 64),
    (SkinnyConfig(64, 128, 1, 4, 5), 128),
    (SkinnyConfig(32, 64, 1, 4, 4), 16),
    (SkinnyConfig(32, 128, 1, 4, 4), 16),
    (SkinnyConfig(16, 128, 1, 4, 4), 16),
    (SkinnyConfig(64, 64, 1, 4, 4), 16),
]
L2_BYTES = 256 * 2**20  # copies per timed graph: at least this much weight (the H200's L2 is 50 MiB)
ATTENTION_CASES = ((1, 1), (1, 16), (8, 1), (8, 16), (32, 1), (32, 16))
ATTENTION_HEADS = {"llama-8b": (32, 8, 128), "embedded": (9, 3, 64)}
ATTENTION_BLOCK_M = (16, 32)


def graph_ms(fn, replays: int = 15) -> float:
    """Median ms of one replay of a CUDA graph of fn."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gemm_rows(shapes: dict[str, tuple[int, int]], m_values: list[int]) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (n, k) in shapes.items():
        copies = max(1, -(-L2_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(copies)]
        for m in m_values:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            base = invariant_gemm(x, ws[0], block_m=16, config=default_config(1, n, k))  # a decode's rows

            def per_call_us(call) -> float:
                return 1e3 * graph_ms(lambda: [call(w) for w in ws]) / copies

            chosen, chosen_bm = invariant_config(m, n, k)
            row = {"shape": name, "n": n, "k": k, "m": m, "copies": copies,
                   "invariant_config": {**asdict(chosen), "block_m": chosen_bm},
                   "cublas_us": per_call_us(lambda w: F.linear(x, w)),
                   "invariant_us": per_call_us(lambda w: invariant_gemm(x, w)), "candidates": []}
            for cfg, bm in CANDIDATES:
                entry = {"config": asdict(cfg), "block_m": bm}
                try:
                    entry["bitwise_equal"] = bool(torch.equal(invariant_gemm(x, ws[0], block_m=bm, config=cfg), base))
                    entry["us"] = per_call_us(lambda w, bm=bm, cfg=cfg: invariant_gemm(x, w, block_m=bm, config=cfg))
                except Exception as exc:  # out of shared memory etc.
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
                row["candidates"].append(entry)
            rows.append(row)
            best = min((c for c in row["candidates"] if c.get("bitwise_equal")), key=lambda c: c["us"], default=None)
            print(f"{name:>8} m={m:>5}: cublas {row['cublas_us']:8.1f} us, invariant {row['invariant_us']:8.1f}, "
                  f"best equal {best['us'] if best else float('nan'):8.1f} "
                  f"{best and (tuple(best['config'].values()), best['block_m'])}; "
                  f"unequal: {sum(1 for c in row['candidates'] if c.get('bitwise_equal') is False)}", flush=True)
        del ws
    return rows


def load_old_attention(path: str | None):
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("old_slot_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.slot_attention_invariant


def attention_inputs(b: int, q: int, heads: int, kv_heads: int, dim: int, cache_len: int, context: int,
                     layers: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, tuple]:
    """`layers` K/V cache copies, the queries of b requests of q tokens each at `context`, and the slot
    metadata (slots, q starts, q lengths, kv lengths)."""
    caches = [(torch.randn(b, cache_len, kv_heads, dim, device="cuda", dtype=torch.bfloat16),
               torch.randn(b, cache_len, kv_heads, dim, device="cuda", dtype=torch.bfloat16)) for _ in range(layers)]
    qt = torch.randn(b * q, heads, dim, device="cuda", dtype=torch.bfloat16)
    i32 = dict(dtype=torch.int32, device="cuda")
    meta = (torch.arange(b, **i32), torch.arange(0, b * q, q, **i32), torch.full((b,), q, **i32),
            torch.full((b,), context + q, **i32))
    return caches, qt, meta


def attention_rows(old_invariant, context: int = 512, layers: int = 8) -> list[dict]:
    """One layer's attention over `layers` KV copies (a verify graph reads each layer's cache once)."""
    out = []
    for heads_name, (heads, kv_heads, dim) in ATTENTION_HEADS.items():
        for cache_len in (1024, 8192):
            for b, q in ATTENTION_CASES:
                if heads_name == "embedded" and b > 1:
                    continue
                caches, qt, meta = attention_inputs(b, q, heads, kv_heads, dim, cache_len, context, layers)
                pos = (context + torch.arange(q, device="cuda")).repeat(b)
                splits = kv_splits(torch.device("cuda"), b, kv_heads)

                def per_layer_us(attend) -> float:
                    return 1e3 * graph_ms(lambda: [attend(kc, vc) for kc, vc in caches]) / layers

                def invariant(block_m: int, fn=slot_attention_invariant):
                    kwargs = {} if fn is not slot_attention_invariant else {"block_m": block_m}
                    return lambda kc, vc: fn(qt, kc, vc, *meta, pos, scale=0.088, max_q_len=q, **kwargs)

                row = {"heads": heads_name, "cache_len": cache_len, "batch": b, "q": q, "context": context,
                       "fastest_us": per_layer_us(lambda kc, vc: slot_attention_triton(
                           qt, kc, vc, *meta, scale=0.088, max_q_len=q, num_kv_splits=splits))}
                base = invariant(16)(*caches[0])
                for bm in ATTENTION_BLOCK_M:
                    row[f"invariant_m{bm}_us"] = per_layer_us(invariant(bm))
                    row[f"invariant_m{bm}_equal"] = bool(torch.equal(invariant(bm)(*caches[0]), base))
                def one(kc, vc):
                    return slot_attention_invariant(qt, kc, vc, *meta, pos, scale=0.088, max_q_len=q, split_grid=False)

                row["invariant_one_program_us"] = per_layer_us(one)
                row["invariant_one_program_equal"] = bool(torch.equal(one(*caches[0]), base))
                if old_invariant is not None:
                    row["old_invariant_us"] = per_layer_us(invariant(16, old_invariant))
                    row["old_invariant_equal"] = bool(torch.equal(invariant(16, old_invariant)(*caches[0]), base))
                out.append(row)
                print("attention", {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
                del caches
    return out


# A 16-node tree of 3 branches (a top-3 tree's shape): node i > 0 hangs off node i - 3 (the root for 1..3).
TREE_PARENTS = [-1, 0, 0, 0, *range(1, 13)]


def tree_bits() -> list[int]:
    bits: list[int] = []
    for i, p in enumerate(TREE_PARENTS):
        bits.append((bits[p] if p >= 0 else 0) | (1 << i))
    return bits


def tree_attention_rows(context: int = 512, cache_len: int = 4096, layers: int = 8) -> list[dict]:
    """One layer's tree verify attention: the fast kernel, the invariant one with packed 16-row programs and
    with a program per token (the tail table made once, as a model pass does)."""
    out = []
    bits = tree_bits()
    q = len(bits)
    depth = [bin(b).count("1") - 1 for b in bits]
    for heads_name, (heads, kv_heads, dim) in ATTENTION_HEADS.items():
        for b in (1, 8, 32):
            caches, qt, meta = attention_inputs(b, q, heads, kv_heads, dim, cache_len, context, layers)
            mask = torch.tensor(bits, dtype=torch.int64, device="cuda").repeat(b)
            pos = torch.tensor([context + d for d in depth], dtype=torch.int64, device="cuda").repeat(b)
            table = tree_tail_rows(pos, mask)
            splits = kv_splits(torch.device("cuda"), b, kv_heads)

            def per_layer_us(attend) -> float:
                return 1e3 * graph_ms(lambda: [attend(kc, vc) for kc, vc in caches]) / layers

            def invariant(per_token: bool):
                return lambda kc, vc: slot_attention_invariant(qt, kc, vc, *meta, pos, scale=0.088, max_q_len=q,
                                                               tree_mask=mask, tail_rows=table, per_token=per_token)

            base = invariant(False)(*caches[0])
            row = {"heads": heads_name, "batch": b, "tree_nodes": q, "context": context, "cache_len": cache_len,
                   "fastest_us": per_layer_us(lambda kc, vc: slot_attention_triton(
                       qt, kc, vc, *meta, scale=0.088, max_q_len=q, tree_mask=mask, num_kv_splits=splits)),
                   "packed_us": per_layer_us(invariant(False)), "per_token_us": per_layer_us(invariant(True)),
                   "per_token_equal": bool(torch.equal(invariant(True)(*caches[0]), base))}
            out.append(row)
            print("tree attention", {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()},
                  flush=True)
            del caches
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--old-attention", default=None)
    ap.add_argument("--skip-gemm", action="store_true")
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--tree-only", action="store_true", help="of the attention, only the tree verify rows")
    ap.add_argument("--m", type=int, nargs="+", default=list(M_VALUES), help="GEMM rows to sweep")
    ap.add_argument("--model", default="llama-8b", choices=sorted(MODEL_SHAPES), help="whose weight shapes")
    args = ap.parse_args()
    attention = [] if args.skip_attention or args.tree_only else attention_rows(load_old_attention(args.old_attention))
    tree = [] if args.skip_attention else tree_attention_rows()
    rows = [] if args.skip_gemm else gemm_rows(MODEL_SHAPES[args.model], args.m)
    write_json(out_dir(args.out) / "gpu_gemm_configs.json", {"device": torch.cuda.get_device_name(), "rows": rows,
                                                         "attention": attention, "tree_attention": tree})


if __name__ == "__main__":
    main()
