"""Offline generation throughput with and without prefill waves (EngineConfig.min_prefill_batch).

The workload is train-drafter's: training prompts of the embedded model, greedy, continuous batching.
Requests end at different times (EOS or the token limit), so admitting per finished request makes many
small prefill passes; on a GPU each is an eager pass. Reports per wave size: tokens/s, prefill passes,
decode steps, and whether the outputs equal wave 1's.

    python benchmarks/prefill_waves.py --device cuda --num-prompts 2048 --batch 128 --waves 1 16
"""

from __future__ import annotations

import argparse
import json
import time

from specpilot.config import SamplingParams
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.training.data import load_training_prompts


def run(args: argparse.Namespace, prompts: list[list[int]], wave: int) -> dict:
    engine = Engine.from_config(EngineConfig(device=args.device, max_running_requests=args.batch,
                                             context_length=args.context_length, min_prefill_batch=wave))
    engine.warm_up()
    counts = {"prefill_passes": 0, "decode_steps": 0}
    prefill, decode = engine._prefill, engine._decode

    def counted_prefill(reqs):
        counts["prefill_passes"] += 1
        return prefill(reqs)

    def counted_decode(reqs):
        counts["decode_steps"] += 1
        return decode(reqs)

    engine._prefill, engine._decode = counted_prefill, counted_decode
    start = time.perf_counter()
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens))
    wall = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in reqs)
    return {"wave": wave, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, **counts,
            "outputs": [r.output_ids for r in reqs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--num-prompts", type=int, default=2048)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=128, help="max running requests")
    p.add_argument("--context-length", type=int, default=1024)
    p.add_argument("--waves", type=int, nargs="+", default=[1, 16])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    tokenizer = Engine.from_config(EngineConfig(device="cpu", max_running_requests=1)).tokenizer
    prompts, _ = load_training_prompts(tokenizer, ["sharegpt", "math", "code"], args.num_prompts)
    prompts = [q for q in prompts if len(q) + args.max_new_tokens <= args.context_length]
    results = [run(args, prompts, wave) for wave in args.waves]
    for r in results:
        same = r["outputs"] == results[0]["outputs"]
        print(f"wave {r['wave']:>3}: {r['tokens_per_s']:,.0f} tok/s, {r['prefill_passes']} prefill passes, "
              f"{r['decode_steps']} decode steps, outputs equal wave {results[0]['wave']}'s: {same}")
    if args.out:
        summary = [{k: v for k, v in r.items() if k != "outputs"} for r in results]
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": summary}, f, indent=2)


if __name__ == "__main__":
    main()
