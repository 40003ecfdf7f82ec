"""What a JSON schema costs speculation: the embedded model on HumanEval prompts that ask for a JSON
answer, AR and speculative decoding with and without the schema, at B=1, the four interleaved per repeat.
With `--shots 1` (the default) the chat holds one worked example first (a small function of its own and its JSON
answer), so the model answers in JSON without the schema too and the two runs decode the same kind of text: the
ratio is then the schema's cost. Zero-shot, the embedded model mostly ignores the request and copies code from the
prompt, which drafts far better than prose, so the ratio also counts that change of text.
Reports each speedup (AR TPOT / spec TPOT; median and range), their ratio (goal >= 0.9), whether the
constrained speculative ids equal constrained AR's, and how many constrained outputs parse.

    python benchmarks/structured_cost.py [--device cuda] [--num-prompts 10] [--max-new-tokens 128] \\
        [--repeats 3] [--topk K --ngram-assist N (the served default's trees: 4, 3)] [--shots 0|1] [--out DIR]
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

from specpilot.bench.datasets import Prompt, apply_chat_template, load_prompts  # noqa: E402
from specpilot.bench.harness import spread, tpot_ms  # noqa: E402
from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "summary": {"type": "string", "maxLength": 200},
                                           "arguments": {"type": "integer", "minimum": 0, "maximum": 20}},
          "required": ["name", "summary", "arguments"], "additionalProperties": False}
ASK = ('\n\nDo not write the code. Answer only with a JSON object: {"name": the function\'s name, '
       '"summary": one sentence on what it does, "arguments": how many arguments it takes}.')
# the worked example of --shots 1: not a HumanEval task
EXAMPLE = [{"role": "user", "content": 'def add(a: int, b: int) -> int:\n    """Return the sum of a and b.\n'
            '    >>> add(2, 3)\n    5\n    """\n' + ASK},
           {"role": "assistant", "content": '{"name": "add", "summary": "Returns the sum of two integers.", '
            '"arguments": 2}'}]


def json_prompts(engine: Engine, n: int, shots: int = 1) -> list[list[int]]:
    out = []
    for p in load_prompts("humaneval", n):
        messages = [dict(m) for m in p.messages]
        messages[-1]["content"] += ASK
        out.append(apply_chat_template(engine.tokenizer, Prompt(p.id, p.dataset, EXAMPLE * shots + messages)))
    return out


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams, speculate: bool) -> tuple[float, list]:
    """TPOT (ms) of the prompts one at a time, and the requests."""
    engine.reset_spec_stats()
    if speculate:
        reqs = [r for p in prompts for r in engine.generate([p], params)]
    else:
        with engine.autoregressive():
            reqs = [r for p in prompts for r in engine.generate([p], params)]
    return tpot_ms(reqs), reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--topk", type=int, default=1, help="draft tree branching (1: chains)")
    ap.add_argument("--ngram-assist", type=int, default=0, help="n-gram assist's minimum match (0: off)")
    ap.add_argument("--shots", type=int, choices=[0, 1], default=1,
                    help="worked examples before each prompt (1: the model answers in JSON unconstrained too)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = Engine.from_config(EngineConfig(device=args.device, speculative_algorithm="dflash",
                                              speculative_eagle_topk=args.topk,
                                              speculative_ngram_assist=args.ngram_assist))
    engine.warm_up()
    prompts = json_prompts(engine, args.num_prompts, args.shots)
    plain = SamplingParams(max_new_tokens=args.max_new_tokens)
    constrained = replace(plain, json_schema=json.dumps(SCHEMA))
    tpot: dict[str, list[float]] = {k: [] for k in ("ar", "spec", "ar_schema", "spec_schema")}
    tau: dict[str, list[float]] = {"spec": [], "spec_schema": []}  # tokens per verify pass: what drafts earn
    identical, parsed, parsed_plain = [], [], []
    for r in range(args.repeats):
        runs = {}
        for key, params, speculate in (("ar", plain, False), ("spec", plain, True),
                                       ("ar_schema", constrained, False), ("spec_schema", constrained, True)):
            ms, reqs = run(engine, prompts, params, speculate)
            tpot[key].append(ms)
            runs[key] = reqs
            if speculate:
                tau[key].append(engine.spec_stats.tau)
        identical.append(sum(a.output_ids == s.output_ids for a, s in zip(runs["ar_schema"], runs["spec_schema"])))
        parsed.append(sum(_parses(engine, q) for q in runs["spec_schema"]))
        parsed_plain.append(sum(_parses(engine, q) for q in runs["spec"]))
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f} ms" for k, v in tpot.items()), flush=True)
    speedup = [a / s for a, s in zip(tpot["ar"], tpot["spec"])]
    schema_speedup = [a / s for a, s in zip(tpot["ar_schema"], tpot["spec_schema"])]
    ratio = [c / p for c, p in zip(schema_speedup, speedup)]
    result = {"provenance": collect(engine.device, str(engine.dtype)), "command": " ".join(sys.argv),
              "prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "schema": SCHEMA,
              "tpot_ms": {k: spread(v) for k, v in tpot.items()}, "speedup": spread(speedup),
              "speedup_with_schema": spread(schema_speedup), "ratio": spread(ratio),
              "tau": {k: spread(v) for k, v in tau.items()},
              "constrained_spec_identical_to_ar": identical, "constrained_outputs_parsing": parsed,
              "shots": args.shots, "unconstrained_outputs_parsing": parsed_plain}
    print(f"speedup {statistics.median(speedup):.3f}, with the schema {statistics.median(schema_speedup):.3f}: "
          f"ratio {statistics.median(ratio):.3f} (goal >= 0.9); tau {statistics.median(tau['spec']):.2f} vs "
          f"{statistics.median(tau['spec_schema']):.2f} with it; constrained spec == AR on {identical} of "
          f"{args.num_prompts}; parsing {parsed} (without the schema {parsed_plain})")
    write_json(out_dir(args.out) / "structured_cost.json", result)


def _parses(engine: Engine, req) -> bool:
    try:
        json.loads(engine.output_text(req))
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
