"""Where τ goes under a JSON schema: constrained speculative decoding of structured_cost.py's prompts, its steps
split into those where the grammar redid the device's decision (refused the target's plain argmax) and the rest,
with the mean tokens each commits. The rest are steps the grammar left alone: their τ is the drafter's on the
constrained text itself. And of the steps that ended at a rejected draft, those where the grammar refused every
draft offered there (a chain's next draft, a tree's children of the last accepted node), at the first draft or
deeper: drafts no constrained target can take.

    python benchmarks/grammar_step_split.py [--device cpu] [--num-prompts 6] [--max-new-tokens 96] [--topk 4]
        [--ngram-assist 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402
from structured_cost import SCHEMA, json_prompts  # noqa: E402

from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402
from specpilot.engine.step import SpeculativeStep  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--ngram-assist", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = Engine.from_config(EngineConfig(device=args.device, speculative_algorithm="dflash",
                                             speculative_eagle_topk=args.topk,
                                             speculative_ngram_assist=args.ngram_assist))
    redone: set[tuple[str, int]] = set()  # (request, its step) where the grammar changed the decision
    check = SpeculativeStep._check_grammars

    rejected = {"steps": 0, "all_refused": 0, "all_refused_at_first": 0}

    def watched(step, plan, logits, decisions, drafted, *rest):
        before = [list(d.tokens) for d in decisions]
        corrected = check(step, plan, logits, decisions, drafted, *rest)
        redone.update((plan.reqs[i].rid, len(plan.reqs[i].accept_lengths))
                      for i, (b, d) in enumerate(zip(before, decisions)) if b != d.tokens)
        for i in plan.constrained:
            offered = [token for (row, token) in step._children(drafted, plan.widths[i], i)
                       if row == decisions[i].rows[-1]]
            if offered and plan.reqs[i].grammar is not None:
                refused = _refused(plan.reqs[i].grammar.matcher, decisions[i].tokens[:-1], offered)
                rejected["steps"] += 1
                rejected["all_refused"] += refused
                rejected["all_refused_at_first"] += refused and len(decisions[i].tokens) == 1
        return corrected

    SpeculativeStep._check_grammars = watched
    params = replace(SamplingParams(max_new_tokens=args.max_new_tokens), json_schema=json.dumps(SCHEMA))
    reqs = engine.generate(json_prompts(engine, args.num_prompts), params)
    split: dict[str, list[int]] = {"redone": [], "left_alone": []}
    for r in reqs:
        for step, n in enumerate(r.accept_lengths):
            split["redone" if (r.rid, step) in redone else "left_alone"].append(n)
    result = {"provenance": collect(engine.device, str(engine.dtype)), "command": " ".join(sys.argv),
              **{k: {"steps": len(v), "mean_tokens": statistics.mean(v) if v else None} for k, v in split.items()},
              "tau": sum(map(sum, split.values())) / sum(map(len, split.values())), "rejections": rejected}
    print(f"tau {result['tau']:.2f}: steps the grammar redid {len(split['redone'])}, "
          f"{result['redone']['mean_tokens'] or 0:.2f} tokens each; left alone {len(split['left_alone'])}, "
          f"{result['left_alone']['mean_tokens'] or 0:.2f} each; of {rejected['steps']} steps ending at a rejected draft, "
          f"the grammar refused every draft offered in {rejected['all_refused']} "
          f"({rejected['all_refused_at_first']} at the first draft)")
    write_json(out_dir(args.out) / "grammar_step_split.json", result)


def _refused(matcher, path: list[int], offered: list[int]) -> bool:
    """Whether the grammar, after `path` from the matcher's state, refuses every token of `offered` (the state is
    left as it was)."""
    taken = 0
    for token in path:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        taken += 1
    refused = taken < len(path) or matcher.is_terminated()
    if not refused:
        refused = True
        for token in offered:
            if matcher.accept_token(token):
                matcher.rollback(1)
                refused = False
                break
    if taken:
        matcher.rollback(taken)
    return refused


if __name__ == "__main__":
    main()
