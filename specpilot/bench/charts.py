"""PNG charts of benchmark results."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def speedup_chart(results: list[dict], title: str, path: Path) -> Path:
    """Per dataset: speedup over AR and tau, and the acceptance histogram (the share of verify passes
    that committed each number of tokens), both as bars."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["dataset"] for r in results]
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [r["speedup"] or 0 for r in results], width=0.4, label="speedup vs AR")
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
