"""What the B12 kernel compiles to for Hopper, without a GPU: its launch config for each shape (as b12_gemm picks
it), then the PTX's static instruction counts (per thread: the K loop's body once, the pipeline's prologue and
epilogue around it) — global, async and shared-memory traffic, the decode's integer work, the MMAs — and, where
the triton install ships nvdisasm, the SASS of the K loop's body alone (what ptxas made of it: the instructions a
thread issues per 256-column block, by opcode). Integer arguments and pointers carry the 16-divisibility the JIT
specializes them with at these shapes (else loads compile byte by byte). Compare two versions of the kernel by
running it in each checkout; pass PYTHONPATH to another triton (the device's) to see its codegen.

    python benchmarks/b12_codegen.py [--shapes qkv down gate_up] [--m 1 16] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402
from gpu_b12_gemm import SHAPES  # noqa: E402

from specpilot.kernels import b12_gemm as b12  # noqa: E402
from specpilot.kernels.skinny_gemm import block_m_for, invariant_config  # noqa: E402

H200_SMS = 132
SIGNATURE = {"x_ptr": "*bf16", "sm_ptr": "*u8", "code_ptr": "*u8", "base_ptr": "*u8", "alt_ptr": "*u8",
             "exc_off_ptr": "*i32", "exc_ptr": "*i32", "bias_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32",
             "K": "i32", "stride_xm": "i32", "stride_code": "i32", "stride_om": "i32", "num_blocks": "i32",
             "tail_half": "i32"}
# per thread, in the PTX: what each pattern counts
COUNTS = {"global loads": r"\bld\.global", "async copies (16 B)": r"\bcp\.async\.cg", "shared loads": r"\bld\.shared",
          "shared stores": r"\bst\.shared", "barriers": r"\bbar\.sync", "prmt": r"\bprmt\.", "lop3": r"\blop3\.",
          "integer add": r"\badd\.[su]32", "shifts": r"\bsh[lr]\.b32", "wgmma": r"\bwgmma\.mma_async",
          "all instructions": r"^\s+[a-z][a-z0-9_.]*\s"}


NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def loop_sass(cubin: bytes) -> dict[str, int] | None:
    """Opcode counts of the kernel's longest loop body in SASS (from a label to the backward branch that returns
    to it), or None without nvdisasm."""
    if not NVDISASM.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        lines = subprocess.run([str(NVDISASM), "-c", f.name], capture_output=True, text=True, check=True).stdout.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i]
    if not loops:
        return None
    start, end = max(loops, key=lambda span: span[1] - span[0])
    ops = collections.Counter(m.group(1) for line in lines[start:end + 1] if (m := SASS_LINE.match(line)))
    return dict(ops.most_common()) | {"all": sum(ops.values())}


def compile_for(m: int, n: int, k: int) -> tuple[dict, str, bytes]:
    config, chosen = invariant_config(m, n, k)
    block_m = chosen or block_m_for(m)
    full, half = b12.halves(k)
    blocks = full + (half > 0)
    values = {"M": m, "N": n, "K": k, "stride_xm": k, "stride_code": -(-k // 2), "stride_om": n, "num_blocks": blocks,
              "tail_half": half}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(SIGNATURE)
             if SIGNATURE[name].startswith("*") or (values.get(name, 1) % 16 == 0)}
    consts = dict(BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                  BLOCKS_P2=triton.next_power_of_2(blocks), TAIL=half > 0, PATCHES=0, PACKED=True, HAS_BIAS=False)
    src = triton.compiler.ASTSource(fn=b12._b12_gemm_kernel, signature={**SIGNATURE, **dict.fromkeys(consts, "constexpr")},
                                    constexprs=consts, attrs=attrs)
    launch = {"block_m": block_m, "block_n": config.block_n, "block_k": config.block_k,
              "num_warps": b12.b12_warps(config), "num_stages": b12.b12_stages(config, block_m),
              "programs": -(-n // config.block_n) * -(-m // block_m), "blocks": blocks}
    # what bounds a program that issues its own decode: the weights each of its threads decodes, and how many
    # warps an SM of the H200 (132) holds to hide each one's latency
    launch["weights_per_thread"] = config.block_n * k // (launch["num_warps"] * 32)
    launch["warps_per_sm"] = round(launch["programs"] * launch["num_warps"] / H200_SMS, 2)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]})
    return launch, compiled.asm["ptx"], compiled.asm["cubin"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["qkv", "down", "gate_up"], choices=list(SHAPES))
    ap.add_argument("--m", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        for m in args.m:
            launch, ptx, cubin = compile_for(m, n, k)
            counts = {label: len(re.findall(pattern, ptx, flags=re.M)) for label, pattern in COUNTS.items()}
            sass = loop_sass(cubin)
            rows.append({"shape": name, "m": m, "launch": launch, "ptx_counts": counts, "k_loop_sass": sass})
            print(f"{name:8s} M={m:<3d} {launch}\n    " + ", ".join(f"{k} {v}" for k, v in counts.items()))
            if sass is not None:
                print("    K loop SASS: " + ", ".join(f"{k} {v}" for k, v in sass.items()))
    write_json(out_dir(args.out) / "b12_codegen.json", {"triton": triton.__version__, "rows": rows})


if __name__ == "__main__":
    main()
