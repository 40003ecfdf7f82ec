"""The CUDA C++ B12 decode GEMM of benchmarks/b12_gemv.cu (an issue-21 experiment; gpu_b12_gemm.py --cuda times it
beside the Triton kernels): its planes in MMA-fragment order, a plain-torch decode of that order (the reference a
CPU checks the layout with), and the kernel built through torch's extension loader on a CUDA machine.

Fragment order (the .cu file's header has it per lane): for row tile t (16 rows), 64-column chunk c and lane
l = 4g + q, 32 sign/mantissa bytes — k16 step s, column half j, byte b = 2h + e: row 16t + g + 8h, column
64c + 16s + 8j + 2q + e — and 16 code bytes, byte 4s + b holding the codes of j = 0 (low nibble) and j = 1 (high).
The base and alt exponents and the hard escapes stay as formats/b12.py keeps them.

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
from specpilot.kernels.b12_gemm import BLOCK, ESCAPE, GROUP, SEGMENT_ROWS, _unpack, as_int16, b12_decode_reference  # noqa: E402

SOURCE = Path(__file__).with_name("b12_gemv.cu")
CHUNK = 64
# [tile, hi, g, chunk, s, j, q, e] -> [tile, chunk, g, q, s, j, hi, e]: a lane's bytes in step, half, row, column order
_TO_FRAGMENTS = (0, 3, 2, 6, 4, 5, 1, 7)

_WRAPPER = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

torch::Tensor b12_gemv(torch::Tensor x, torch::Tensor sm_frag, torch::Tensor code_frag, torch::Tensor base,
                       torch::Tensor alt, torch::Tensor exc_off, torch::Tensor exc, c10::optional<torch::Tensor> bias,
                       int64_t n, int64_t stages) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1, "x: bf16 CUDA, unit stride");
  auto out = torch::empty({x.size(0), n}, x.options());
  const void* bias_ptr = bias.has_value() ? bias->data_ptr() : nullptr;
  cudaError_t err = b12_gemv_launch(x.data_ptr(), sm_frag.data_ptr(), code_frag.data_ptr(), base.data_ptr(),
                                    alt.data_ptr(), exc_off.data_ptr(), exc.numel() ? exc.data_ptr() : exc_off.data_ptr(),
                                    bias_ptr, out.data_ptr(), x.size(0), n, x.size(1), x.stride(0), out.stride(0),
                                    stages, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "b12_gemv: ", cudaGetErrorString(err));
  return out;
}
"""


def fragments(w: B12Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sign/mantissa and code planes of `w` in fragment order: uint8 [N/16, K/64, 32, 32] and [N/16, K/64, 32,
    16]. Needs N % 16 == 0 and K % 64 == 0 (the kernel's tiles)."""
    n, k = w.shape
    if n % 16 or k % CHUNK:
        raise ValueError(f"the CUDA B12 kernel takes N % 16 == 0 and K % {CHUNK} == 0, got [{n}, {k}]")
    shape = (n // 16, 2, 8, k // CHUNK, 4, 2, 4, 2)
    sm = w.sm.view(shape).permute(_TO_FRAGMENTS).reshape(n // 16, k // CHUNK, 32, 4, 2, 4)
    codes = _unpack(w.code, k).to(torch.uint8).view(shape).permute(_TO_FRAGMENTS)
    codes = codes.reshape(n // 16, k // CHUNK, 32, 4, 2, 4)  # [..., s, j, b]
    code = codes[..., 0, :] | (codes[..., 1, :] << 4)  # [..., s, b]
    return sm.reshape(n // 16, k // CHUNK, 32, 32).contiguous(), code.reshape(n // 16, k // CHUNK, 32, 16).contiguous()


def fragment_decode_reference(sm_frag: torch.Tensor, code_frag: torch.Tensor, w: B12Tensor) -> torch.Tensor:
    """The bf16 [N, K] matrix as the kernel decodes it from the fragment-order planes (plain torch): each lane's
    weights from its bytes — the code from its byte's nibble, exponent base + code or the block's alt for code
    15 — placed at their rows and columns, then the hard escapes' raw bits at theirs."""
    n, k = w.shape
    tiles, chunks = sm_frag.shape[:2]
    lane = torch.arange(32)
    g, q = lane // 4, lane % 4
    s, j, h, e = (torch.arange(4).view(4, 1, 1, 1), torch.arange(2).view(1, 2, 1, 1), torch.arange(2).view(1, 1, 2, 1),
                  torch.arange(2).view(1, 1, 1, 2))
    # per (lane, s, j, h, e): the row within the tile and the column within the chunk
    rows = (g.view(32, 1, 1, 1, 1) + 8 * h).expand(32, 4, 2, 2, 2)
    cols = (16 * s + 8 * j + 2 * q.view(32, 1, 1, 1, 1) + e).expand(32, 4, 2, 2, 2)
    sm = sm_frag.view(tiles, chunks, 32, 4, 2, 2, 2).to(torch.int32)
    packed = code_frag.view(tiles, chunks, 32, 4, 1, 2, 2).to(torch.int32)
    code = torch.where(j.view(1, 1, 1, 1, 2, 1, 1) == 0, packed & 15, packed >> 4)  # [t, c, lane, s, j, h, e]
    tile_rows = torch.arange(tiles).view(tiles, 1, 1, 1, 1, 1, 1) * 16 + rows
    chunk_cols = torch.arange(chunks).view(1, chunks, 1, 1, 1, 1, 1) * CHUNK + cols
    base = w.base.to(torch.int32)[tile_rows]
    alt = w.alt.to(torch.int32)[chunk_cols // BLOCK, tile_rows]
    exponent = torch.where(code == ESCAPE, alt, base + code)
    bits = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)
    out = torch.zeros(n, k, dtype=torch.int32)
    out[tile_rows.expand_as(bits).flatten(), chunk_cols.expand_as(bits).flatten()] = bits.flatten()
    if w.exc.numel():  # escapes by segment: (group, block, 16-row segment), as the kernel finds them
        blocks = -(-k // BLOCK)
        segment = torch.repeat_interleave(torch.arange(w.exc_off.numel() - 1), w.exc_off.diff())
        group, block = segment // (GROUP // SEGMENT_ROWS) // blocks, segment // (GROUP // SEGMENT_ROWS) % blocks
        entry = w.exc.to(torch.int32)
        out[group * GROUP + ((entry >> 8) & 0xFF), block * BLOCK + (entry & 0xFF)] = (entry >> 16) & 0xFFFF
    return as_int16(out).view(torch.bfloat16)


@cache
def load():
    """The kernel as a torch op: b12_gemv(x, sm_frag, code_frag, base, alt, exc_off, exc, bias, n, stages) (CUDA;
    built with this machine's nvcc for sm_90 on first use)."""
    from torch.utils.cpp_extension import load_inline

    module = load_inline(name="specpilot_b12_gemv", cpp_sources=["torch::Tensor b12_gemv(torch::Tensor x, "
                         "torch::Tensor sm_frag, torch::Tensor code_frag, torch::Tensor base, torch::Tensor alt, "
                         "torch::Tensor exc_off, torch::Tensor exc, c10::optional<torch::Tensor> bias, int64_t n, "
                         "int64_t stages);"],
                         cuda_sources=[SOURCE.read_text() + _WRAPPER], functions=["b12_gemv"],
                         extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"])
    return module.b12_gemv


def gemm(x: torch.Tensor, frags: tuple[torch.Tensor, torch.Tensor, B12Tensor], stages: int = 8) -> torch.Tensor:
    """x @ decode(w).T through the CUDA kernel: `frags` = (sm_frag, code_frag, w)."""
    sm_frag, code_frag, w = frags
    return load()(x, sm_frag, code_frag, w.base, w.alt, w.exc_off, w.exc, None, w.shape[0], stages)


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


def k_loop_opcodes(cubin: Path) -> dict[str, dict[str, int]]:
    """Per kernel instantiation (NT, STAGES): the SASS opcodes of the K loop's body as a chunk without hard escapes
    runs it — the loop from its backward branch, less the escape loop that a forward branch skips."""
    listing = subprocess.run([str(CUOBJDUMP), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    counts = {}
    for function in listing.split("Function : ")[1:]:
        key = re.search(r"kernelILi(\d+)ELi(\d+)E", function.splitlines()[0])
        code = [(int(m.group(1), 16), m.group(2)) for line in function.splitlines() if (m := _SASS.match(line))]
        jumps = [(at, int(m.group(1), 16)) for at, text in code if (m := re.search(r"BRA (0x[0-9a-f]+)", text))]
        end, start = max(((at, to) for at, to in jumps if to < at), key=lambda span: span[0] - span[1])
        skip_from, skip_to = max(((at, to) for at, to in jumps if start <= at < to <= end),
                                 key=lambda span: span[1] - span[0])
        body = [text for at, text in code if start <= at <= end and not skip_from < at < skip_to]
        ops = collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", t).group(1) for t in body)
        counts[f"NT={key.group(1)}, STAGES={key.group(2)}"] = dict(ops.most_common()) | {"all": len(body)}
    return counts


def main() -> None:
    torch.manual_seed(0)
    for n, k, outliers in ((32, 128, 0), (48, 576, 40), (64, 1024, 200)):
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        if outliers:  # far exponents (alts and hard escapes), infinities, NaN, -0 and subnormals among them
            idx = torch.randint(0, n * k, (outliers,))
            w.view(-1)[idx] = (torch.randn(outliers) * 1e4).to(torch.bfloat16)
            specials = torch.tensor([float("inf"), float("nan"), -0.0, 1e-40]).repeat(outliers // 16)
            w.view(-1)[idx[: specials.numel()]] = specials.to(torch.bfloat16)
        planes = encode(w)
        sm_frag, code_frag = fragments(planes)
        same = torch.equal(fragment_decode_reference(sm_frag, code_frag, planes).view(torch.int16),
                           b12_decode_reference(planes).view(torch.int16))
        print(f"[{n}, {k}], {planes.num_escapes} hard escapes: fragment decode bitwise the B12 decode: {same}")
        if not same:
            raise SystemExit(1)
    if shutil.which("nvcc"):
        with tempfile.TemporaryDirectory() as tmp:
            report = compile_cubin(Path(tmp) / "b12_gemv.cubin")
            loops = k_loop_opcodes(Path(tmp) / "b12_gemv.cubin") if CUOBJDUMP and CUOBJDUMP.exists() else {}
        print("nvcc, sm_90:", " | ".join(line.strip() for line in report.splitlines() if "registers" in line))
        for name, ops in loops.items():  # a chunk: 64 columns of 16 rows, 32 weights a lane
            print(f"K loop, a chunk ({name}): {ops['all']} instructions a lane, {ops['all'] / 32:.2f} a weight; "
                  + ", ".join(f"{op} {n}" for op, n in ops.items() if op != "all"))


if __name__ == "__main__":
    main()
