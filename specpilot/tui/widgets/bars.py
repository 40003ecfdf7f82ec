"""Bar charts drawn as text: a round's ranked gaps before and after it, and an accept-length histogram."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

WIDTH = 18  # characters of the longest bar


def _bar(value: float, top: float, style: str) -> Text:
    cells = 0 if top <= 0 else value / top * WIDTH
    full = int(cells)
    part = " ▏▎▍▌▋▊▉"[int((cells - full) * 8)] if full < WIDTH else ""
    return Text("█" * full + part.strip(), style=style)


def _gap_text(gap: dict[str, Any]) -> str:
    """What a gap measures, in its own unit (the acceptance gap's are tokens per step, stored in the ms
    columns), and the speedup it costs."""
    measured, best = gap["measured_ms"], gap["floor_ms"]
    shown = (f"τ {measured:.2f}/{best:.0f}" if gap["name"].startswith("acceptance")
             else f"+{measured - best:.3f} ms")
    lost = gap.get("lost_speedup")
    return shown + (f" · {lost:.2f}×" if lost is not None else "")


class GapChart(Static):
    """Each gap at the start of a round and at the start of the next one, as a bar of the speedup it costs
    (the cost model's ranking, comparable across stages), with what it measures in its own unit."""

    def show(self, before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
        if not before:
            self.update(Text("no gaps measured yet", style="dim"))
            return
        later = {g["name"]: g for g in after}
        top = max([g["lost_speedup"] or 0.0 for g in [*before, *after]] + [1e-9])
        table = Table.grid(padding=(0, 1))
        table.add_column(no_wrap=True)
        table.add_column(no_wrap=True)
        table.add_column(no_wrap=True)
        for gap in before:
            table.add_row(Text(f"{gap['rank']}. {gap['name']}", style="bold"),
                          _bar(gap["lost_speedup"] or 0.0, top, "red"), _gap_text(gap))
            if gap["name"] in later:
                next_ = later[gap["name"]]
                table.add_row("   after", _bar(next_["lost_speedup"] or 0.0, top, "green"), _gap_text(next_))
        self.update(table)


class Histogram(Static):
    """Verify passes by how many tokens they committed."""

    counts: list[int] = []  # what is shown

    def show(self, counts: list[int]) -> None:
        self.counts = counts
        total = sum(counts)
        if not total:
            self.update(Text("no verify passes yet", style="dim"))
            return
        table = Table.grid(padding=(0, 1))
        for _ in range(3):
            table.add_column()
        for n, count in enumerate(counts):
            if n == 0 and not count:
                continue
            table.add_row(f"{n:>2} tok", _bar(count, max(counts), "cyan"), f"{count} ({count / total:.0%})")
        self.update(table)
