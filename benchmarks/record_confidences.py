"""A confidence trace of the embedded pair: the shipped DFlash drafter's chains (block 16, no trees, every draft
verified), per request and verify pass its confidence in each draft and how many drafts the target accepted
(specpilot/bench/replay.RecordingDrafter). `gpu_spec.py --replay TRACE.json [--replay-tau 6.5]` replays it on
large shapes: each pass's acceptance and the confidences of a real pass that accepted as many, so two-level's
level 1 reads what a real drafter would give it.

    python benchmarks/record_confidences.py [--device cpu] [--dataset humaneval] [--num-prompts 20]
        [--max-new-tokens 256] [--block-size 16] [--out DIR]            -> DIR/confidence_trace_DATASET.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402

from specpilot.bench.datasets import apply_chat_template, load_prompts  # noqa: E402
from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.bench.replay import AcceptTrace, RecordingDrafter  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402
from specpilot.engine.registry import parse_mechanisms  # noqa: E402
from specpilot.progress import bar  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16, help="the block the replay's drafter will draft")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = Engine.from_config(EngineConfig(device=args.device, speculative_algorithm="dflash",
                                             speculative_num_draft_tokens=args.block_size, speculative_eagle_topk=1, speculative_ngram_assist=0,
                                             mechanisms=parse_mechanisms("stock")))
    recording = RecordingDrafter(engine.drafter)
    engine.drafter = recording
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for prompt in bar(load_prompts(args.dataset, args.num_prompts), f"recording {args.dataset}"):
        engine.generate([apply_chat_template(engine.tokenizer, prompt)], params)
    passes = [(a, [round(c, 4) for c in confidences]) for a, confidences in recording.passes]
    trace = AcceptTrace.from_passes(passes, args.dataset)
    result = {"provenance": collect(engine.device, str(engine.dtype)), "command": " ".join(sys.argv),
              "dataset": args.dataset, "block_size": recording.block_size, "tau": trace.tau,
              "engine_tau": engine.spec_stats.tau, "passes": passes}
    path = out_dir(args.out) / f"confidence_trace_{args.dataset}.json"
    write_json(path, result)
    print(f"{len(passes)} passes, tau {trace.tau:.2f} (the engine's, every pass counted: "
          f"{engine.spec_stats.tau:.2f}) -> {path}")


if __name__ == "__main__":
    main()
