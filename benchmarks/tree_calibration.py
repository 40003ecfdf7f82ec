"""Would draft trees accept more if they were built from calibrated probabilities? (any device, no timings)

A draft tree keeps the paths whose product of per-slot draft probabilities is largest. Those probabilities are
each slot's marginal given the context, while a path is accepted only if every earlier slot was: what a node is
worth is the chance its token is right *given that its prefix was*. This script records the drafter's per-slot
top-K lists on each dataset (benchmarks/drafter_ceiling.py's decode: DFlash trees, no n-gram assist, outputs equal
to AR's), fits that conditional chance per (slot, rank, probability bin) on half the requests and builds trees of
--nodes nodes from it on the other half (then the halves swap), and reports the τ those trees reach against the
trees built from the drafter's own probabilities over the very same lists.

    python benchmarks/tree_calibration.py [--dataset humaneval math mtbench sharegpt] [--num-prompts 16]
        [--max-new-tokens 128] [--nodes 15] [--draft DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_ceiling import (  # noqa: E402
    DraftSteps,
    decode_args,
    draft_steps,
    reached,
    run_length,
    slot_hits,
    tree_tau,
    write_report,
)

from specpilot.bench.charts import save  # noqa: E402
from specpilot.drafters.draft_tree import TreeBuilder  # noqa: E402

BIN_EDGES = torch.tensor([0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9, 1.01])
PRIOR_WEIGHT = 4.0  # pseudo-counts of the raw probability in each cell: sparse cells stay near the drafter's own


def subset(steps: DraftSteps, keep: torch.Tensor) -> DraftSteps:
    return DraftSteps(steps.ids[keep], steps.probs[keep], steps.ref[keep], steps.request[keep], steps.prompts,
                      steps.identical_to_ar, steps.tau_tree_actual)


def _cells(probs: torch.Tensor) -> torch.Tensor:
    """[S, D, K] -> one cell index per entry: (slot, rank, probability bin)."""
    _, depth, k = probs.shape
    bins = torch.bucketize(probs.clamp(0, 1), BIN_EDGES[1:-1])
    slot = torch.arange(depth)[:, None] * (k * len(BIN_EDGES))
    rank = torch.arange(k)[None, :] * len(BIN_EDGES)
    return slot + rank + bins


def fit(steps: list[DraftSteps]) -> torch.Tensor:
    """The chance each list entry is the reference token, given every earlier slot's reference token was in its
    list (the only way a tree reaches the slot), per cell; shrunk towards the raw probabilities' mean there."""
    cells, hits, raw, weight = [], [], [], []
    for s in steps:
        _, topk = slot_hits(s)
        reachable = reached(topk, s)
        cells.append(_cells(s.probs).flatten())
        hits.append((s.ids == s.ref[..., None]).float().flatten())
        raw.append(s.probs.float().flatten())
        weight.append(reachable[..., None].expand_as(s.probs).float().flatten())
    cells, hits, raw, weight = (torch.cat(x) for x in (cells, hits, raw, weight))
    size = steps[0].probs.shape[1] * steps[0].probs.shape[2] * len(BIN_EDGES)
    n = torch.zeros(size).index_add_(0, cells, weight)
    h = torch.zeros(size).index_add_(0, cells, weight * hits)
    p = torch.zeros(size).index_add_(0, cells, weight * raw) / n.clamp_min(1)
    return (h + PRIOR_WEIGHT * p) / (n + PRIOR_WEIGHT)


def calibrated(table: torch.Tensor, steps: DraftSteps) -> torch.Tensor:
    return table[_cells(steps.probs)].clamp_min(1e-6)


def compare(name: str, steps: DraftSteps, pooled: dict[str, DraftSteps], nodes: int) -> dict:
    """Two-fold: the table fitted on the other half of every dataset's requests (this one's included)."""
    builder = TreeBuilder(steps.ids.shape[2], nodes, steps.ids.shape[1], torch.device("cpu"))
    raw_tau, cal_tau, count = 0.0, 0.0, 0
    for fold in (0, 1):
        held = steps.request % 2 == fold
        if not held.any():
            continue
        table = fit([subset(s, s.request % 2 != fold) for s in pooled.values()])
        part = subset(steps, held)
        raw_tau += tree_tau(builder, part.probs, part) * len(part.ref)
        cal_tau += tree_tau(builder, calibrated(table, part), part) * len(part.ref)
        count += len(part.ref)
    _, topk = slot_hits(steps)
    return {"dataset": name, "steps": count, "nodes": nodes, "tau_drafter_probs": raw_tau / count,
            "tau_calibrated": cal_tau / count, "tau_ceiling": 1 + run_length(topk).float().mean().item(),
            "tau_engine": steps.tau_tree_actual}


def chart(rows: list[dict], path: Path, footer: str) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = torch.arange(len(rows)).float()
    for offset, key, text in ((-0.27, "tau_drafter_probs", "drafter's probabilities"),
                              (0.0, "tau_calibrated", "calibrated (two-fold)"), (0.27, "tau_ceiling", "top-K ceiling")):
        bars = ax.bar(x + offset, [r[key] for r in rows], width=0.27, label=text)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(x, [r["dataset"] for r in rows])
    ax.set_ylabel(f"τ of {rows[0]['nodes']}-node trees (greedy, vs AR)")
    ax.set_title("draft trees from the drafter's probabilities vs calibrated ones, same lists")
    ax.legend(fontsize=8)
    return save(fig, path, footer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    decode_args(ap, num_prompts=16, max_new_tokens=128)
    ap.add_argument("--nodes", type=int, default=15, help="draft nodes per tree (the served tree: block - 1)")
    args = ap.parse_args()
    steps = {name: draft_steps(name, args) for name in args.dataset}
    rows = [compare(name, s, steps, args.nodes) for name, s in steps.items()]
    for r in rows:
        print(f"{r['dataset']}: {r['steps']} steps; τ {r['nodes']} nodes: drafter's probabilities "
              f"{r['tau_drafter_probs']:.3f}, calibrated {r['tau_calibrated']:.3f} "
              f"({r['tau_calibrated'] / r['tau_drafter_probs'] - 1:+.1%}); ceiling {r['tau_ceiling']:.2f}", flush=True)
    write_report(args, "tree_calibration", rows, chart)


if __name__ == "__main__":
    main()
