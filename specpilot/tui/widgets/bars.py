"""Bar charts drawn as text: a round's ranked gaps before and after it, and an accept-length histogram."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

WIDTH = 28  # characters of the longest bar


def _bar(value: float, top: float, style: str) -> Text:
    cells = 0 if top <= 0 else value / top * WIDTH
    full = int(cells)
    part = " ▏▎▍▌▋▊▉"[int((cells - full) * 8)] if full < WIDTH else ""
    return Text("█" * full + part.strip(), style=style)


class GapChart(Static):
    """Each gap (measured minus floor, ms) at the start of a round and at the start of the next one."""

    def show(self, before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
        if not before:
            self.update(Text("no gaps measured yet", style="dim"))
            return
        later = {g["name"]: g["measured_ms"] - g["floor_ms"] for g in after}
        top = max([g["measured_ms"] - g["floor_ms"] for g in before] + list(later.values()) + [1e-9])
        table = Table.grid(padding=(0, 1))
        table.add_column(no_wrap=True)
        table.add_column(no_wrap=True)
        table.add_column(no_wrap=True)
        for gap in before:
            ms = gap["measured_ms"] - gap["floor_ms"]
            lost = gap.get("lost_speedup")
            label = Text(f"{gap['rank']}. {gap['name']}", style="bold")
            table.add_row(label, _bar(ms, top, "red"),
                          f"{ms:8.3f} ms" + (f"  −{lost:.2f}×" if lost else ""))
            if gap["name"] in later:
                table.add_row("   after", _bar(later[gap["name"]], top, "green"), f"{later[gap['name']]:8.3f} ms")
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
