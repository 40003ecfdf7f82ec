"""Where bench runs write their JSON and charts."""

from __future__ import annotations

import time
from pathlib import Path


def bench_output_dir(requested: str | None) -> Path:
    """The folder asked for, else a new one under ./specpilot-bench named by the time; created."""
    out = Path(requested) if requested else Path("specpilot-bench") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    return out
