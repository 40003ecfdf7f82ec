"""PNG charts of benchmark results."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def speedup_chart(results: list[dict], title: str, path: Path, footer: str) -> Path:
    """Per dataset: speedup over AR (the median, whiskers at the range over repeats) and tau, and the
    acceptance histogram (the share of verify passes that committed each number of tokens), both as bars;
    `footer` (where the numbers came from) under them."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["dataset"] for r in results]
    x = range(len(names))
    speedups = [r["spread"]["speedup"] for r in results]
    whiskers = [[s["median"] - s["min"] for s in speedups], [s["max"] - s["median"] for s in speedups]]
    ax1.bar([i - 0.2 for i in x], [s["median"] for s in speedups], width=0.4, yerr=whiskers, capsize=3,
            label="speedup vs AR")
    ax1.bar([i + 0.2 for i in x], [r.get("tau", 0) for r in results], width=0.4, label="tau (tokens/step)")
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set_xticks(list(x), names)
    ax1.legend()
    ax1.set_title(title)
    hists = [r.get("accept_histogram") or [] for r in results]
    width = 0.8 / max(len(results), 1)
    for i, (r, hist) in enumerate(zip(results, hists)):
        total = sum(hist) or 1
        ax2.bar([n - 0.4 + (i + 0.5) * width for n in range(len(hist))], [h / total for h in hist], width=width,
                label=r["dataset"])
    longest = max((len(h) for h in hists), default=0)
    ax2.set_xticks(range(longest))
    ax2.set_xlabel("tokens committed per verify pass")
    ax2.set_ylabel("fraction of passes")
    ax2.legend()
    return save(fig, path, footer)


def save(fig: plt.Figure, path: Path, footer: str) -> Path:
    """Write `fig` as a PNG with `footer` (where its numbers came from) in small print under it."""
    fig.text(0.01, 0.01, footer, fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
