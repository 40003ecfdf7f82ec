"""B12 GEMM against our bf16 kernel and cuBLAS on Llama-3.1-8B's weight shapes (run on a GPU).

For each shape and M: cuBLAS (``F.linear``), our batch-invariant bf16 kernel (``invariant_gemm``, the decode
path's) and ``b12_gemm`` on the B12 planes of the same weights in a few launch variants (the default; eight
warps; the plain-integer decode the interpreter tests, instead of the packed PTX one; with ``--tiles``, both
kernels on other decode tiles, e.g. ``32x4``: 32-row tiles of 4 warps; with ``--cuda-stages``, the CUDA C++ kernel
of benchmarks/b12_gemv.cu on fragment-order planes at M <= 16, that many chunks in flight, in both forms and the
8-row form software-pipelined), each timed by CUDA-graph
replay over rotated weight copies (more than twice the L2, so no call finds its weight cached), in
interleaved rounds; median and spread per cell, the share of the read bandwidth (kernels/stream_read.py's
probe over 4 GiB) each reaches, the probe itself over the weight's own bytes timed the same way on several grids
("read@size", the fastest: what a read of that size takes, launch and ramp included) and the bf16 kernel's share
of that, and whether each
variant's output is bitwise the bf16 kernel's (its default tiles: what the engine runs). A variant that fails
to compile or launch is reported and left out. Weights: Gaussian rows of varied scale (the real checkpoints'
shape of distribution; benchmarks/b12_stats.py has their escape rates).

    python benchmarks/gpu_b12_gemm.py [--m 1 16 64] [--shapes qkv o gate_up down lm_head] [--rounds 3]
        [--tiles 32x4 16x2] [--cuda-stages 8 16] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
import b12_cuda  # noqa: E402
from common import out_dir, read_bandwidth, write_json  # noqa: E402
from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.formats.b12 import encode  # noqa: E402
from specpilot.kernels.b12_gemm import b12_gemm  # noqa: E402
from specpilot.kernels.skinny_gemm import SkinnyConfig, invariant_gemm, rotated_copies  # noqa: E402
from specpilot.kernels.stream_read import stream_read_triton  # noqa: E402
from specpilot.progress import bar  # noqa: E402

SHAPES: dict[str, tuple[int, int]] = {  # name -> (N, K) of w
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096),
}
B12_VARIANTS: dict[str, dict] = {"b12": {}, "b12_w8": {"num_warps": 8}, "b12_plain": {"packed": False}}


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    scale = torch.exp(0.3 * torch.randn(n, 1, device="cuda", generator=g)) * 0.02
    return (torch.randn(n, k, device="cuda", generator=g) * scale).to(torch.bfloat16)


def time_us(fn, operands: list, x: torch.Tensor | None) -> float:
    """Median µs per call over a CUDA graph of back-to-back calls, each on the next copy's operands."""
    cycle = itertools.cycle(operands)
    return do_bench_cudagraph(lambda: fn(x, next(cycle)), rep=20, return_mode="median") * 1e3


def tile_variants(tiles: list[str]) -> tuple[dict[str, dict], dict[str, dict]]:
    """(bf16, B12) variants on the decode tiles named "ROWSxWARPS" (the default tiles' K and pipeline depth)."""
    bf16, b12 = {}, {}
    for spec in tiles:
        rows, warps = map(int, spec.split("x"))
        config = SkinnyConfig(block_n=rows, block_k=128, split_k=1, num_warps=warps, num_stages=8)
        bf16[f"bf16_{spec}"] = {"config": config}
        b12[f"b12_{spec}"] = {"config": config}
    return bf16, b12


def cuda_variants(stages: list[int]) -> dict[str, tuple[int, int, bool]]:
    """The CUDA kernel's variants: each form (W rows a warp) at each depth of its copy ring, and the 8-row form
    software-pipelined ("8p": a chunk decoded among the previous chunk's MMAs)."""
    forms = [(rows, False) for rows in b12_cuda.FORMS] + [(8, True)]
    return {f"b12_cuda{rows}{'p' if pipelined else ''}_s{s}": (rows, s, pipelined)
            for rows, pipelined in forms for s in stages}


def cuda_gemm(x: torch.Tensor, frags: tuple, stages: int, rows: int, pipelined: bool) -> torch.Tensor:
    if x.shape[0] > 16:
        raise ValueError("the CUDA kernel takes M <= 16")
    return b12_cuda.gemm(x, frags, stages, rows, pipelined=pipelined)


def kernels(w: torch.Tensor, planes, dense: list[torch.Tensor], tiles: list[str], stages: list[int]
            ) -> tuple[dict, dict]:
    """Every kernel variant of a weight: variant -> (its function of x and an operand, the operand of each weight copy
    in `dense`), and the variants to check against the bf16 kernel: variant -> (function, one operand)."""
    packed = [planes] + [planes.map(torch.clone) for _ in dense[1:]]
    bf16_tiles, b12_tiles = tile_variants(tiles)
    fns = {"cublas": (lambda x, w_: F.linear(x, w_), dense), "bf16": (lambda x, w_: invariant_gemm(x, w_), dense)}
    checked = {}  # variant -> (its function on one operand, the operand), each checked against the bf16 kernel
    for variant, kwargs in bf16_tiles.items():
        fns[variant] = (lambda x, w_, kw=kwargs: invariant_gemm(x, w_, **kw), dense)
        checked[variant] = (fns[variant][0], w)
    for variant, kwargs in {**B12_VARIANTS, **b12_tiles}.items():
        fns[variant] = (lambda x, p, kw=kwargs: b12_gemm(x, p, **kw), packed)
        checked[variant] = (fns[variant][0], planes)
    frag_copies = {}
    for variant, (rows, depth, pipelined) in cuda_variants(stages).items():
        if rows not in frag_copies:
            frags = (*b12_cuda.fragments(planes, rows), planes)
            frag_copies[rows] = [frags] + [(frags[0].clone(), frags[1].clone(), p) for p in packed[1:]]
        fns[variant] = (lambda x, f, st=depth, r=rows, pl=pipelined: cuda_gemm(x, f, st, r, pl), frag_copies[rows])
        checked[variant] = (fns[variant][0], frag_copies[rows][0])
    return fns, checked


def launch_once(name: str, n: int, k: int, ms: list[int], tiles: list[str], stages: list[int]) -> None:
    """Each kernel variant launched once per M on one weight, eagerly (after a warm-up launch that compiles it)."""
    w = weights(n, k, seed=n + k)
    fns, _ = kernels(w, encode(w, name), [w], tiles, stages)
    for m in ms:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        for variant, (fn, operands) in fns.items():
            if variant.startswith("b12_cuda") and m > 16:
                continue
            fn(x, operands[0])  # compiles
            torch.cuda.synchronize()
            fn(x, operands[0])
            torch.cuda.synchronize()
            print(f"{name} M={m}: {variant} launched", flush=True)


def read_at_size(dense: list[torch.Tensor], read_bps: float) -> dict:
    """The read limit at a weight's own size: the streaming probe over the same bytes (each call the next copy's),
    timed as the GEMMs are, on grids of 1-8 programs an SM and two block sizes; the fastest, with its grid (a read
    of a few tens of MB is short enough that launch, ramp and the last wave's balance weigh)."""
    sms = torch.cuda.get_device_properties(dense[0].device).multi_processor_count
    grids = [(k * sms, block) for k in (1, 2, 4, 8) for block in (1024, 4096)]
    times = {grid: time_us(lambda x, w_, g=grid: stream_read_triton(w_, *g), dense, None) for grid in grids}
    (programs, block), us = min(times.items(), key=lambda item: item[1])
    nbytes = dense[0].numel() * dense[0].element_size()
    return {"us": us, "programs": programs, "block": block, "read_share": nbytes / (us * 1e-6) / read_bps}


def run_shape(name: str, n: int, k: int, ms: list[int], rounds: int, read_bps: float, tiles: list[str],
              stages: list[int]) -> list[dict]:
    w = weights(n, k, seed=n + k)
    planes = encode(w, name)
    dense = rotated_copies(w)
    copies = len(dense)
    fns, checked = kernels(w, planes, dense, tiles, stages)
    read = read_at_size(dense, read_bps)
    stats = planes.stats()
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        expected = invariant_gemm(x, w).view(torch.int16)
        row = {"shape": name, "n": n, "k": k, "m": m, "weight_copies": copies,
               "bits_per_weight": stats["bits_per_weight"], "escape_rate": stats["escape_rate"],
               "max_block_escapes": planes.max_block_escapes}
        timed = ["cublas", "bf16"]
        for variant, (fn, operand) in checked.items():
            try:
                row[f"{variant}_bitwise_equal"] = torch.equal(fn(x, operand).view(torch.int16), expected)
                timed.append(variant)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot compile or launch is reported, not fatal
                row[variant] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        times: dict[str, list[float]] = {kern: [] for kern in timed}
        for _ in range(rounds):  # interleaved: each round times every kernel once
            for kern in timed:
                fn, ops = fns[kern]
                times[kern].append(time_us(fn, ops, x))
        for kern in timed:
            med = statistics.median(times[kern])
            nbytes = planes.stored_bytes if kern.startswith("b12") else n * k * 2
            row[kern] = {"us": med, "min_us": min(times[kern]), "max_us": max(times[kern]),
                         "read_share": nbytes / (med * 1e-6) / read_bps}
        row["read"] = read
        row["bf16_read_share_at_size"] = read["us"] / row["bf16"]["us"]
        for variant in checked:
            if "us" in row[variant]:
                row[f"{variant}_over_bf16"] = row[variant]["us"] / row["bf16"]["us"]
        rows.append(row)
    return rows


def check_cuda_escapes(stages: list[int]) -> None:
    """The CUDA kernel's variants against the bf16 kernel on a matrix dense with alts, hard escapes, -0, subnormals
    and large values (finite: an infinity or NaN would make its whole output row NaN and hide a misplaced escape),
    every M up to 16, with bias: each variant's verdict printed (the shapes' rows mark them too)."""
    n, k = 256, 1152  # 9 chunks of the 8-row form (an odd count: the pipelined loop's tail), a short last code block
    w = b12_cuda.outlier_matrix(n, k, 600, [-0.0, 1e-40, 1e30, -1e-38], seed=5, device="cuda")
    planes = encode(w)
    g = torch.Generator(device="cuda").manual_seed(6)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    forms = {rows: (*b12_cuda.fragments(planes, rows), planes) for rows in b12_cuda.FORMS}
    differ: dict[str, list[int]] = {variant: [] for variant in cuda_variants(stages)}
    for m in range(1, 17):
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        expected = invariant_gemm(x, w, bias).view(torch.int16)
        for variant, (rows, depth, pipelined) in cuda_variants(stages).items():
            if not torch.equal(b12_cuda.gemm(x, forms[rows], depth, rows, bias, pipelined).view(torch.int16),
                               expected):
                differ[variant].append(m)
    for variant, ms in differ.items():
        print(f"{variant}: {'bitwise the bf16 kernel' if not ms else f'DIFFERS from the bf16 kernel at M = {ms}'} "
              f"(M = 1..16, bias, {planes.num_escapes} hard escapes)")


def cell(row: dict, kern: str) -> str:
    entry = row[kern]
    if "us" not in entry:
        return "error"
    mark = "" if kern in ("read", "cublas", "bf16") else " =" if row[f"{kern}_bitwise_equal"] else " !"
    return f"{entry['us']:.1f}{mark}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiles", nargs="*", default=[], metavar="ROWSxWARPS",
                    help="other decode tiles to time both kernels on, e.g. 32x4 16x2")
    ap.add_argument("--cuda-stages", type=int, nargs="*", default=[], choices=[4, 8, 16],
                    help="also the CUDA C++ kernel (benchmarks/b12_gemv.cu) with these chunks in flight, at M <= 16")
    ap.add_argument("--launch-once", action="store_true",
                    help="launch every kernel once per shape and M, eagerly, and time nothing: a process for Nsight "
                         "Compute to profile (ncu --kernel-name regex:'b12|gemm' ...)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.launch_once:
        for name in args.shapes:
            launch_once(name, *SHAPES[name], args.m, args.tiles, args.cuda_stages)
        return
    if args.cuda_stages:
        check_cuda_escapes(args.cuda_stages)
    read_bps = read_bandwidth(torch.device("cuda"), gib=4.0)
    print(f"read bandwidth {read_bps / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})")
    rows: list[dict] = []
    for name in bar(args.shapes, "shapes"):
        rows += run_shape(name, *SHAPES[name], args.m, args.rounds, read_bps, args.tiles, args.cuda_stages)
        torch.cuda.empty_cache()
    bf16_tiles, b12_tiles = tile_variants(args.tiles)
    variants = [*B12_VARIANTS, *b12_tiles, *cuda_variants(args.cuda_stages), *bf16_tiles]
    for r in rows:
        for variant in variants:
            if "error" in r[variant]:
                print(f"{r['shape']} M={r['m']} {variant}: {r[variant]['error']}")
    print("µs, median of rounds; '=' output bitwise the bf16 kernel's (default tiles), '!' not; best: the fastest "
          "bitwise B12 variant")
    print(f"{'shape':>8} {'M':>3} {'cuBLAS':>7} {'bf16':>7} " + " ".join(f"{v:>10}" for v in variants)
          + f" {'read@size':>9} {'bf16 read':>9} {'@size':>6} {'b12 read':>8} {'best/bf16':>9} bits/w")
    for r in rows:
        best = min((r[v]["us"] for v in (*B12_VARIANTS, *b12_tiles, *cuda_variants(args.cuda_stages))
                    if "us" in r[v] and r[f"{v}_bitwise_equal"]),
                   default=math.nan)
        print(f"{r['shape']:>8} {r['m']:>3} {cell(r, 'cublas'):>7} {cell(r, 'bf16'):>7} "
              + " ".join(f"{cell(r, v):>10}" for v in variants)
              + f" {cell(r, 'read'):>9} {r['bf16']['read_share']:>9.1%} {r['bf16_read_share_at_size']:>6.1%}"
              f" {r['b12'].get('read_share', math.nan):>8.1%}"
              f" {best / r['bf16']['us']:>9.3f} {r['bits_per_weight']:.3f}")
    write_json(out_dir(args.out) / "b12_gemm.json", {"provenance": collect(torch.device("cuda"), "bfloat16"),
                                                     "read_bandwidth_bps": read_bps, "tiles": args.tiles,
                                                     "cuda_stages": args.cuda_stages,
                                                     "device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
