"""GEMM tiles tuned per weight shape: which tiles the batch-invariant GEMM (invariant_gemm) and the B12 GEMM
(b12_gemm) launch for a product of 1..512 rows (decode, then verify passes) on this device, where the untuned
choice (invariant_config) is slower.

A tile never changes a row's bits — both kernels feed one fp32 accumulator the same MMA k-steps in K order
whatever the tile (skinny_gemm's docstring; docs/RESULTS.md: 16- to 256-row tiles, 1 to 8 warps, bitwise equal
on the H100 and H200) — so a table may pick tiles per shape and row count without touching exactness. The
tuner still checks each candidate's output bitwise against the untuned tiles' on the device and drops any that
differ. Split-K is not a candidate: it changes the K order, which must be one per shape for every M.

A table is plain data (JSON on disk); engine/gemm_tiles.py tunes one on the device and keeps it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specpilot.kernels.skinny_gemm import MAX_M, SkinnyConfig, invariant_config

__all__ = ["BUCKETS", "CANDIDATES", "DECODE_BUCKETS", "KERNELS", "VERIFY_BUCKETS", "VERIFY_CANDIDATES", "TileTable",
           "Tiles", "bucket", "candidates_for", "pick_fastest"]

Tiles = tuple[SkinnyConfig, int | None]  # w's tiles and x's rows per program (None: block_m_for(M), the decode form)
KERNELS = ("bf16", "b12")
DECODE_BUCKETS = (1, 4, 16, MAX_M)
# A verify pass's rows (a batch's blocks or ragged rows): the row counts where invariant_config changes tiles, and
# 512 (a B=32 verify of 16 tokens)
VERIFY_BUCKETS = (128, 256, 384, 512)
BUCKETS = DECODE_BUCKETS + VERIFY_BUCKETS  # row counts tuned; a product of M rows takes the smallest bucket >= M
# Decode: tiles of 128 K columns and 8 stages (capped to shared memory by each kernel): rows of w x warps
CANDIDATES: tuple[Tiles, ...] = tuple(
    (SkinnyConfig(block_n=rows, block_k=128, split_k=1, num_warps=warps, num_stages=8), None)
    for rows, warps in ((16, 1), (16, 2), (32, 2), (32, 4), (64, 4), (64, 8), (128, 4), (128, 8)))
# Verify: (rows of w, K columns, warps, stages) x rows of x a program — invariant_config's own and their neighbours
VERIFY_CANDIDATES: tuple[Tiles, ...] = tuple(
    (SkinnyConfig(block_n=n, block_k=k, split_k=1, num_warps=warps, num_stages=stages), block_m)
    for (n, k, warps, stages), block_m in (
        ((64, 128, 4, 4), 64), ((128, 64, 4, 4), 64), ((128, 128, 4, 3), 64), ((128, 64, 8, 4), 64),
        ((256, 64, 8, 3), 64), ((128, 128, 8, 4), 64), ((64, 128, 8, 4), 64), ((64, 256, 4, 3), 64),
        ((128, 64, 4, 4), 128), ((128, 64, 8, 4), 128), ((128, 128, 8, 3), 128), ((256, 64, 8, 3), 128),
        ((256, 64, 8, 4), 128), ((256, 128, 8, 2), 128), ((64, 64, 4, 4), 128), ((64, 128, 4, 5), 128),
        ((128, 64, 8, 3), 256), ((128, 64, 8, 4), 256)))
MIN_GAIN = 0.03  # a candidate replaces the untuned tiles only when faster by more than this share (timing noise)


def bucket(m: int) -> int | None:
    """The tuned row count a product of `m` rows takes; None past the verify sizes (invariant_config's tiles)."""
    return next((b for b in BUCKETS if m <= b), None)


def candidates_for(rows: int) -> tuple[Tiles, ...]:
    """The tiles tried at a bucket: the decode ones up to MAX_M rows, then the verify ones."""
    return CANDIDATES if rows <= MAX_M else VERIFY_CANDIDATES


@dataclass
class TileTable:
    """Tiles by (kernel, N, K, bucket) for one device; absent entries keep invariant_config's."""

    device: str
    entries: dict[tuple[str, int, int, int], Tiles] = field(default_factory=dict)
    timings: dict[tuple[str, int, int, int], dict[str, float]] = field(default_factory=dict)  # µs: tuned, untuned

    def pick(self, kernel: str, n: int, k: int, m: int) -> Tiles | None:
        rows = bucket(m)
        return None if rows is None else self.entries.get((kernel, n, k, rows))

    def chooser(self, kernel: str, n: int, k: int) -> Callable[[int], Tiles]:
        """m -> (tiles, x rows per program) as the kernel will launch them for a product of m rows."""
        def choose(m: int) -> Tiles:
            return self.pick(kernel, n, k, m) or invariant_config(m, n, k)
        return choose

    def to_json(self) -> str:
        rows = [{"kernel": kern, "n": n, "k": k, "m": m, "config": asdict(cfg), "block_m": block_m,
                 **self.timings.get((kern, n, k, m), {})}
                for (kern, n, k, m), (cfg, block_m) in sorted(self.entries.items())]
        return json.dumps({"device": self.device, "entries": rows}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> TileTable:
        raw = json.loads(text)
        table = cls(raw["device"])
        for row in raw["entries"]:
            key = (row["kernel"], row["n"], row["k"], row["m"])
            if row["kernel"] not in KERNELS or row["m"] not in BUCKETS:
                raise ValueError(f"a tile table entry for {key}: kernel must be one of {KERNELS}, m one of {BUCKETS}")
            table.entries[key] = SkinnyConfig(**row["config"]), row.get("block_m")
            table.timings[key] = {name: row[name] for name in ("us", "untuned_us") if name in row}
        return table

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: Path) -> TileTable:
        return cls.from_json(path.read_text())


def pick_fastest(untuned: Tiles, candidates: Iterable[Tiles], time_us: Callable[[Tiles], float],
                 same_bits: Callable[[Tiles], bool]) -> tuple[Tiles | None, dict[str, float]]:
    """The fastest candidate whose output is bitwise the untuned tiles', if it beats them by more than MIN_GAIN
    (else None), and the two times."""
    base = time_us(untuned)
    best, best_us = None, base * (1 - MIN_GAIN)
    for tiles in candidates:
        if tiles == untuned or not same_bits(tiles):
            continue
        try:
            us = time_us(tiles)
        except Exception:  # noqa: BLE001 - a tile that does not compile or launch here is no candidate
            continue
        if us < best_us:
            best, best_us = tiles, us
    return best, {"us": best_us if best is not None else base, "untuned_us": base}
