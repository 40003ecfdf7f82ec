"""Tuning the GEMMs' decode tiles on this device (kernels/gemm_tiles.py has the table and why a tile never changes a
bit), and where the machine keeps the table: one per device."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from specpilot.config import cache_root
from specpilot.formats.b12 import encode
from specpilot.kernels.b12_gemm import b12_gemm
from specpilot.kernels.gemm_tiles import BUCKETS, KERNELS, TileTable, Tiles, candidates_for, pick_fastest
from specpilot.kernels.skinny_gemm import invariant_config, invariant_gemm, replay_us, rotated_copies

log = logging.getLogger(__name__)


def tile_table_path(device_name: str) -> Path:
    return cache_root() / "gemm_tiles" / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', device_name)}.json"


def load_tile_table(device: torch.device) -> tuple[TileTable | None, Path | None]:
    """This CUDA device's tuned tiles and their file, or (None, None) where none were tuned (or not CUDA)."""
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    path = tile_table_path(name)
    if not path.exists():
        return None, None
    table = TileTable.load(path)
    if table.device != name:
        log.warning("ignoring %s: tuned on %s, not this %s", path, table.device, name)
        return None, None
    return table, path


def save_tile_table(table: TileTable, into: TileTable | None = None) -> Path:
    """`table`'s entries written over `into`'s (the device's table so far, other shapes kept) in the device's file."""
    if into is not None:
        into.entries.update(table.entries)
        into.timings.update(table.timings)
        table = into
    return table.save(tile_table_path(table.device))


def tune(shapes: Iterable[tuple[int, int]], kernels: Iterable[str] = KERNELS, buckets: Iterable[int] = BUCKETS,
         candidates: Callable[[int], Iterable[Tiles]] = candidates_for,
         progress: Callable[[Iterable], Iterable] = iter) -> TileTable:
    """Time every candidate tile (`candidates(bucket)`) against the untuned ones for each weight shape [N, K],
    kernel and row bucket on this CUDA device (CUDA-graph replay over weight copies past twice the L2, Gaussian
    bf16 weights), keeping the faster ones whose output is bitwise the untuned tiles'."""
    if not torch.cuda.is_available():
        raise RuntimeError("tuning GEMM tiles needs a CUDA device")
    kernels = list(kernels)
    table = TileTable(torch.cuda.get_device_name())
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in progress(sorted(set(shapes))):
        w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        copies = rotated_copies(w)
        operands = {"bf16": copies}
        if "b12" in kernels:
            planes = encode(w)
            operands["b12"] = [planes] + [planes.map(torch.clone) for _ in copies[1:]]
        for kernel in kernels:
            gemm = invariant_gemm if kernel == "bf16" else b12_gemm
            for m in buckets:
                x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
                expected = invariant_gemm(x, w).view(torch.int16)

                def time_us(tiles: Tiles) -> float:
                    return replay_us(lambda a, b: gemm(a, b, config=tiles[0], block_m=tiles[1]), operands[kernel], x)

                def same_bits(tiles: Tiles) -> bool:
                    try:
                        out = gemm(x, operands[kernel][0], config=tiles[0], block_m=tiles[1])
                        return torch.equal(out.view(torch.int16), expected)
                    except Exception:  # noqa: BLE001 - e.g. a tile B12 cannot take, or out of shared memory
                        return False

                best, times = pick_fastest(invariant_config(m, n, k), candidates(m), time_us, same_bits)
                if best is not None:
                    table.entries[(kernel, n, k, m)] = best
                    table.timings[(kernel, n, k, m)] = times
        del copies, operands
        torch.cuda.empty_cache()
    return table
