"""The cost model's report: rich tables, a chart (measured against floor per stage) and JSON."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.table import Table  # noqa: E402

from specpilot.costmodel.calibrate import Ceilings  # noqa: E402
from specpilot.costmodel.floors import Floors  # noqa: E402
from specpilot.costmodel.gaps import Gap, Measured  # noqa: E402


def ceilings_table(c: Ceilings) -> Table:
    table = Table(title=f"device ceilings ({c.device}, {c.dtype})")
    table.add_column("ceiling")
    table.add_column("measured", justify="right")
    for name, value in (("copy bandwidth", f"{c.copy_bytes_per_s / 1e9:.1f} GB/s"),
                        ("read bandwidth", f"{c.read_bytes_per_s / 1e9:.1f} GB/s"),
                        ("GEMM rate", f"{c.matmul_flops / 1e12:.2f} TFLOP/s"),
                        ("one-row GEMM weight read", f"{c.decode_matmul_bytes_per_s / 1e9:.1f} GB/s"),
                        ("kernel launch", f"{c.launch_s * 1e6:.1f} µs"),
                        ("graph replay", "n/a" if c.graph_replay_s is None else f"{c.graph_replay_s * 1e6:.1f} µs")):
        table.add_row(name, value)
    return table


def steps_table(f: Floors, m: Measured | None) -> Table:
    table = Table(title=f"step floors (B={f.batch}, context {f.context})")
    for col in ("stage", "floor ms", "measured ms"):
        table.add_column(col, justify="right" if col != "stage" else "left")
    rows = [("AR step", f.ar_step_ms, m and m.ar_step_ms), ("draft", f.draft_ms, m and m.draft_ms),
            ("verify", f.verify_ms, m and m.verify_ms), ("host and overhead", f.overhead_ms, m and m.other_ms),
            ("speculative step", f.spec_step_ms, m and m.spec_step_ms)]
    for name, floor, got in rows:
        table.add_row(name, f"{floor:.3f}", "" if got is None else f"{got:.3f}")
    table.add_row("tau (tokens/step)", f"≤ {f.tau_max:.0f}", "" if m is None else f"{m.tau:.2f}")
    table.add_row("speedup", f"≤ {f.speedup_ceiling:.2f}×", "" if m is None else f"{m.speedup:.2f}×")
    return table


def gaps_table(gaps: list[Gap]) -> Table:
    table = Table(title="gaps, by the speedup each costs")
    for col in ("rank", "gap", "measured", "best", "lost speedup"):
        table.add_column(col, justify="left" if col == "gap" else "right")
    for i, g in enumerate(gaps, start=1):
        table.add_row(str(i), g.name, f"{g.measured:.3f} {g.unit}", f"{g.best:.3f} {g.unit}", f"{g.lost_speedup:.3f}")
    return table


def chart(f: Floors, m: Measured, gaps: list[Gap], path: Path, footer: str) -> Path:
    from specpilot.bench.charts import save

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["draft", "verify", "host and overhead"]
    floors_ms = [f.draft_ms, f.verify_ms, f.overhead_ms]
    measured_ms = [m.draft_ms, m.verify_ms, m.other_ms]
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], measured_ms, width=0.4, label="measured")
    ax1.bar([i + 0.2 for i in x], floors_ms, width=0.4, label="floor")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("ms per speculative step")
    ax1.set_title(f"speedup {m.speedup:.2f}× of a {f.speedup_ceiling:.2f}× ceiling")
    ax1.legend()
    ax2.barh([g.name for g in gaps][::-1], [g.lost_speedup for g in gaps][::-1])
    ax2.set_xlabel("speedup lost")
    ax2.set_title("gaps")
    return save(fig, path, footer)
