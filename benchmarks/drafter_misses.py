"""Where the DFlash drafter's chains break, and what kind of miss it is (any device, no timings).

benchmarks/drafter_ceiling.py's decode (DFlash trees, no n-gram assist, outputs equal to AR's) records the
drafter's per-slot top-K lists beside the target's own continuation. At every verify step the perfect tree over
those lists stops at the first slot whose top-K lacks the reference token; this script reports, per dataset:
- that stop slot's reference token by kind (newline, other whitespace, punctuation, digits, a word's start, a
  word's inner piece), as shares of the stops, beside each kind's share of the reached slots and its top-1 / top-K
  hit rate there: which kinds the drafter misses more than their frequency;
- whether the miss is a shift: the drafter's next slot holds the missed token (it wrote one token too many before
  it: "late"), or the stop slot holds the token after the missed one (it dropped one: "early"), beside how often
  a slot that hit holds the next slot's token as well (lists that hold the next token anyway);
- how many more slots a tree would accept if, from a late stop on, it read each depth from the next slot's list,
  as a branch beside the usual ones: the most such shifted branches could add to τ, with no node budget (an early
  stop has no such branch: the token it dropped is in no list).

    python benchmarks/drafter_misses.py [--dataset humaneval math mtbench sharegpt] [--num-prompts 10]
        [--max-new-tokens 128] [--draft DIR] [--topk 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import string
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_ceiling import DraftSteps, decode_args, draft_steps, reached, slot_hits, write_report  # noqa: E402

from specpilot.bench.charts import save  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402

KINDS = ("newline", "space", "punctuation", "digits", "word start", "word piece")


def token_kind(text: str) -> str:
    """One of KINDS for a token's decoded text."""
    if "\n" in text:
        return "newline"
    if not text.strip():
        return "space"
    core = text.strip()
    if all(c in string.punctuation for c in core):
        return "punctuation"
    if core.isdigit():
        return "digits"
    return "word start" if text[0].isspace() else "word piece"


def stops(topk_hits: torch.Tensor, steps: DraftSteps) -> torch.Tensor:
    """[S] the slot at which the perfect tree over the top-K lists stops; -1 where it runs to the block's or the
    reference's end."""
    missed = reached(topk_hits, steps) & ~topk_hits
    return torch.where(missed.any(-1), missed.float().argmax(-1), torch.tensor(-1))


def late_run(steps: DraftSteps, row: int, stop: int) -> int:
    """Slots a branch accepts from `stop` on when depth d reads slot d + 1's top-K list."""
    ids, ref = steps.ids[row], steps.ref[row]
    run = 0
    for d in range(stop, ids.shape[0] - 1):
        if ref[d] < 0 or not bool((ids[d + 1] == ref[d]).any()):
            break
        run += 1
    return run


def dropped(steps: DraftSteps, row: int, stop: int) -> bool:
    """Whether the stop slot's top-K list holds the token after the one it missed."""
    ids, ref = steps.ids[row], steps.ref[row]
    return stop + 1 < ref.shape[0] and int(ref[stop + 1]) >= 0 and bool((ids[stop] == ref[stop + 1]).any())


def analyse(name: str, steps: DraftSteps, kind: Callable[[int], str], topk_width: int) -> dict:
    """The report's row for one dataset's recorded steps; `kind` names a token's KIND."""
    top1, topk = slot_hits(steps)
    where = reached(topk, steps)
    stop = stops(topk, steps)
    kinds = [[kind(t) if t >= 0 else "" for t in row] for row in steps.ref.tolist()]
    by_kind = {k: {"reached": 0, "top1": 0, "topk": 0, "stops": 0} for k in KINDS}
    for s, d in where.nonzero().tolist():
        cell = by_kind[kinds[s][d]]
        cell["reached"] += 1
        cell["top1"] += int(top1[s, d])
        cell["topk"] += int(topk[s, d])
    late = early = gain = 0
    stopped = (stop >= 0).nonzero().flatten().tolist()
    for s in stopped:
        j = int(stop[s])
        by_kind[kinds[s][j]]["stops"] += 1
        run = late_run(steps, s, j)
        late += run > 0
        gain += run
        early += dropped(steps, s, j)
    # the same question where the slot hit: how often a list holds the next slot's token anyway
    ahead = F.pad((steps.ids[:, :-1] == steps.ref[:, 1:, None]).any(-1) & (steps.ref[:, 1:] >= 0), (0, 1))
    hit = where & topk
    total_reached = max(1, sum(c["reached"] for c in by_kind.values()))
    n_stops, n_steps = max(1, len(stopped)), max(1, len(steps.ref))
    return {"dataset": name, "prompts": steps.prompts, "identical_to_ar": steps.identical_to_ar,
            "steps": len(steps.ref), "stops": len(stopped), "topk": topk_width,
            "kinds": {k: {"share_of_reached": c["reached"] / total_reached, "share_of_stops": c["stops"] / n_stops,
                          "top1": c["top1"] / c["reached"] if c["reached"] else None,
                          "topk": c["topk"] / c["reached"] if c["reached"] else None}
                      for k, c in by_kind.items()},
            "late_share": late / n_stops, "early_share": early / n_stops, "tau_gain_late": gain / n_steps,
            "next_token_in_list_at_hits": ahead[hit].float().mean().item() if hit.any() else None}


def miss_report(name: str, args: argparse.Namespace, decode: Callable[[int], str]) -> dict:
    @cache
    def kind(token: int) -> str:
        return token_kind(decode(token))

    return analyse(name, draft_steps(name, args), kind, args.topk)


def chart(rows: list[dict], path: Path, footer: str) -> Path:
    fig, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 4.2), sharey=True, squeeze=False)
    for ax, row in zip(axes[0], rows):
        x = range(len(KINDS))
        ax.bar([i - 0.2 for i in x], [row["kinds"][k]["share_of_reached"] for k in KINDS], width=0.4,
               label="share of reached slots")
        ax.bar([i + 0.2 for i in x], [row["kinds"][k]["share_of_stops"] for k in KINDS], width=0.4,
               label=f"share of stops (top-{row['topk']} miss)")
        ax.set_xticks(list(x), KINDS, rotation=40, ha="right", fontsize=8)
        ax.set_title(f"{row['dataset']}: late {row['late_share']:.0%}, early {row['early_share']:.0%}", fontsize=9)
    axes[0][0].set_ylabel("share")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("DFlash drafter: the target's token where the perfect tree stops, by kind")
    return save(fig, path, footer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    decode_args(ap, num_prompts=10, max_new_tokens=128)
    args = ap.parse_args()
    tokenizer = Engine.from_config(EngineConfig(device=args.device)).tokenizer
    rows = []
    for name in args.dataset:
        rows.append(r := miss_report(name, args, lambda token: tokenizer.decode([token])))
        worst = max(KINDS, key=lambda k: r["kinds"][k]["share_of_stops"] - r["kinds"][k]["share_of_reached"])
        print(f"{name}: {r['stops']} stops in {r['steps']} steps; over-missed kind: {worst} "
              f"({r['kinds'][worst]['share_of_stops']:.0%} of stops, {r['kinds'][worst]['share_of_reached']:.0%} of "
              f"slots); late {r['late_share']:.0%} (shifted branches: +{r['tau_gain_late']:.3f} τ at most), "
              f"early {r['early_share']:.0%} (next token in a list that hit: {r['next_token_in_list_at_hits']:.0%})",
              flush=True)
    write_report(args, "drafter_misses", rows, chart)


if __name__ == "__main__":
    main()
