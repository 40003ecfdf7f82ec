"""Where τ goes under a JSON schema: constrained speculative decoding of structured_cost.py's prompts, its steps
split into those where the grammar redid the device's decision (refused the target's plain argmax) and the rest,
with the mean tokens each commits. The rest are steps the grammar left alone: their τ is the drafter's on the
constrained text itself.

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

    def watched(step, plan, logits, decisions, *rest):
        before = [list(d.tokens) for d in decisions]
        corrected = check(step, plan, logits, decisions, *rest)
        redone.update((plan.reqs[i].rid, len(plan.reqs[i].accept_lengths))
                      for i, (b, d) in enumerate(zip(before, decisions)) if b != d.tokens)
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
              "tau": sum(map(sum, split.values())) / sum(map(len, split.values()))}
    print(f"tau {result['tau']:.2f}: steps the grammar redid {len(split['redone'])}, "
          f"{result['redone']['mean_tokens'] or 0:.2f} tokens each; left alone {len(split['left_alone'])}, "
          f"{result['left_alone']['mean_tokens'] or 0:.2f} each")
    write_json(out_dir(args.out) / "grammar_step_split.json", result)


if __name__ == "__main__":
    main()
