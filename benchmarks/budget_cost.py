"""What the `budget` mechanism does to offline throughput: one engine (the embedded model and its DFlash drafter,
the device's default mechanisms), a batch of ShareGPT prompts decoded AR, with speculation on every step, and
with speculation where the budget measures it faster; the three interleaved per repeat, output ids checked equal.
Reports tokens per second (median and range), each mode's steps and the budget's buckets at the end.

    python benchmarks/budget_cost.py [--device cpu] [--batch-size 32] [--max-new-tokens 48] [--repeats 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402

from specpilot.bench.datasets import apply_chat_template, load_prompts  # noqa: E402
from specpilot.bench.harness import spread  # noqa: E402
from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.engine.budget import SpeculationBudget  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # the device's default mechanisms; the budget is switched on and off between runs by setting engine.budget
    # (what --mechanisms budget builds), so all three modes share one engine, its weights and graphs
    engine = Engine.from_config(EngineConfig(device=args.device, speculative_algorithm="dflash",
                                             max_running_requests=args.batch_size))
    engine.warm_up()
    prompts = [apply_chat_template(engine.tokenizer, p) for p in load_prompts("sharegpt", args.batch_size)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {"ar": [], "spec": [], "budget": []}
    ids, budgets = {}, []
    for r in range(args.repeats):
        for mode in rates:
            engine.budget = SpeculationBudget() if mode == "budget" else None
            start = time.perf_counter()
            if mode == "ar":
                with engine.autoregressive():
                    reqs = engine.generate(prompts, params)
            else:
                reqs = engine.generate(prompts, params)
            rates[mode].append(sum(len(q.output_ids) for q in reqs) / (time.perf_counter() - start))
            ids[mode] = [q.output_ids for q in reqs]
            if mode == "budget":
                budgets.append(engine.budget.as_dict())
        print(f"repeat {r + 1}: " + ", ".join(f"{m} {v[-1]:.1f} tok/s" for m, v in rates.items()), flush=True)
    same = ids["spec"] == ids["ar"] and ids["budget"] == ids["ar"]
    result = {"provenance": collect(engine.device, str(engine.dtype)), "command": " ".join(sys.argv),
              "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
              "mechanisms": sorted(engine.mechanisms | {"budget"}), "tok_s": {m: spread(v) for m, v in rates.items()},
              "ids_equal_ar": same, "budget": budgets}
    write_json(out_dir(args.out) / "budget_cost.json", result)
    med = {m: statistics.median(v) for m, v in rates.items()}
    print(f"tok/s median: AR {med['ar']:.1f}, speculation {med['spec']:.1f} ({med['spec'] / med['ar']:.2f}x), "
          f"budget {med['budget']:.1f} ({med['budget'] / med['ar']:.2f}x); ids equal AR's: {same}; "
          f"last budget: {budgets[-1]}")


if __name__ == "__main__":
    main()
