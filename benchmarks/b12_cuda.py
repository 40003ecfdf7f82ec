"""The CUDA C++ B12 decode GEMM of benchmarks/b12_gemv.cu (an issue-21 experiment; gpu_b12_gemm.py --cuda-stages times
it beside the Triton kernels): its planes in MMA-fragment order, a plain-torch decode of that order (the reference a
CPU checks the layout with), and the kernel built through torch's extension loader on a CUDA machine.

Two forms (the .cu file's header has each lane's bytes): 16 rows of W a warp as the MMA's A operand, 64-column
chunks; or 8 rows as its B operand, 128-column chunks. Either way a lane reads 32 sign/mantissa and 16 code bytes
a chunk, the bytes of its own fragment elements; the base and alt exponents and the hard escapes stay as
formats/b12.py keeps them.

    python benchmarks/b12_cuda.py          (CPU: the layout against formats.b12's decode; with nvcc, the kernel
                                            compiled for sm_90)
"""

from __future__ import annotations

import collections
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specpilot.formats.b12 import B12Tensor, encode  # noqa: E402
from specpilot.kernels.b12_gemm import (  # noqa: E402
    BLOCK,
    ESCAPE,
    _unpack,
    as_int16,
    b12_decode_reference,
    hard_escapes,
)

SOURCE = Path(__file__).with_name("b12_gemv.cu")
FORMS = {16: 64, 8: 128}  # W rows a warp -> columns a chunk: 16 (W as the MMA's A operand) or 8 (as its B operand)


@cache
def _layout(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a form: per lane and sign/mantissa byte i (32 a chunk), its row in the tile and column in the chunk,
    and per code byte (16) and nibble, the sign/mantissa byte whose code it holds ([16, 2])."""
    lane = torch.arange(32).view(32, 1)
    g, q, i = lane // 4, lane % 4, torch.arange(32).view(1, 32)
    if rows == 16:  # i = 8s + 4j + 2h + e: row g + 8h, column 16s + 8j + 2q + e; code byte 4s + b, nibble j
        s, j, h, e = i // 8, i // 4 % 2, i // 2 % 2, i % 2
        row, col = g + 8 * h, 16 * s + 8 * j + 2 * q + e
        byte, nibble = torch.arange(16).view(16, 1), torch.arange(2).view(1, 2)
        code_of = 8 * (byte // 4) + 4 * nibble + byte % 4
    else:  # i = 4s + 2j + e: row g, column 16s + 8j + 2q + e; code byte 4p + b, nibble n: step 2p + n
        s, j, e = i // 4, i // 2 % 2, i % 2
        row, col = g.expand(32, 32), 16 * s + 8 * j + 2 * q + e
        byte, nibble = torch.arange(16).view(16, 1), torch.arange(2).view(1, 2)
        code_of = 4 * (2 * (byte // 4) + nibble) + byte % 4
    return row, col, code_of


def fragments(w: B12Tensor, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The sign/mantissa and code planes of `w` in the fragment order of a form (`rows` of W a warp): uint8
    [N / rows, K / chunk, 32, 32] and [N / rows, K / chunk, 32, 16]. Needs N and K to be multiples of the form's
    tile (16 x 64 or 8 x 128)."""
    n, k = w.shape
    chunk = FORMS[rows]
    if n % rows or k % chunk:
        raise ValueError(f"the CUDA B12 kernel's {rows}-row form takes N % {rows} == 0 and K % {chunk} == 0, "
                         f"got [{n}, {k}]")
    row, col = (t.to(w.sm.device) for t in _layout(rows)[:2])
    code_of = _layout(rows)[2].to(w.sm.device)
    rows_at = torch.arange(n // rows, device=w.sm.device).view(-1, 1, 1, 1) * rows + row  # [T, 1, 32, 32]
    cols_at = torch.arange(k // chunk, device=w.sm.device).view(1, -1, 1, 1) * chunk + col  # [1, C, 32, 32]
    sm = w.sm[rows_at, cols_at]
    codes = _unpack(w.code, k).to(torch.uint8)[rows_at, cols_at]  # a lane's codes in its sm bytes' order
    code = codes[..., code_of[:, 0]] | (codes[..., code_of[:, 1]] << 4)
    return sm.contiguous(), code.contiguous()


def fragment_decode_reference(sm_frag: torch.Tensor, code_frag: torch.Tensor, w: B12Tensor,
                              rows: int = 16) -> torch.Tensor:
    """The bf16 [N, K] matrix as the kernel decodes it from a form's fragment-order planes (plain torch): each
    lane's weights from its bytes — the code from its byte's nibble, exponent base + code or the block's alt for
    code 15 — placed at their rows and columns, then the hard escapes' raw bits at theirs."""
    n, k = w.shape
    tiles, chunks = sm_frag.shape[:2]
    row, col, code_of = _layout(rows)
    nibbles = torch.stack([code_frag.to(torch.int32) & 15, code_frag.to(torch.int32) >> 4], dim=-1)  # [T, C, 32, 16, 2]
    code = torch.zeros(sm_frag.shape, dtype=torch.int32)
    code[..., code_of.flatten()] = nibbles.flatten(-2)
    rows_at = (torch.arange(tiles).view(-1, 1, 1, 1) * rows + row).expand(sm_frag.shape)
    cols_at = (torch.arange(chunks).view(1, -1, 1, 1) * FORMS[rows] + col).expand(sm_frag.shape)
    sm = sm_frag.to(torch.int32)
    exponent = torch.where(code == ESCAPE, w.alt.to(torch.int32)[cols_at // BLOCK, rows_at],
                           w.base.to(torch.int32)[rows_at] + code)
    out = torch.zeros(n, k, dtype=torch.int32)
    out[rows_at.flatten(), cols_at.flatten()] = (((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)).flatten()
    rows_e, cols_e, raw = hard_escapes(w)
    out[rows_e, cols_e] = raw
    return as_int16(out).view(torch.bfloat16)


_WRAPPER = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

torch::Tensor b12_gemv(torch::Tensor x, torch::Tensor sm_frag, torch::Tensor code_frag, torch::Tensor base,
                       torch::Tensor alt, torch::Tensor exc_off, torch::Tensor exc, c10::optional<torch::Tensor> bias,
                       int64_t n, int64_t stages, int64_t rows, bool pipelined) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1, "x: bf16 CUDA, unit stride");
  auto out = torch::empty({x.size(0), n}, x.options());
  const void* bias_ptr = bias.has_value() ? bias->data_ptr() : nullptr;
  cudaError_t err = b12_gemv_launch(x.data_ptr(), sm_frag.data_ptr(), code_frag.data_ptr(), base.data_ptr(),
                                    alt.data_ptr(), exc_off.data_ptr(), exc.numel() ? exc.data_ptr() : exc_off.data_ptr(),
                                    bias_ptr, out.data_ptr(), x.size(0), n, x.size(1), x.stride(0), out.stride(0),
                                    stages, rows, pipelined, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "b12_gemv: ", cudaGetErrorString(err));
  return out;
}
"""


def outlier_matrix(n: int, k: int, count: int, specials: list[float], seed: int, device: str = "cpu") -> torch.Tensor:
    """bf16 Gaussian weights (scale 0.02) with `count` far exponents scattered in (alts and hard escapes), the first
    of them replaced by `specials`, repeated: what exercises every path of the decode."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, device=device, generator=g) * 0.02
    idx = torch.randint(0, n * k, (count,), device=device, generator=g)
    w.view(-1)[idx] = torch.randn(count, device=device, generator=g) * 1e4
    if specials:
        values = torch.tensor(specials, device=device).repeat(count // (2 * len(specials)))
        w.view(-1)[idx[: values.numel()]] = values
    return w.to(torch.bfloat16)


@cache
def load():
    """The kernel as a torch op: b12_gemv(x, sm_frag, code_frag, base, alt, exc_off, exc, bias, n, stages, rows,
    pipelined)
    (CUDA; built with this machine's nvcc for sm_90 on first use)."""
    from torch.utils.cpp_extension import load_inline

    module = load_inline(name="specpilot_b12_gemv", cpp_sources=["torch::Tensor b12_gemv(torch::Tensor x, "
                         "torch::Tensor sm_frag, torch::Tensor code_frag, torch::Tensor base, torch::Tensor alt, "
                         "torch::Tensor exc_off, torch::Tensor exc, c10::optional<torch::Tensor> bias, int64_t n, "
                         "int64_t stages, int64_t rows, bool pipelined);"],
                         cuda_sources=[SOURCE.read_text() + _WRAPPER], functions=["b12_gemv"],
                         extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"])
    return module.b12_gemv


def gemm(x: torch.Tensor, frags: tuple[torch.Tensor, torch.Tensor, B12Tensor], stages: int = 8, rows: int = 16,
         bias: torch.Tensor | None = None, pipelined: bool = False) -> torch.Tensor:
    """x @ decode(w).T (+ bias) through the CUDA kernel: `frags` = (sm_frag, code_frag, w) in the form of `rows`;
    `pipelined` (8-row form): each chunk decoded among the previous chunk's MMAs."""
    sm_frag, code_frag, w = frags
    return load()(x, sm_frag, code_frag, w.base, w.alt, w.exc_off, w.exc, bias, w.shape[0], stages, rows, pipelined)


def compile_cubin(out: Path) -> str:
    """nvcc's -Xptxas -v report of the kernel built for sm_90 into `out` (a CPU machine with nvcc suffices)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on PATH")
    run = subprocess.run([nvcc, "-gencode=arch=compute_90,code=sm_90", "-O3", "-cubin", "-Xptxas", "-v", "-o", str(out),
                          str(SOURCE)], capture_output=True, text=True, check=True)
    return run.stderr


_TRITON = importlib.util.find_spec("triton")  # its wheel ships cuobjdump
CUOBJDUMP = Path(_TRITON.submodule_search_locations[0]) / "backends" / "nvidia" / "bin" / "cuobjdump" if _TRITON else None
_SASS = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def k_loop_opcodes(cubin: Path) -> dict[str, dict[str, float]]:
    """Per kernel instantiation (form, x tiles, stages, pipelined or not): the SASS opcodes of the K loop's body as a
    chunk without hard escapes runs it — the loop from its backward branch, less every escape loop that a forward
    branch skips (a forward branch whose span holds an inner loop's backward branch); the pipelined loop runs two
    chunks a trip, so its counts are halved."""
    listing = subprocess.run([str(CUOBJDUMP), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    counts = {}
    for function in listing.split("Function : ")[1:]:
        name = function.splitlines()[0]
        code = [(int(m.group(1), 16), m.group(2)) for line in function.splitlines() if (m := _SASS.match(line))]
        jumps = [(at, int(m.group(1), 16)) for at, text in code if (m := re.search(r"BRA (0x[0-9a-f]+)", text))]
        end, start = max(((at, to) for at, to in jumps if to < at), key=lambda span: span[0] - span[1])
        inner = [at for at, to in jumps if start <= to < at < end]
        skips = [(at, to) for at, to in jumps if start <= at < to <= end and any(at < b < to for b in inner)]
        body = [text for at, text in code if start <= at <= end and not any(a < at < t for a, t in skips)]
        ops = collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", t).group(1) for t in body)
        if "rows8" in name:
            stages, hi, pipelined = re.search(r"kernelILi(\d+)ELb([01])ELb([01])E", name).groups()
            form = "8 rows, pipelined" if pipelined == "1" else "8 rows"
            label = f"{form}, STAGES={stages}, M {'> 8' if hi == '1' else '<= 8'}"
        else:
            tiles, stages = re.search(r"kernelILi(\d+)ELi(\d+)E", name).groups()
            label = f"16 rows, M {'> 8' if tiles == '2' else '<= 8'}, STAGES={stages}"
        per_trip = 2 if "pipelined" in label else 1
        counts[label] = {op: n / per_trip for op, n in ops.most_common()} | {"all": len(body) / per_trip}
    return counts


def main() -> None:
    for n, k, outliers in ((32, 128, 0), (48, 576, 40), (64, 1024, 200)):
        planes = encode(outlier_matrix(n, k, outliers, [float("inf"), float("nan"), -0.0, 1e-40], seed=n + k))
        for rows, chunk in FORMS.items():
            if n % rows or k % chunk:
                continue
            sm_frag, code_frag = fragments(planes, rows)
            same = torch.equal(fragment_decode_reference(sm_frag, code_frag, planes, rows).view(torch.int16),
                               b12_decode_reference(planes).view(torch.int16))
            print(f"[{n}, {k}], {planes.num_escapes} hard escapes, {rows}-row form: fragment decode bitwise the B12 "
                  f"decode: {same}")
            if not same:
                raise SystemExit(1)
    if shutil.which("nvcc"):
        with tempfile.TemporaryDirectory() as tmp:
            report = compile_cubin(Path(tmp) / "b12_gemv.cubin")
            loops = k_loop_opcodes(Path(tmp) / "b12_gemv.cubin") if CUOBJDUMP and CUOBJDUMP.exists() else {}
        print("nvcc, sm_90:", " | ".join(line.strip() for line in report.splitlines() if "registers" in line))
        for name, ops in loops.items():  # a chunk: 1,024 weights of W (16 x 64 or 8 x 128), 32 a lane
            print(f"K loop, a chunk ({name}): {ops['all']:g} instructions a lane, {ops['all'] / 32:.2f} a weight; "
                  + ", ".join(f"{op} {n:g}" for op, n in ops.items() if op != "all"))


if __name__ == "__main__":
    main()
