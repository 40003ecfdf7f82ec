"""Decode tiles tuned per weight shape: which tiles the batch-invariant GEMM (invariant_gemm) and the B12 GEMM
(b12_gemm) launch for a product of 1..64 rows on this device, where the untuned choice (invariant_config) is
slower.

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

__all__ = ["BUCKETS", "CANDIDATES", "KERNELS", "TileTable", "bucket", "pick_fastest"]

KERNELS = ("bf16", "b12")
BUCKETS = (1, 4, 16, MAX_M)  # row counts tuned; a product of M rows takes the smallest bucket >= M
# Tiles of 128 K columns and 8 stages (capped to shared memory by each kernel): rows of w x warps
CANDIDATES: tuple[SkinnyConfig, ...] = tuple(
    SkinnyConfig(block_n=rows, block_k=128, split_k=1, num_warps=warps, num_stages=8)
    for rows, warps in ((16, 1), (16, 2), (32, 2), (32, 4), (64, 4), (64, 8), (128, 4), (128, 8)))
MIN_GAIN = 0.03  # a candidate replaces the untuned tiles only when faster by more than this share (timing noise)


def bucket(m: int) -> int | None:
    """The tuned row count a product of `m` rows takes; None past the decode sizes (invariant_config's tiles)."""
    return next((b for b in BUCKETS if m <= b), None)


@dataclass
class TileTable:
    """Tiles by (kernel, N, K, bucket) for one device; absent entries keep invariant_config's."""

    device: str
    entries: dict[tuple[str, int, int, int], SkinnyConfig] = field(default_factory=dict)
    timings: dict[tuple[str, int, int, int], dict[str, float]] = field(default_factory=dict)  # µs: tuned, untuned

    def pick(self, kernel: str, n: int, k: int, m: int) -> SkinnyConfig | None:
        rows = bucket(m)
        return None if rows is None else self.entries.get((kernel, n, k, rows))

    def chooser(self, kernel: str, n: int, k: int) -> Callable[[int], tuple[SkinnyConfig, int | None]]:
        """m -> (tiles, x rows per program) as the kernel will launch them for a product of m rows."""
        def choose(m: int) -> tuple[SkinnyConfig, int | None]:
            tuned = self.pick(kernel, n, k, m)
            return (tuned, None) if tuned is not None else invariant_config(m, n, k)
        return choose

    def to_json(self) -> str:
        rows = [{"kernel": kern, "n": n, "k": k, "m": m, "config": asdict(cfg), **self.timings.get((kern, n, k, m), {})}
                for (kern, n, k, m), cfg in sorted(self.entries.items())]
        return json.dumps({"device": self.device, "entries": rows}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> TileTable:
        raw = json.loads(text)
        table = cls(raw["device"])
        for row in raw["entries"]:
            key = (row["kernel"], row["n"], row["k"], row["m"])
            if row["kernel"] not in KERNELS or row["m"] not in BUCKETS:
                raise ValueError(f"a tile table entry for {key}: kernel must be one of {KERNELS}, m one of {BUCKETS}")
            table.entries[key] = SkinnyConfig(**row["config"])
            table.timings[key] = {name: row[name] for name in ("us", "untuned_us") if name in row}
        return table

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: Path) -> TileTable:
        return cls.from_json(path.read_text())


def pick_fastest(untuned: SkinnyConfig, candidates: Iterable[SkinnyConfig], time_us: Callable[[SkinnyConfig], float],
                 same_bits: Callable[[SkinnyConfig], bool]) -> tuple[SkinnyConfig | None, dict[str, float]]:
    """The fastest candidate whose output is bitwise the untuned tiles', if it beats them by more than MIN_GAIN
    (else None), and the two times."""
    base = time_us(untuned)
    best, best_us = None, base * (1 - MIN_GAIN)
    for config in candidates:
        if config == untuned or not same_bits(config):
            continue
        try:
            us = time_us(config)
        except Exception:  # noqa: BLE001 - a tile that does not compile or launch here is no candidate
            continue
        if us < best_us:
            best, best_us = config, us
    return best, {"us": best_us if best is not None else base, "untuned_us": base}
