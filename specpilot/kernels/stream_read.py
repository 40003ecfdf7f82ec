"""The memory's read limit: a kernel that only streams a tensor in, as a matmul streams its weights, so a
weight-read floor can be set against what the device reads rather than what it copies.

A fixed grid of programs (a few per SM) walks the tensor in wide 16-byte-per-lane blocks, grid-strided, and
folds what it reads into an XOR of 32-bit words (nothing is written but one word per program: the reads cannot
be dropped, and XOR, unlike a float sum, gives the same word in any order). `stream_read_reference` is the same
checksum in torch. Both take a contiguous tensor whose byte size is a multiple of 4.
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_support import require_triton, tl, triton

__all__ = ["stream_read_reference", "stream_read_triton"]


def _words(x: torch.Tensor) -> torch.Tensor:
    if not x.is_contiguous() or (x.numel() * x.element_size()) % 4:
        raise ValueError(f"stream_read takes a contiguous tensor of whole 32-bit words, got {tuple(x.shape)} {x.dtype}")
    return x.view(-1).view(torch.int32)


def stream_read_reference(x: torch.Tensor) -> int:
    """The XOR of every 32-bit word of x."""
    w = _words(x)
    while w.numel() > 1:
        if w.numel() % 2:
            w = torch.cat([w, w.new_zeros(1)])
        w = w[0::2] ^ w[1::2]
    return int(w[0]) if w.numel() else 0


if triton is not None:

    @triton.jit
    def _stream_read_kernel(words_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid * BLOCK, n, programs * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc ^= tl.load(words_ptr + offs, mask=offs < n, other=0)
        tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))

    @triton.jit
    def _xor(a, b):
        return a ^ b


def stream_read_triton(x: torch.Tensor, programs: int | None = None, block: int = 4096) -> torch.Tensor:
    """Reads x once; returns each program's word on the device, without a sync (their XOR, by
    stream_read_reference, is the reference's checksum). `programs`: the grid (default: 4 per SM on CUDA)."""
    require_triton("stream_read_triton")
    w = _words(x)
    if programs is None:
        programs = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    out = torch.zeros(programs, dtype=torch.int32, device=x.device)
    if w.numel():
        _stream_read_kernel[(programs,)](w, out, w.numel(), BLOCK=block, num_warps=8)
    return out
