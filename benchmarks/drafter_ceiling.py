"""How far the DFlash drafter is from what its block allows, on any device (no timings).

The target's own greedy continuation of each prompt (AR) is the reference. The engine then decodes the same
prompts with DFlash trees (top-K per slot, stock mechanisms, no graphs), and at every verify step the drafter's
per-slot top-K lists are compared with the reference tokens after the committed prefix:
- per-slot accuracy: top-1 and top-K hits at slot k, unconditionally and given that slots 1..k-1 hit (what
  acceptance needs);
- τ of a top-1 chain (1 + the run of top-1 hits), of a perfect tree over these lists (1 + the run of top-K
  hits: the most a tree over this drafter's candidates can accept), the block's own ceiling (the block size),
  and the τ the tree actually reached;
- with --tree-nodes, τ of trees of those many nodes built from the same lists and probabilities (TreeBuilder's
  likeliest paths, as the drafter builds its own of block - 1 nodes): what a wider verify would accept, each
  step from the same committed prefix.
Only requests whose speculative output equals AR's count (on CPU float rounding can part them).

    python benchmarks/drafter_ceiling.py [--dataset humaneval math mtbench sharegpt] [--num-prompts 10]
        [--max-new-tokens 64] [--draft DIR] [--topk 4] [--tree-nodes 15 31 63] [--device cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402

from specpilot.bench.charts import save  # noqa: E402
from specpilot.bench.datasets import apply_chat_template, load_prompts  # noqa: E402
from specpilot.bench.provenance import collect, label  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.drafters.draft_tree import TreeBuilder  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402
from specpilot.engine.verify import draft_children  # noqa: E402
from specpilot.state.tree import TreeLayout  # noqa: E402


def _engine(args: argparse.Namespace, speculate: bool) -> Engine:
    spec = dict(speculative_algorithm="dflash", speculative_draft_model_path=args.draft,
                speculative_eagle_topk=args.topk, speculative_ngram_assist=0, mechanisms=frozenset(),
                cuda_graphs=False) if speculate else {}
    return Engine.from_config(EngineConfig(device=args.device, max_running_requests=args.batch, **spec))


def _record_drafts(engine: Engine) -> list[tuple[list[str], list[int], torch.Tensor, torch.Tensor]]:
    """Per verify step: its requests' ids, their committed output lengths, and the drafter's top-K ids and
    probabilities [n, block - 1, K] (slot j predicts output position length + j)."""
    drafter, records = engine.drafter, []
    propose, tree_pass = drafter.propose, drafter._tree_pass
    pending: list = []

    def recording_propose(reqs):
        pending[:] = [[r.rid for r in reqs], [len(r.output_ids) for r in reqs]]
        return propose(reqs)

    def recording_tree_pass(top, ids, hint):
        records.append((*pending, ids.cpu(), top.float().cpu()))
        return tree_pass(top, ids, hint)

    drafter.propose, drafter._tree_pass = recording_propose, recording_tree_pass
    return records


def ceiling(name: str, args: argparse.Namespace) -> dict:
    ar_engine = _engine(args, speculate=False)
    prompts = [apply_chat_template(ar_engine.tokenizer, p) for p in load_prompts(name, args.num_prompts)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    reference = [r.output_ids for r in ar_engine.generate(prompts, params)]
    del ar_engine
    engine = _engine(args, speculate=True)
    records = _record_drafts(engine)
    reqs = engine.generate(prompts, params)
    same = {r.rid: ref for r, ref in zip(reqs, reference) if r.output_ids == ref}
    depth = engine.drafter.block_size - 1
    top1, topk, top1_run, topk_run = ([[] for _ in range(depth)] for _ in range(4))
    chain_tau, tree_tau = [], []
    sized = {n: [] for n in args.tree_nodes}  # τ of a tree of n nodes over the same lists, per step
    builders = {n: TreeBuilder(args.topk, n, depth, torch.device("cpu")) for n in args.tree_nodes}
    for rids, lengths, ids, probs in records:
        layouts = {n: b.build(probs, ids) for n, b in builders.items()}
        for i, (rid, start) in enumerate(zip(rids, lengths)):
            ref = same.get(rid)
            if ref is None or start >= len(ref):
                continue
            run1 = runk = True
            for j in range(min(depth, len(ref) - start)):
                want = ref[start + j]
                hit1, hitk = int(ids[i, j, 0]) == want, want in ids[i, j].tolist()
                top1[j].append(hit1)
                topk[j].append(hitk)
                if run1:
                    top1_run[j].append(hit1)
                if runk:
                    topk_run[j].append(hitk)
                run1, runk = run1 and hit1, runk and hitk
            chain_tau.append(1 + next((j for j, h in enumerate(ids[i, :, 0].tolist()[: len(ref) - start])
                                       if h != ref[start + j]), min(depth, len(ref) - start)))
            tree_tau.append(1 + next((j for j in range(min(depth, len(ref) - start))
                                      if ref[start + j] not in ids[i, j].tolist()), min(depth, len(ref) - start)))
            for n, layout in layouts.items():
                sized[n].append(1 + _accepted(layout, i, ref[start:]))

    def mean(xs: list[bool]) -> float | None:
        return round(sum(xs) / len(xs), 4) if xs else None

    return {"dataset": name, "prompts": len(prompts), "identical_to_ar": len(same), "steps": len(chain_tau),
            "block": depth + 1, "topk": args.topk,
            "slots": [{"slot": j + 1, "top1": mean(top1[j]), "topk": mean(topk[j]), "top1_given_prefix":
                       mean(top1_run[j]), "topk_given_prefix": mean(topk_run[j])} for j in range(depth)],
            "tau_chain_top1": statistics.fmean(chain_tau), "tau_tree_oracle": statistics.fmean(tree_tau),
            "tau_tree_actual": engine.spec_stats.tau,
            "tau_by_tree_nodes": {n: statistics.fmean(v) for n, v in sized.items() if v}}


def _accepted(layout: TreeLayout, i: int, ref: list[int]) -> int:
    """How many of request i's tree nodes a greedy verify accepts against the reference continuation."""
    children = draft_children(layout.tokens[i].tolist(), layout.parents[i].tolist())
    node, depth = 0, 0
    while depth < len(ref) and (node, ref[depth]) in children:
        node, depth = children[(node, ref[depth])], depth + 1
    return depth


def chart(rows: list[dict], path: Path, footer: str) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row in rows:
        slots = [s["slot"] for s in row["slots"]]
        line, = ax.plot(slots, [s["top1_given_prefix"] for s in row["slots"]], marker="o",
                        label=f"{row['dataset']} top-1 (τ chain {row['tau_chain_top1']:.2f})")
        ax.plot(slots, [s["topk_given_prefix"] for s in row["slots"]], linestyle="--", color=line.get_color(),
                label=f"{row['dataset']} top-{row['topk']} (τ ceiling {row['tau_tree_oracle']:.2f}, "
                      f"tree {row['tau_tree_actual']:.2f})")
    ax.set_xlabel("draft slot (given every earlier slot hit)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.set_title("DFlash drafter: per-slot accuracy against the target's own continuation")
    ax.legend(fontsize=7)
    return save(fig, path, footer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", nargs="+", default=["humaneval", "math", "mtbench", "sharegpt"])
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft", default=None, help="DFlash checkpoint directory (default: the shipped drafter)")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--tree-nodes", type=int, nargs="*", default=[], help="τ of trees of these many nodes too")
    ap.add_argument("--batch", type=int, default=8, help="prompts decoded together")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for name in args.dataset:
        rows.append(ceiling(name, args))
        r = rows[-1]
        print(f"{name}: {r['identical_to_ar']}/{r['prompts']} prompts equal AR, {r['steps']} steps; τ top-1 chain "
              f"{r['tau_chain_top1']:.2f}, tree ceiling {r['tau_tree_oracle']:.2f}, tree reached "
              f"{r['tau_tree_actual']:.2f} (block {r['block']})" + "".join(
                  f"; {n} nodes {t:.2f}" for n, t in r["tau_by_tree_nodes"].items()), flush=True)
    prov = collect(torch.device(args.device), None)
    out = out_dir(args.out)
    write_json(out / "drafter_ceiling.json", {"provenance": prov, "command": " ".join(sys.argv), "rows": rows})
    chart(rows, out / "drafter_ceiling.png", label(prov))


if __name__ == "__main__":
    main()
