"""The one seam every projection goes through.

All weight matmuls of the target (and drafters) are `Linear` modules, so a faster kernel or a
different weight format (B12) changes this module, not model code.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.kernels.skinny_gemm import HAS_TRITON, invariant_gemm, skinny_gemm

# Up to this many rows (decode, small verify) a Triton GEMM that streams W at near copy bandwidth
# beats cuBLAS on the H200 (docs/RESULTS.md); above it the pass is compute-bound and cuBLAS wins.
SKINNY_MAX_M = 32


class Linear(nn.Module):
    """y = x @ W^T (+ b), with W stored [out_features, in_features] as in HF checkpoints.

    `batch_invariant` (CUDA): every M runs one Triton tiling and K order per weight shape, so a row's result
    never depends on the rows beside it (set_batch_invariant); otherwise the fastest kernel per M."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.batch_invariant = False
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2 and HAS_TRITON:
            if self.batch_invariant:
                return invariant_gemm(x, self.weight, self.bias)
            if x.shape[0] <= SKINNY_MAX_M and x.dtype != torch.float32:
                return skinny_gemm(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def use_cpu_layout(module: nn.Module) -> None:
    """Store every Linear's weight input-major (W^T contiguous, the same values and shape): CPU BLAS
    multiplies the few rows of a decode or verify pass against that layout faster than against HF's
    [out, in] rows (docs/RESULTS.md). A weight tied to other parameters (an
    embedding to the LM head) is replaced everywhere it appears."""
    relaid: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(old) -> (old, new); old kept alive
    for _, linear in iter_linears(module):
        w = linear.weight
        if w.device.type == "cpu" and w.dim() == 2 and w.stride() == (w.shape[1], 1) and id(w) not in relaid:
            relaid[id(w)] = (w, nn.Parameter(w.detach().t().contiguous().t(), requires_grad=False))
    for name, param in list(module.named_parameters(remove_duplicate=False)):
        if id(param) in relaid:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, attr, relaid[id(param)][1])


def set_batch_invariant(module: nn.Module, on: bool) -> None:
    """Route every Linear of `module` through the batch-invariant GEMM (on) or the fastest kernel per M."""
    for _, linear in iter_linears(module):
        linear.batch_invariant = on


def iter_linears(module: nn.Module) -> Iterator[tuple[str, Linear]]:
    for name, child in module.named_modules():
        if isinstance(child, Linear):
            yield name, child
