"""B12: bf16 matrices in 12 bits a weight, bit-exactly.

A bf16 value is sign (1 bit), exponent (8) and mantissa (7). A row's weights use few exponents, clustered, so
each weight keeps its sign and mantissa in a byte and its exponent as a 4-bit code; the few exponents the
code cannot name are named once per (row, block), and the rarer rest are listed raw:

* ``sm`` [N, K] uint8 — sign << 7 | mantissa, for every weight;
* ``code`` [N, ceil(K / 2)] uint8 — two 4-bit codes a byte. K is cut into blocks of 256 (the last one may be
  shorter, its length r rounded up to even); byte j of a block holds element j's code in its low nibble and
  element j + 128's (j + r / 2's) in its high one, so a kernel decodes both halves of a block from the same
  lanes. Codes 0..14: exponent ``base[row] + code``; 15: the exponent ``alt[block, row]``;
* ``base`` [N] uint8 — each row's window, the 15 exponents base .. base + 14 that hold the most of its
  weights (exponent 0, i.e. ±0 and subnormals, is an exponent like the others); base <= 240, so base + code
  never carries out of a byte;
* ``alt`` [blocks, N] uint8 — per block and row, the most common exponent outside the row's window there
  (block-major: a kernel's tile of rows reads its alts as one run);
* hard escapes — weights whose exponent is neither in their row's window nor their block's alt (a second
  outlier exponent in one row's block, inf and NaN among others) — keep their raw bits in ``exc`` [E] int32,
  ``bits << 16 | row % 256 << 8 | column % 256``, grouped by segment (16 rows x one block) and row-major
  inside one. Segments are numbered (row // 256, block, row % 256 // 16), so a kernel's tile of rows (a
  divisor of 256) finds a block's escapes as one run; ``exc_off`` [segments + 1] int32 holds each segment's
  first index, and ``max_block_escapes``, the most in one block of 256 rows, bounds how many a tile may meet.

Size: 12 bits a weight, plus a byte a row, a byte a row's block, 32 bits a segment and 32 bits a hard escape.
A format version in checkpoints (``FORMAT_VERSION``) names this layout. `encode` checks its own round trip.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from specpilot.kernels.b12_gemm import BLOCK, ESCAPE, GROUP, SEGMENT_ROWS, as_int16, b12_decode_reference, halves

FORMAT_VERSION = 2  # checkpoints of another layout are refused, never misread
WINDOW = 15  # exponents a row's codes 0..14 cover
MAX_BASE = 256 - 16  # base + 15 (any code) stays within a byte
MAX_BLOCK_ESCAPES = 256  # hard escapes in one block of GROUP rows: beyond, too spread for B12 to pay off
PLANES = ("sm", "code", "base", "alt", "exc_off", "exc")


class B12Error(ValueError):
    """A tensor B12 cannot hold losslessly (named in the message)."""


class TooManyEscapes(B12Error):
    """A tensor of weights too spread for B12's exponent windows (converters keep it bf16)."""


@dataclass(frozen=True)
class B12Tensor:
    shape: tuple[int, int]  # the bf16 matrix's [N, K]
    sm: torch.Tensor
    code: torch.Tensor
    base: torch.Tensor
    alt: torch.Tensor
    exc_off: torch.Tensor
    exc: torch.Tensor
    max_block_escapes: int  # the most hard escapes in one block of GROUP rows (what a kernel's tile may patch)

    def planes(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in PLANES)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> B12Tensor:
        """The same matrix with `fn` applied to every plane (a move to another device)."""
        return replace(self, **{name: fn(getattr(self, name)) for name in PLANES})

    @property
    def num_escapes(self) -> int:
        return int(self.exc.numel())

    @property
    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.planes())

    def stats(self) -> dict[str, float | int]:
        """Bits a weight (everything stored, over the N x K weights) and the share of weights listed raw."""
        n, k = self.shape
        return {"weights": n * k, "bits_per_weight": 8 * self.stored_bytes / (n * k),
                "escapes": self.num_escapes, "escape_rate": self.num_escapes / (n * k)}

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The planes as named tensors (a safetensors file's), `prefix` + '.b12_' + plane."""
        planes = {name: getattr(self, name) for name in PLANES}
        planes["shape"] = torch.tensor(self.shape, dtype=torch.int64)
        return {f"{prefix}.b12_{name}": t.contiguous() for name, t in planes.items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> B12Tensor:
        def plane(name: str) -> torch.Tensor:
            key = f"{prefix}.b12_{name}"
            if key not in tensors:
                raise B12Error(f"{prefix}: B12 plane {key!r} is missing")
            return tensors[key]

        n, k = (int(v) for v in plane("shape").tolist())
        planes = {name: plane(name) for name in PLANES}
        return cls((n, k), **planes, max_block_escapes=_most(planes["exc_off"].diff()))


def _most(segment_counts: torch.Tensor) -> int:
    """The most hard escapes in one block of GROUP rows, from the escapes per segment."""
    per_block = segment_counts.view(-1, GROUP // SEGMENT_ROWS).sum(1)
    return int(per_block.max()) if per_block.numel() else 0


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The 16 bits of each bf16 value as int32 in [0, 65536)."""
    return t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def as_bf16(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` as bf16 where that is exact (a bf16 tensor, or one whose every value bf16 holds; NaN stays NaN),
    else a B12Error naming the tensor."""
    if t.dtype == torch.bfloat16:
        return t
    if not t.dtype.is_floating_point:
        raise B12Error(f"{name}: {t.dtype} is not a floating point tensor")
    converted = t.to(torch.bfloat16)
    back, nan = converted.to(t.dtype), torch.isnan(t)
    if not (torch.equal(torch.isnan(back), nan) and torch.equal(back[~nan], t[~nan])):
        raise B12Error(f"{name}: {t.dtype} values bf16 cannot hold exactly; B12 stores bf16 tensors only")
    return converted


def _row_bases(exponent: torch.Tensor) -> torch.Tensor:
    """Per row, the base <= MAX_BASE whose window base .. base + WINDOW - 1 holds the most of its weights
    (ties: the lowest), int32."""
    n = exponent.shape[0]
    hist = torch.zeros(n, 256, dtype=torch.int64, device=exponent.device)
    hist.scatter_add_(1, exponent.long(), torch.ones_like(exponent, dtype=torch.int64))
    csum = torch.nn.functional.pad(hist.cumsum(1), (1, 0))  # csum[:, e] = weights with exponent < e
    starts = torch.arange(0, MAX_BASE + 1, device=exponent.device)
    covered = csum[:, starts + WINDOW] - csum[:, starts]
    return starts[covered.argmax(1)].to(torch.int32)


def _block_alts(exponent: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, n: int, blocks: int) -> torch.Tensor:
    """Per (row, block), the most common of the exponents at (rows, cols) - the weights outside their rows'
    windows, few - (ties: the lowest; 0 where there are none), int32 [N, blocks]."""
    pairs, counts = torch.unique((rows * blocks + cols // BLOCK) * 256 + exponent, return_counts=True)
    score = counts * 256 + 255 - pairs % 256  # the larger count, then the lower exponent
    best = torch.zeros(n * blocks, dtype=torch.int64, device=rows.device)
    best.scatter_reduce_(0, pairs // 256, score, reduce="amax")
    return torch.where(best > 0, 255 - best % 256, 0).view(n, blocks).to(torch.int32)


def encode(t: torch.Tensor, name: str = "tensor") -> B12Tensor:
    """B12 of a 2-D tensor bf16 holds exactly (any bit pattern: ±0, subnormals, inf, NaN). Raises B12Error,
    naming `name`, for other shapes and dtypes, or (TooManyEscapes) when a block of GROUP rows would list more
    than MAX_BLOCK_ESCAPES hard escapes."""
    if t.dim() != 2:
        raise B12Error(f"{name}: B12 stores matrices, got shape {tuple(t.shape)}")
    t = as_bf16(name, t)
    n, k = t.shape
    bits = _bits(t)
    exponent = (bits >> 7) & 0xFF
    sm = ((bits >> 8) & 0x80) | (bits & 0x7F)
    base = _row_bases(exponent)
    offset = exponent - base[:, None]
    inside = (offset >= 0) & (offset < WINDOW)
    blocks, groups = -(-k // BLOCK), -(-n // GROUP)
    rows, cols = (~inside).nonzero(as_tuple=True)  # row-major
    outside = exponent[rows, cols]
    alt = _block_alts(outside, rows, cols, n, blocks)
    hard = outside != alt[rows, cols // BLOCK]
    rows, cols = rows[hard], cols[hard]
    per_group = GROUP // SEGMENT_ROWS
    segment = ((rows // GROUP) * blocks + cols // BLOCK) * per_group + rows % GROUP // SEGMENT_ROWS
    order = torch.argsort(segment, stable=True)  # by segment, row-major inside one
    rows, cols, segment = rows[order], cols[order], segment[order]
    counts = torch.bincount(segment, minlength=groups * blocks * per_group)
    most = _most(counts)
    if most > MAX_BLOCK_ESCAPES:
        raise TooManyEscapes(f"{name}: {most} weights of one {GROUP} x {BLOCK} block fall outside their rows' "
                             f"exponent windows and blocks' second exponents (B12 lists at most "
                             f"{MAX_BLOCK_ESCAPES}); keep it bf16")
    entries = (bits[rows, cols].long() << 16) | ((rows % GROUP) << 8) | (cols % BLOCK)
    code = torch.where(inside, offset, ESCAPE)
    out = B12Tensor(
        (n, k), sm.to(torch.uint8), _pack(code).to(torch.uint8), base.to(torch.uint8),
        alt.t().contiguous().to(torch.uint8), torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32),
        torch.where(entries >= 1 << 31, entries - (1 << 32), entries).to(torch.int32), most)
    if not torch.equal(_bits(decode(out)), bits):
        raise AssertionError(f"{name}: B12 round trip is not exact")  # a codec bug, never the data
    return out


def _pack(code: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (int32, 0..15) as nibble pairs [N, ceil(K / 2)], each block's halves in one byte."""
    n, k = code.shape
    full, half = halves(k)
    c = code[:, : full * BLOCK].reshape(n, full, 2, BLOCK // 2)
    parts = [(c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, full * BLOCK // 2)]
    if half:
        tail = torch.nn.functional.pad(code[:, full * BLOCK :], (0, 2 * half - k % BLOCK)).view(n, 2, half)
        parts.append(tail[:, 0] | (tail[:, 1] << 4))
    return torch.cat(parts, dim=1)


def decode(b: B12Tensor) -> torch.Tensor:
    """The bf16 [N, K] matrix, bit for bit (kernels/b12_gemm.py's plain-torch reference)."""
    return b12_decode_reference(b)
