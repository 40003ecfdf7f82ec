"""The one seam every projection goes through.

All weight matmuls of the target (and drafters) are `Linear` modules, so a faster kernel or a
different weight format (B12) changes this module, not model code.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.formats.b12 import B12Tensor, TooManyEscapes, decode, encode
from specpilot.kernels.b12_gemm import b12_gemm
from specpilot.kernels.gemm_tiles import TileTable, Tiles
from specpilot.kernels.skinny_gemm import HAS_TRITON, invariant_gemm, skinny_gemm, variant_rows

# Up to this many rows (decode, small verify) a Triton GEMM that streams W at near copy bandwidth
# beats cuBLAS on the H200 (docs/RESULTS.md); above it the pass is compute-bound and cuBLAS wins.
SKINNY_MAX_M = 32


class Linear(nn.Module):
    """y = x @ W^T (+ b), with W stored [out_features, in_features] as in HF checkpoints.

    `batch_invariant` (CUDA): every M runs one Triton tiling and K order per weight shape, so a row's result
    never depends on the rows beside it (set_batch_invariant); otherwise the fastest kernel per M.

    `to_b12` swaps the weight for its B12 planes (kernels/b12_gemm.py reads them on CUDA; elsewhere they are
    decoded for each product): the same bits, so the same outputs as the bf16 weight on the invariant path.

    `tiles`: this device's tuned tiles (kernels/gemm_tiles.py) for both invariant kernels; a tile never changes
    a row's bits, only the time."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.batch_invariant = False
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.b12: B12Tensor | None = None
        self.tiles: TileTable | None = None

    def tuned(self, kernel: str, m: int) -> Tiles | tuple[None, None]:
        """The tiles `tiles` gives a product of m rows on `kernel` ("bf16" or "b12"); (None, None): the untuned
        ones."""
        picked = None if self.tiles is None else self.tiles.pick(kernel, self.out_features, self.in_features, m)
        return picked or (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.b12 is not None:
            return self._b12_forward(x)
        if x.is_cuda and x.dim() == 2 and HAS_TRITON:
            if self.batch_invariant:
                config, block_m = self.tuned("bf16", x.shape[0])
                return invariant_gemm(x, self.weight, self.bias, config=config, block_m=block_m)
            if x.shape[0] <= SKINNY_MAX_M and x.dtype != torch.float32:
                return skinny_gemm(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def _b12_forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.b12
        if x.is_cuda and HAS_TRITON and x.dtype == torch.bfloat16:
            # invariant_gemm's tiles at every M: bitwise the bf16 weight's invariant path
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            config, block_m = self.tuned("b12", flat.shape[0])
            y = b12_gemm(flat, p, self.bias, config=config, block_m=block_m)
            return y.reshape(*x.shape[:-1], self.out_features)
        w = self.dense_weight()
        if w.device.type == "cpu":
            w = w.t().contiguous().t()  # use_cpu_layout's: the bf16 module's products, bit for bit
        return F.linear(x, w, self.bias)

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight as a bf16 (or the loaded dtype's) tensor, decoded where B12 holds it."""
        return self.weight if self.weight is not None else decode(self.b12)

    def to_b12(self, keep_dense: bool = False) -> bool:
        """Multiply by B12 planes of the weight from now on and drop the bf16 tensor, or keep it for
        `keep_dense` (another module shares it: a tied embedding). False, unchanged, for a weight that is not
        bf16 or is too spread for B12's exponent windows."""
        if self.b12 is not None:
            return True
        if self.weight.dtype != torch.bfloat16:
            return False
        try:
            planes = encode(self.weight.detach().contiguous())
        except TooManyEscapes:
            return False
        self.b12 = planes
        if not keep_dense:
            del self.weight
            self.weight = None
        return True

    def _apply(self, fn, recurse: bool = True):  # .to() / .cuda() move the planes with the module
        if self.b12 is not None:
            self.b12 = self.b12.map(fn)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        fmt = ", b12" if self.b12 is not None else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{fmt}"


def use_cpu_layout(module: nn.Module) -> None:
    """Store every Linear's weight input-major (W^T contiguous, the same values and shape): CPU BLAS
    multiplies the few rows of a decode or verify pass against that layout faster than against HF's
    [out, in] rows (docs/RESULTS.md). A weight tied to other parameters (an
    embedding to the LM head) is replaced everywhere it appears."""
    relaid: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(old) -> (old, new); old kept alive
    for _, linear in iter_linears(module):
        w = linear.weight
        if w is not None and w.device.type == "cpu" and w.dim() == 2 and w.stride() == (w.shape[1], 1) and id(w) not in relaid:
            relaid[id(w)] = (w, nn.Parameter(w.detach().t().contiguous().t(), requires_grad=False))
    for name, param in list(module.named_parameters(remove_duplicate=False)):
        if id(param) in relaid:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, attr, relaid[id(param)][1])


def to_b12(module: nn.Module) -> dict[str, int]:
    """Every bf16 Linear of `module` as B12 (Linear.to_b12): how many were converted and kept, and the bytes
    the weights took before and take now."""
    before = weight_bytes(module)
    uses: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    done = [linear.to_b12(keep_dense=linear.weight is not None and uses.get(id(linear.weight), 0) > 1)
            for _, linear in iter_linears(module)]
    return {"converted": sum(done), "kept_bf16": len(done) - sum(done), "bytes_before": before,
            "bytes_after": weight_bytes(module)}


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the module's distinct parameters, buffers and B12 planes."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        seen[id(t)] = t.numel() * t.element_size()
    for _, linear in iter_linears(module):
        if linear.b12 is not None:
            seen[id(linear.b12)] = linear.b12.stored_bytes
    return sum(seen.values())


def set_tile_table(module: nn.Module, table: TileTable | None) -> None:
    """Every Linear of `module` launches the invariant kernels on `table`'s tuned tiles (None: the untuned ones);
    `module.tile_table` says which (engines sharing one model compare it)."""
    for _, linear in iter_linears(module):
        linear.tiles = table
    module.tile_table = table


def set_batch_invariant(module: nn.Module, on: bool) -> None:
    """Route every Linear of `module` through the batch-invariant GEMM (on) or the fastest kernel per M."""
    for _, linear in iter_linears(module):
        linear.batch_invariant = on


def iter_linears(module: nn.Module) -> Iterator[tuple[str, Linear]]:
    for name, child in module.named_modules():
        if isinstance(child, Linear):
            yield name, child


@torch.inference_mode()
def warm_linears(modules: Iterable[nn.Module], max_rows: int) -> int:
    """Launch, once per weight shape, every Triton GEMM variant that products of 1..max_rows rows would (CUDA; B12
    matrices and cuBLAS's sizes aside): without CUDA graphs each is otherwise compiled by the first pass that
    meets it, inside a step. Returns the launches made."""
    done, launches = set(), 0
    for module in modules:
        for _, linear in iter_linears(module):
            w = linear.weight
            if linear.b12 is not None or not (w.is_cuda and HAS_TRITON) or \
                    (not linear.batch_invariant and w.dtype == torch.float32):
                continue
            shape = (*w.shape, w.dtype, linear.bias is None, linear.batch_invariant, id(linear.tiles))
            if shape in done:
                continue
            done.add(shape)
            limit = max_rows if linear.batch_invariant else min(max_rows, SKINNY_MAX_M)
            tuned = linear.tiles.chooser("bf16", *w.shape) if linear.tiles and linear.batch_invariant else None
            for m in variant_rows(w.shape[0], w.shape[1], limit, linear.batch_invariant, choose=tuned):
                linear(w.new_zeros(m, w.shape[1]))
                launches += 1
    return launches
