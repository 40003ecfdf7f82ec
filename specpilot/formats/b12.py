"""B12: bf16 matrices in 12 bits a weight, bit-exactly.

A bf16 value is sign (1 bit), exponent (8) and mantissa (7). Weights use few exponents, clustered, so each
row keeps a base exponent and every weight a 4-bit code for its own:

* ``sm`` [N, K] uint8 — sign << 7 | mantissa, for every weight;
* ``code`` [N, ceil(K / 2)] uint8 — two 4-bit codes a byte. K is cut into blocks of 256 (the last one may be
  shorter, its length r rounded up to even); byte j of a block holds element j's code in its low nibble and
  element j + 128's (j + r / 2's) in its high one, so a kernel reads both halves of a block with the same
  lanes. Code 0: exponent field 0 (±0 and subnormals, exact); 1..14: ``base[row] + code``; 15: an escape;
* ``base`` [N] uint8 — each row's exponent window (the 14 exponents base + 1 .. base + 14 that hold most of
  its weights);
* escapes: a weight whose exponent is outside its row's window (the small-magnitude tail, inf, NaN) keeps
  its raw 16 bits in ``exc_val`` [E] int16, grouped by segment (16 rows x one block; segment s = row
  group x ceil(K / 256) + block) and row-major inside one. ``exc_off`` [segments + 1] int32 holds each segment's
  first index, and an escaped weight's ``sm`` byte is its slot in its segment (so a segment takes at most
  256 escapes; a tensor needing more is not encoded).

Size: 12 bits a weight, plus a byte a row, 32 bits a segment (0.008 a weight) and 16 bits an escape.
`encode` checks its own round trip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.kernels.b12_gemm import BLOCK, ESCAPE, GROUP, as_int16, b12_decode_reference, halves

WINDOW = 14  # exponents a row's codes 1..14 cover
MAX_ESCAPES_PER_SEGMENT = 256  # what an sm byte can index


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
    exc_off: torch.Tensor
    exc_val: torch.Tensor

    @property
    def num_escapes(self) -> int:
        return int(self.exc_val.numel())

    @property
    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.sm, self.code, self.base, self.exc_off, self.exc_val))

    def stats(self) -> dict[str, float | int]:
        """Bits a weight (everything stored, over the N x K weights) and the share of weights escaped."""
        n, k = self.shape
        return {"weights": n * k, "bits_per_weight": 8 * self.stored_bytes / (n * k),
                "escapes": self.num_escapes, "escape_rate": self.num_escapes / (n * k)}

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The planes as named tensors (a safetensors file's), `prefix` + '.b12_' + plane."""
        planes = {"sm": self.sm, "code": self.code, "base": self.base, "exc_off": self.exc_off,
                  "exc_val": self.exc_val, "shape": torch.tensor(self.shape, dtype=torch.int64)}
        return {f"{prefix}.b12_{name}": t.contiguous() for name, t in planes.items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> B12Tensor:
        def plane(name: str) -> torch.Tensor:
            key = f"{prefix}.b12_{name}"
            if key not in tensors:
                raise B12Error(f"{prefix}: B12 plane {key!r} is missing")
            return tensors[key]

        shape = tuple(int(v) for v in plane("shape").tolist())
        return cls((shape[0], shape[1]), plane("sm"), plane("code"), plane("base"), plane("exc_off"),
                   plane("exc_val"))


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
    """Per row, base such that exponents base + 1 .. base + WINDOW hold the most of its nonzero-exponent
    weights (ties: the lowest window)."""
    n = exponent.shape[0]
    hist = torch.zeros(n, 256, dtype=torch.int64, device=exponent.device)
    hist.scatter_add_(1, exponent.long(), torch.ones_like(exponent, dtype=torch.int64))
    hist[:, 0] = 0  # exponent field 0 has its own code
    csum = torch.nn.functional.pad(hist.cumsum(1), (1, 0))  # csum[:, e] = weights with exponent < e
    starts = torch.arange(1, 256 - WINDOW + 1, device=exponent.device)  # window [s, s + WINDOW)
    covered = csum[:, starts + WINDOW] - csum[:, starts]
    return (starts[covered.argmax(1)] - 1).to(torch.uint8)


def encode(t: torch.Tensor, name: str = "tensor") -> B12Tensor:
    """B12 of a 2-D tensor bf16 holds exactly (any bit pattern: ±0, subnormals, inf, NaN). Raises B12Error,
    naming `name`, for other shapes and dtypes, or when a segment would need more than 256 escapes."""
    if t.dim() != 2:
        raise B12Error(f"{name}: B12 stores matrices, got shape {tuple(t.shape)}")
    t = as_bf16(name, t)
    n, k = t.shape
    bits = _bits(t)
    exponent = (bits >> 7) & 0xFF
    sm = ((bits >> 8) & 0x80) | (bits & 0x7F)
    base = _row_bases(exponent)
    offset = exponent - base[:, None].to(torch.int32)
    code = torch.where(exponent == 0, 0, torch.where((offset >= 1) & (offset <= WINDOW), offset, ESCAPE))
    # escapes: slots within their (row group, block) segment, in row-major order inside it
    groups, blocks = -(-n // GROUP), -(-k // BLOCK)
    rows, cols = (code == ESCAPE).nonzero(as_tuple=True)
    segment = (rows // GROUP) * blocks + cols // BLOCK
    order = torch.argsort(segment * (GROUP * BLOCK) + (rows % GROUP) * BLOCK + cols % BLOCK)
    rows, cols, segment = rows[order], cols[order], segment[order]
    counts = torch.bincount(segment, minlength=groups * blocks)
    if counts.numel() and int(counts.max()) > MAX_ESCAPES_PER_SEGMENT:
        raise TooManyEscapes(f"{name}: {int(counts.max())} weights of one {GROUP} x {BLOCK} segment fall outside their "
                       f"rows' exponent windows (B12 holds {MAX_ESCAPES_PER_SEGMENT}); keep it bf16")
    exc_off = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    slots = torch.arange(rows.numel(), device=t.device) - exc_off[segment].long()
    sm[rows, cols] = slots.to(torch.int32)
    exc_val = as_int16(bits[rows, cols])
    out = B12Tensor((n, k), sm.to(torch.uint8), _pack(code).to(torch.uint8), base, exc_off, exc_val)
    if not torch.equal(_bits(decode(out)), _bits(t)):
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
    return b12_decode_reference(b.sm, b.code, b.base, b.exc_off, b.exc_val, b.shape[1])
