"""How often a JSON schema overrules the target, which decides how checking grammars after acceptance pays:
constrained AR on HumanEval prompts that ask for JSON (structured_cost.py's), then, along each output, the
positions where the target's plain argmax is refused (the step redoes its decision there), those where the
grammar allows a single token, and the matcher's cost per token (a bitmask fill, an accept).

    python benchmarks/grammar_refusals.py [--device cpu] [--num-prompts 10] [--max-new-tokens 128] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import xgrammar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402
from structured_cost import SCHEMA, json_prompts  # noqa: E402

from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402
from specpilot.engine.grammar import GrammarCompiler  # noqa: E402
from specpilot.forcing.forcing import teacher_forced_logits  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = Engine.from_config(EngineConfig(device=args.device))
    prompts = json_prompts(engine, args.num_prompts)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, json_schema=json.dumps(SCHEMA))
    reqs = engine.generate(prompts, params)
    compiler = GrammarCompiler(engine.tokenizer, engine.checkpoint.config.vocab_size)
    positions = refused = forced = 0
    fill_s = accept_s = 0.0
    for prompt, req in zip(prompts, reqs):
        plain = teacher_forced_logits(engine, prompt, req.output_ids).argmax(-1).tolist()
        grammar = compiler.matcher(params)
        mask = xgrammar.allocate_token_bitmask(1, grammar.vocab_size)
        for j, token in enumerate(req.output_ids):
            if grammar.terminated:
                break
            start = time.perf_counter()
            grammar.matcher.fill_next_token_bitmask(mask, 0)
            fill_s += time.perf_counter() - start
            forced += sum(bin(w & 0xFFFFFFFF).count("1") for w in mask[0].tolist()) == 1
            positions += 1
            refused += plain[j] != token  # the constrained token differs: the plain argmax was refused
            start = time.perf_counter()
            grammar.accept(token)
            accept_s += time.perf_counter() - start
    result = {"provenance": collect(engine.device, str(engine.dtype)), "command": " ".join(sys.argv),
              "schema": SCHEMA, "positions": positions, "plain_argmax_refused": refused, "single_token_allowed": forced,
              "bitmask_fill_us": 1e6 * fill_s / positions, "accept_us": 1e6 * accept_s / positions}
    write_json(out_dir(args.out) / "grammar_refusals.json", result)
    print(f"{positions} constrained positions: plain argmax refused at {refused} ({refused / positions:.1%}), a single "
          f"token allowed at {forced}; bitmask fill {result['bitmask_fill_us']:.1f} us, accept "
          f"{result['accept_us']:.1f} us a token")


if __name__ == "__main__":
    main()
