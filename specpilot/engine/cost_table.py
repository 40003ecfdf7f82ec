"""T(B, tokens): how long the target's pass over B requests of `tokens` rows each takes on this device and
model, measured once (`specpilot bench --profile-cost-table`), kept on disk per device and model, and read at
start by what chooses verify lengths. Between and past the measured points the table interpolates linearly
(beyond the largest batch or token count it extends the last segment's slope)."""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from specpilot.config import cache_root


@dataclass(frozen=True)
class CostTable:
    key: str  # the device and model it was measured for (table_key)
    batch_sizes: tuple[int, ...]
    tokens: tuple[int, ...]  # rows per request
    ms: tuple[tuple[float, ...], ...]  # ms[i][j]: batch_sizes[i] requests of tokens[j] rows
    context: int  # positions already in each request's cache while it was measured
    graphs: bool  # the passes ran as CUDA graphs

    def __post_init__(self) -> None:
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError("a cost table's batch sizes and token counts must be increasing")
        if len(self.ms) != len(self.batch_sizes) or any(len(row) != len(self.tokens) for row in self.ms):
            raise ValueError(f"a cost table of {len(self.batch_sizes)} x {len(self.tokens)} points needs that many times")

    def at(self, batch: int, tokens: int) -> float:
        """Milliseconds of one pass of `batch` requests with `tokens` rows each (bilinear in the grid)."""
        def along(points: tuple[int, ...], x: float) -> tuple[int, int, float]:
            if len(points) == 1:
                return 0, 0, 0.0
            i = min(max(bisect.bisect_right(points, x) - 1, 0), len(points) - 2)
            return i, i + 1, (x - points[i]) / (points[i + 1] - points[i])

        i0, i1, u = along(self.batch_sizes, batch)
        j0, j1, v = along(self.tokens, tokens)
        lo = self.ms[i0][j0] + v * (self.ms[i0][j1] - self.ms[i0][j0])
        hi = self.ms[i1][j0] + v * (self.ms[i1][j1] - self.ms[i1][j0])
        return lo + u * (hi - lo)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> CostTable:
        raw = json.loads(text)
        return cls(raw["key"], tuple(raw["batch_sizes"]), tuple(raw["tokens"]), tuple(tuple(r) for r in raw["ms"]),
                   raw["context"], raw["graphs"])


def table_key(device_name: str, model_source: str, dtype: str, exact: bool) -> str:
    """A file-name-safe key of what a table's times depend on: the device, the model, its dtype, its kernels."""
    raw = f"{device_name}-{Path(model_source).name or model_source}-{dtype}-{'invariant' if exact else 'fastest'}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", raw)


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
