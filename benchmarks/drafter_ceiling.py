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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

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


@dataclass
class DraftSteps:
    """Every (verify step, request) of a dataset's DFlash decode whose request's output equals AR's."""
    ids: torch.Tensor  # [S, D, K] the drafter's top-K tokens per slot
    probs: torch.Tensor  # [S, D, K] their probabilities
    ref: torch.Tensor  # [S, D] the reference (AR) tokens after the committed prefix; -1 past the output's end
    request: torch.Tensor  # [S] the request's index among the prompts
    prompts: int
    identical_to_ar: int
    tau_tree_actual: float


def draft_steps(name: str, args: argparse.Namespace) -> DraftSteps:
    """AR's greedy continuation of the dataset's prompts, then the same prompts decoded with DFlash trees, the
    drafter's lists recorded at each verify step beside the reference tokens they aim at."""
    ar_engine = _engine(args, speculate=False)
    prompts = [apply_chat_template(ar_engine.tokenizer, p) for p in load_prompts(name, args.num_prompts)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    reference = [r.output_ids for r in ar_engine.generate(prompts, params)]
    del ar_engine
    engine = _engine(args, speculate=True)
    records = _record_drafts(engine)
    reqs = engine.generate(prompts, params)
    same = {r.rid: (k, ref) for k, (r, ref) in enumerate(zip(reqs, reference)) if r.output_ids == ref}
    depth = engine.drafter.block_size - 1
    ids, probs, refs, request = [], [], [], []
    for rids, lengths, step_ids, step_probs in records:
        for i, (rid, start) in enumerate(zip(rids, lengths)):
            k, ref = same.get(rid, (None, []))
            if start >= len(ref):
                continue
            ahead = ref[start : start + depth]
            ids.append(step_ids[i])
            probs.append(step_probs[i])
            refs.append(torch.tensor(ahead + [-1] * (depth - len(ahead))))
            request.append(k)
    return DraftSteps(torch.stack(ids), torch.stack(probs), torch.stack(refs), torch.tensor(request), len(prompts),
                      len(same), engine.spec_stats.tau)


def slot_hits(steps: DraftSteps) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, D] top-1 and top-K hits of each slot (False past the reference's end)."""
    want = steps.ref[..., None]
    return steps.ids[..., 0] == steps.ref, (steps.ids == want).any(-1)


def reached(hits: torch.Tensor, steps: DraftSteps) -> torch.Tensor:
    """[S, D]: the slots a run of `hits` reaches (every earlier slot hit), within the reference."""
    return F.pad(hits.long().cumprod(-1), (1, 0), value=1)[:, :-1].bool() & (steps.ref >= 0)


def run_length(hits: torch.Tensor) -> torch.Tensor:
    """[S]: how many slots from the first hit in a row."""
    return hits.long().cumprod(-1).sum(-1)


def tree_tau(builder: TreeBuilder, probs: torch.Tensor, steps: DraftSteps) -> float:
    """Mean τ of the trees `builder` makes from `probs` (the drafter's, or rescored) over `steps`' lists, each
    verified greedily against the reference."""
    layout = builder.build(probs, steps.ids)
    return statistics.fmean(1 + _accepted(layout, i, [t for t in steps.ref[i].tolist() if t >= 0])
                            for i in range(len(steps.ref)))


def ceiling(name: str, args: argparse.Namespace) -> dict:
    steps = draft_steps(name, args)
    top1, topk = slot_hits(steps)
    valid = steps.ref >= 0
    reached1, reachedk = reached(top1, steps), reached(topk, steps)
    depth = steps.ids.shape[1]

    def mean(hits: torch.Tensor, where: torch.Tensor) -> float | None:
        return round(hits[where].float().mean().item(), 4) if where.any() else None

    builders = {n: TreeBuilder(args.topk, n, depth, torch.device("cpu")) for n in args.tree_nodes}
    return {"dataset": name, "prompts": steps.prompts, "identical_to_ar": steps.identical_to_ar,
            "steps": len(steps.ref), "block": depth + 1, "topk": args.topk,
            "slots": [{"slot": j + 1, "top1": mean(top1[:, j], valid[:, j]), "topk": mean(topk[:, j], valid[:, j]),
                       "top1_given_prefix": mean(top1[:, j], reached1[:, j]),
                       "topk_given_prefix": mean(topk[:, j], reachedk[:, j])} for j in range(depth)],
            "tau_chain_top1": 1 + run_length(top1).float().mean().item(),
            "tau_tree_oracle": 1 + run_length(topk).float().mean().item(),
            "tau_tree_actual": steps.tau_tree_actual,
            "tau_by_tree_nodes": {n: tree_tau(b, steps.probs, steps) for n, b in builders.items()}}


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


def decode_args(ap: argparse.ArgumentParser, num_prompts: int, max_new_tokens: int) -> None:
    """The options `draft_steps` reads (and --out)."""
    ap.add_argument("--dataset", nargs="+", default=["humaneval", "math", "mtbench", "sharegpt"])
    ap.add_argument("--num-prompts", type=int, default=num_prompts)
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--draft", default=None, help="DFlash checkpoint directory (default: the shipped drafter)")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="prompts decoded together")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out")


def write_report(args: argparse.Namespace, name: str, rows: list[dict],
                 draw: Callable[[list[dict], Path, str], Path]) -> None:
    """--out/NAME.json (the rows, provenance and command) and NAME.png drawn by `draw`."""
    prov = collect(torch.device(args.device), None)
    out = out_dir(args.out)
    write_json(out / f"{name}.json", {"provenance": prov, "command": " ".join(sys.argv), "rows": rows})
    draw(rows, out / f"{name}.png", label(prov))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    decode_args(ap, num_prompts=10, max_new_tokens=64)
    ap.add_argument("--tree-nodes", type=int, nargs="*", default=[], help="τ of trees of these many nodes too")
    args = ap.parse_args()
    rows = []
    for name in args.dataset:
        rows.append(ceiling(name, args))
        r = rows[-1]
        print(f"{name}: {r['identical_to_ar']}/{r['prompts']} prompts equal AR, {r['steps']} steps; τ top-1 chain "
              f"{r['tau_chain_top1']:.2f}, tree ceiling {r['tau_tree_oracle']:.2f}, tree reached "
              f"{r['tau_tree_actual']:.2f} (block {r['block']})" + "".join(
                  f"; {n} nodes {t:.2f}" for n, t in r["tau_by_tree_nodes"].items()), flush=True)
    write_report(args, "drafter_ceiling", rows, chart)


if __name__ == "__main__":
    main()
