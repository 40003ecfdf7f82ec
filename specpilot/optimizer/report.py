"""A round's report, as people read it: Markdown (gaps before and after, every candidate and its verdict, what
was accepted, the speedup with its spread) and a PNG of the candidates' speedups over stock."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specpilot.bench.charts import plt, save


def _speedup(result: dict[str, Any]) -> str:
    s = result.get("speedup")
    if not s:
        return "–"
    shown = f"{s['median']:.3f}× ({s['min']:.3f}–{s['max']:.3f})"
    return shown + (f", ≥ {s['lower']:.3f}× at p = {s['p']:.3f}" if "p" in s else "")


def _what(result: dict[str, Any]) -> str:
    if result.get("patch"):
        return f"patch ({len(result['patch'].splitlines())} lines) under {json.dumps(result['profile'])}"
    return json.dumps(result["profile"])


def _gap(g: dict[str, Any] | None) -> str:
    """measured against its floor (ms) or ceiling (τ), and the speedup it costs."""
    if g is None:
        return "–"
    return f"{g['measured']:.3f} / {g['best']:.3f} {g.get('unit', 'ms')}, costs {g['lost_speedup']:.3f}×"


def _closed(before: dict[str, Any], after: dict[str, Any] | None) -> str:
    """How much of its distance to the best possible the round removed, each side against its own best (a
    deeper block raises τ's ceiling, so its gap can widen while τ rises)."""
    if after is None or before["measured"] == before["best"]:
        return "–"
    share = 1 - abs(after["measured"] - after["best"]) / abs(before["measured"] - before["best"])
    if round(share, 2) == 0:
        return "unchanged"
    return f"closed {share:.0%}" if share > 0 else f"widened {-share:.0%}"


def markdown(round_: dict[str, Any], gaps_after: list[dict[str, Any]] | None) -> str:
    after = {g["name"]: g for g in gaps_after or []}
    lines = [f"# Round {round_['round']}", "", "## Gaps (measured / best possible; the speedup each costs)", "",
             "| gap | at the start | after the round | of the distance to best |", "|---|---|---|---|"]
    for g in round_["gaps"]:
        moved = after.get(g["name"])
        lines.append(f"| {g['name']} | {_gap(g)} | {_gap(moved)} | {_closed(g, moved)} |")
    lines += ["", "## Candidates", "", "| id | agent | candidate | verdict | speedup over stock: median (min–max), 95% bound, p |",
              "|---|---|---|---|---|"]
    for r in round_["results"]:
        verdict = "accepted" if r["accepted"] else f"rejected: {r.get('reason')}"
        lines.append(f"| {r['candidate']} | {r['agent']} | `{_what(r)}` | {verdict} | {_speedup(r)} |")
    accepted = [r for r in round_["results"] if r["accepted"]]
    lines += ["", f"Accepted: {len(accepted)} of {len(round_['results'])}."]
    if challenge := round_.get("challenge"):
        outcome = "it takes the lead" if challenge["accepted"] else f"the best so far stays ({challenge['reason']})"
        lines += ["", f"Challenge: candidate {challenge['candidate']} against the best so far "
                  f"`{json.dumps(challenge['against'])}`, head to head: {_speedup(challenge)}; {outcome}."]
    lines += ["", f"Best so far: `{json.dumps(round_['best'])}`, {round_['best_speedup_over_stock']:.3f}× stock.", ""]
    return "\n".join(lines)


def chart(round_: dict[str, Any], path: Path, footer: str) -> Path:
    results = [r for r in round_["results"] if r.get("speedup")]
    fig, ax = plt.subplots(figsize=(max(4, 1 + 0.8 * len(results)), 3.5))
    medians = [r["speedup"]["median"] for r in results]
    whiskers = [[m - r["speedup"]["min"] for m, r in zip(medians, results)],
                [r["speedup"]["max"] - m for m, r in zip(medians, results)]]
    colors = ["tab:green" if r["accepted"] else "tab:gray" for r in results]
    ax.bar(range(len(results)), medians, yerr=whiskers, capsize=3, color=colors)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(results)), [f"{r['candidate']}\n{r['agent']}" for r in results], fontsize=7)
    ax.set_ylabel("speedup over stock")
    ax.set_title(f"round {round_['round']}: candidates (green: accepted)")
    return save(fig, path, footer)


def write(round_: dict[str, Any], gaps_after: list[dict[str, Any]] | None, folder: Path, footer: str) -> None:
    """report.md, report.json and report.png of one round in its folder."""
    (folder / "report.json").write_text(json.dumps(round_ | {"gaps_after": gaps_after}, indent=2))
    (folder / "report.md").write_text(markdown(round_, gaps_after))
    chart(round_, folder / "report.png", footer)
