"""T(B, tokens): how long the target's pass over B requests of `tokens` rows each takes on this device and
model, measured once (`specpilot bench --profile-cost-table`), kept on disk per device and model, and read at
start by what chooses verify lengths. A chain's rows and a draft tree's cost differently (a tree node reads its
own gathered tail tiles in the batch-invariant attention), so a table holds both grids where it measured trees. Between and past the measured points the table interpolates linearly
(beyond the largest batch or token count it extends the last segment's slope)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from specpilot.config import cache_root


@dataclass(frozen=True)
class CostTable:
    key: str  # the device and model it was measured for (table_key)
    batch_sizes: tuple[int, ...]
    tokens: tuple[int, ...]  # rows per request
    ms: tuple[tuple[float, ...], ...]  # ms[i][j]: batch_sizes[i] requests of tokens[j] rows
    context: int  # positions already in each request's cache while it was measured
    graphs: bool  # the passes ran as CUDA graphs
    tree_ms: tuple[tuple[float, ...], ...] | None = None  # the same grid for tree-masked verifies (None: unmeasured)

    def __post_init__(self) -> None:
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError("a cost table's batch sizes and token counts must be increasing")
        for grid in (self.ms, self.tree_ms or self.ms):
            if len(grid) != len(self.batch_sizes) or any(len(row) != len(self.tokens) for row in grid):
                raise ValueError(f"a cost table of {len(self.batch_sizes)} x {len(self.tokens)} points needs that many "
                                 f"times")

    def at(self, batch: int, tokens: float, tree: bool = False) -> float:
        """Milliseconds of one pass of `batch` requests with `tokens` rows each (bilinear in the grid); `tree`: a
        tree-masked verify's, where the table measured them (else the chain's)."""
        return float(self.along_tokens(batch, np.array([tokens], dtype=np.float64), tree)[0])

    def along_tokens(self, batch: float, tokens: np.ndarray, tree: bool = False) -> np.ndarray:
        """`at` for one batch size and many row counts at once (what level 1 of two-level verification asks)."""
        ms = self._grids[1 if tree and self.tree_ms is not None else 0]
        i0, i1, u = _bracket(self._points[0], np.array([batch], dtype=np.float64))
        row = ms[i0[0]] + u[0] * (ms[i1[0]] - ms[i0[0]])
        j0, j1, v = _bracket(self._points[1], np.asarray(tokens, dtype=np.float64))
        return row[j0] + v * (row[j1] - row[j0])

    # level 1 prices every step: the grids as arrays once, not per call
    @cached_property
    def _grids(self) -> tuple[np.ndarray, np.ndarray | None]:
        return (np.asarray(self.ms, dtype=np.float64),
                None if self.tree_ms is None else np.asarray(self.tree_ms, dtype=np.float64))

    @cached_property
    def _points(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.batch_sizes, dtype=np.float64), np.asarray(self.tokens, dtype=np.float64)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> CostTable:
        raw = json.loads(text)
        tree = raw.get("tree_ms")  # tables profiled before trees were have none
        return cls(raw["key"], tuple(raw["batch_sizes"]), tuple(raw["tokens"]), tuple(tuple(r) for r in raw["ms"]),
                   raw["context"], raw["graphs"], None if tree is None else tuple(tuple(r) for r in tree))


def _bracket(grid: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per value of x the grid points it lies between (the last segment past either end) and its fraction."""
    if len(grid) == 1:
        zero = np.zeros(len(x), dtype=np.int64)
        return zero, zero, np.zeros(len(x))
    i = np.clip(np.searchsorted(grid, x, side="right") - 1, 0, len(grid) - 2)
    return i, i + 1, (x - grid[i]) / (grid[i + 1] - grid[i])


def table_key(device_name: str, model_source: str, dtype: str, exact: bool) -> str:
    """A file-name-safe key of what a table's times depend on: the device, the model, its dtype, its kernels."""
    raw = f"{device_name}-{Path(model_source).name or model_source}-{dtype}-{'invariant' if exact else 'fastest'}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", raw)


def key_for(device: torch.device, model_source: str, dtype: torch.dtype, exact: bool) -> str:
    """table_key of an engine's target on `device` (a CUDA device by its name: tables do not travel between GPUs)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return table_key(name, model_source, str(dtype).removeprefix("torch."), exact)


def cache_path(key: str) -> Path:
    return cache_root() / "cost_tables" / f"{key}.json"


def save_cost_table(table: CostTable) -> Path:
    path = cache_path(table.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table.to_json())
    return path


def load_cost_table(key: str) -> CostTable | None:
    """The cached table of `key`, or None where none was profiled (or the file is not a table)."""
    path = cache_path(key)
    try:
        return CostTable.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
