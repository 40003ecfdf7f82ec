"""H200: which tile configs of the invariant GEMM give bitwise the rows of the decode config (the one a
decode pass uses), and how fast each is against cuBLAS, on Llama-3.1-8B's weight shapes at verify and
prefill sizes. Each row of the result is tested against the decode config's for the same x.

    python benchmarks/gpu_gemm_configs.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402

from specpilot.kernels.skinny_gemm import SkinnyConfig, default_config, invariant_gemm  # noqa: E402
from specpilot.kernels.slot_attention import kv_splits, slot_attention_invariant, slot_attention_triton  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
M_VALUES = (16, 128, 512, 8192)
# (config, rows of x per program)
CANDIDATES = [
    (SkinnyConfig(64, 128, 1, 4, 4), 64),
    (SkinnyConfig(128, 64, 1, 4, 4), 64),
    (SkinnyConfig(128, 64, 1, 4, 4), 128),
    (SkinnyConfig(128, 64, 1, 8, 4), 128),
    (SkinnyConfig(128, 128, 1, 8, 3), 128),
    (SkinnyConfig(128, 64, 1, 8, 3), 256),
    (SkinnyConfig(256, 64, 1, 8, 3), 128),
    (SkinnyConfig(64, 64, 1, 4, 4), 128),
]


def attention_rows(context: int = 512) -> list[dict]:
    """One layer's attention at Llama-3.1-8B heads: today's kernel (batch-sized splits) vs the invariant one."""
    out = []
    for b, q in ((1, 1), (1, 16), (8, 16), (32, 1), (32, 16)):
        kc = torch.randn(b, context + 64, 8, 128, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        qt = torch.randn(b * q, 32, 128, device="cuda", dtype=torch.bfloat16)
        i32 = dict(dtype=torch.int32, device="cuda")
        meta = (torch.arange(b, **i32), torch.arange(0, b * q, q, **i32), torch.full((b,), q, **i32),
                torch.full((b,), context + q, **i32))
        pos = (context + torch.arange(q, device="cuda")).repeat(b)
        splits = kv_splits(torch.device("cuda"), b, 8)
        old = do_bench(lambda: slot_attention_triton(qt, kc, vc, *meta, scale=0.088, max_q_len=q,
                                                     num_kv_splits=splits), return_mode="median")
        new = do_bench(lambda: slot_attention_invariant(qt, kc, vc, *meta, pos, scale=0.088, max_q_len=q),
                       return_mode="median")
        out.append({"batch": b, "q": q, "context": context, "fastest_us": 1e3 * old, "invariant_us": 1e3 * new})
        print(f"attention B={b:>2} q={q:>2}: fastest {1e3 * old:7.1f} us, invariant {1e3 * new:7.1f} us", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    attention = attention_rows()
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
        for m in M_VALUES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            base = invariant_gemm(x, w, block_m=16)  # the decode config's rows
            row = {"shape": name, "n": n, "k": k, "m": m, "default": asdict(default_config(m, n, k)),
                   "cublas_us": 1e3 * do_bench(lambda: torch.nn.functional.linear(x, w), return_mode="median"),
                   "default_us": 1e3 * do_bench(lambda: invariant_gemm(x, w), return_mode="median"),
                   "candidates": []}
            for cfg, bm in CANDIDATES:
                entry = {"config": asdict(cfg), "block_m": bm}
                try:
                    y = invariant_gemm(x, w, block_m=bm, config=cfg)
                    entry["bitwise_equal"] = bool(torch.equal(y, base))
                    entry["us"] = 1e3 * do_bench(lambda: invariant_gemm(x, w, block_m=bm, config=cfg),
                                                 return_mode="median")
                except Exception as exc:  # out of shared memory etc.
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
                row["candidates"].append(entry)
            rows.append(row)
            best = min((c for c in row["candidates"] if c.get("bitwise_equal")), key=lambda c: c["us"], default=None)
            print(f"{name:>8} m={m:>5}: cublas {row['cublas_us']:9.1f} us, default {row['default_us']:9.1f}, "
                  f"best equal {best['us'] if best else float('nan'):9.1f} {best and (best['config'], best['block_m'])}; "
                  f"unequal: {sum(1 for c in row['candidates'] if c.get('bitwise_equal') is False)}", flush=True)
    write_json(out_dir(args.out) / "gpu_gemm_configs.json", {"device": torch.cuda.get_device_name(), "rows": rows,
                                                         "attention": attention})


if __name__ == "__main__":
    main()
