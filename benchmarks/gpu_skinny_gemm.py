"""Skinny GEMM vs cuBLAS on Llama-3.1-8B projection shapes (run on a GPU; imports only torch, triton, the kernel).

Runs correctness checks (odd shapes, bias, split-K determinism, CUDA-graph replay), then for each (shape, M)
times cuBLAS and every candidate config with ``tune`` (CUDA-graph replays over rotated weight copies, medians).
Prints the device copy bandwidth first and a summary table last; the full tables go to ``skinny_gemm.json``
under ``--out`` (default ``$OUT``, else the working directory).

    python benchmarks/gpu_skinny_gemm.py [--m 1 8 16 32] [--shapes qkv o] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specpilot.kernels.skinny_gemm import (  # noqa: E402
    SkinnyConfig,
    default_config,
    skinny_gemm,
    skinny_gemm_reference,
    tune,
)

# Llama-3.1-8B: name -> (N, K) of w
SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
DTYPE = torch.bfloat16


def copy_bandwidth_tbps(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy of a large buffer, counting bytes read plus written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / ms / 1e9


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    return err if math.isfinite(err) else math.inf


def correctness_checks() -> dict[str, float | bool]:
    """Odd shapes with bias and split-K against the reference, bitwise determinism, and CUDA-graph replay."""
    g = torch.Generator(device="cuda").manual_seed(1)
    results: dict[str, float | bool] = {}
    for m, n, k, split in ((1, 1000, 1000, 1), (5, 1000, 1000, 3), (37, 333, 4099, 4), (64, 6144, 4096, 2)):
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
            w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / math.sqrt(k)
            b = torch.randn(n, device="cuda", dtype=dtype, generator=g)
            cfg = SkinnyConfig(64, 256, split, 4, 4)
            got = skinny_gemm(x, w, b, config=cfg)
            results[f"m{m}-n{n}-k{k}-split{split}-{dtype}"] = rel_err(got, skinny_gemm_reference(x, w, b))
            results[f"m{m}-n{n}-k{k}-split{split}-{dtype}-deterministic"] = bool(
                torch.equal(got, skinny_gemm(x, w, b, config=cfg))
            )

    # Capture once, change x in place, replay: the graph must compute on the new values.
    x = torch.randn(8, 4096, device="cuda", dtype=DTYPE, generator=g)
    w = torch.randn(4096, 4096, device="cuda", dtype=DTYPE, generator=g) / 64
    cfg = SkinnyConfig(64, 256, 4, 4, 4)
    skinny_gemm(x, w, config=cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_gemm(x, w, config=cfg)
    x.copy_(torch.randn(x.shape, device="cuda", dtype=DTYPE, generator=g))
    graph.replay()
    results["cuda-graph-replay"] = rel_err(y, skinny_gemm_reference(x, w))
    return results


def best_triton(table: dict) -> dict | None:
    ok = [c for c in table["configs"] if c.get("ok")]
    return min(ok, key=lambda c: c["us"]) if ok else None


def bench_shape(name: str, m: int, n: int, k: int) -> dict:
    w = torch.randn(n, k, device="cuda", dtype=DTYPE) / math.sqrt(k)
    _, table = tune(m, w)
    table["shape"] = name
    default = default_config(m, n, k)
    table["default_config"] = asdict(default)
    table["default_us"] = next((c.get("us") for c in table["configs"] if c["config"] == asdict(default)), None)
    return table


def summary(tables: list[dict], copy_tbps: float) -> str:
    def fmt_cfg(c: dict) -> str:
        return f"{c['block_n']}x{c['block_k']} s{c['split_k']} w{c['num_warps']} st{c['num_stages']}"

    lines = [
        f"device copy {copy_tbps:.2f} TB/s (read+write)",
        f"{'shape':8} {'N':>6} {'K':>6} {'M':>3} | {'cuBLAS us':>9} {'TB/s':>5} | {'Triton us':>9} {'TB/s':>5} "
        f"{'x':>5} | {'default us':>10} | best config",
    ]
    for t in tables:
        top, cub = best_triton(t), t["cublas"]
        tri = f"{top['us']:9.1f} {top['tbps']:5.2f} {cub['us'] / top['us']:5.2f}" if top else f"{'-':>9} {'':5} {'':5}"
        default = f"{t['default_us']:10.1f}" if t["default_us"] else f"{'-':>10}"
        cfg = fmt_cfg(top["config"]) if top else "-"
        lines.append(
            f"{t['shape']:8} {t['n']:6} {t['k']:6} {t['m']:3} | {cub['us']:9.1f} {cub['tbps']:5.2f} | {tri} "
            f"| {default} | {cfg}{'' if t['best'] else ' (cuBLAS wins)'}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")

    copy_tbps = copy_bandwidth_tbps()
    print(f"{torch.cuda.get_device_name()}: device copy {copy_tbps:.2f} TB/s (read+write)", flush=True)
    checks = correctness_checks()
    print(json.dumps(checks, indent=1), flush=True)
    bad = [k for k, v in checks.items() if v is False or (not isinstance(v, bool) and v > 1e-2)]

    tables = []
    for name in args.shapes:
        n, k = SHAPES[name]
        for m in args.m:
            tables.append(bench_shape(name, m, n, k))
            t = tables[-1]
            print(f"{name} M={m}: cuBLAS {t['cublas']['us']:.1f} us, best {t['best']}", flush=True)
    bad += [f"{t['shape']} M={t['m']} {c['config']}" for t in tables for c in t["configs"] if c.get("ok") is False]

    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_tbps": copy_tbps,
        "checks": checks,
        "failed_checks": bad,
        "results": tables,
    }
    (args.out / "skinny_gemm.json").write_text(json.dumps(report, indent=1))
    print(summary(tables, copy_tbps))
    print(f"FAILED checks: {bad}" if bad else "all correctness checks passed")


if __name__ == "__main__":
    main()
