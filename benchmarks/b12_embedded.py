"""The embedded pair with the target's matrices held as B12 against bf16 (issue 21's end-to-end item on the embedded
model): one engine per weight format (the shipped profile as serve runs it; the B12 one with `+b12`), a batch of
prompts decoded AR and with speculation on each, the four modes interleaved per repeat, every mode's output ids
checked equal to bf16 AR's (B12 is lossless, and speculation with it must stay so). Reports tokens per second
(median and range), B12 AR over bf16 AR, each format's speculation over bf16 AR, τ, and the weight bytes each engine
holds.

    python benchmarks/b12_embedded.py [--device cuda] [--batch-size 1 8] [--dataset humaneval] [--num-prompts 8]
        [--max-new-tokens 256] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, pass_clock, shipped_config, timed_generate, write_json  # noqa: E402

from specpilot.bench.datasets import apply_chat_template, load_prompts  # noqa: E402
from specpilot.bench.harness import spread  # noqa: E402
from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.engine.config import EngineConfig, changes_defaults  # noqa: E402
from specpilot.engine.engine import Engine  # noqa: E402

FORMATS = ("bf16", "b12")


def with_b12(config: EngineConfig) -> EngineConfig:
    """`config` with the target's matrices as B12, whatever its mechanisms say (open, changes, or a set)."""
    named = config.mechanisms
    if named is None or changes_defaults(named):
        return replace(config, mechanisms=(named or frozenset()) | {"+b12"})
    return replace(config, mechanisms=named | {"b12"})


def engines(device: str, batch_size: int, context: int) -> dict[str, Engine]:
    config = shipped_config(device, dtype="bfloat16", max_running_requests=batch_size, context_length=context,
                            max_total_tokens=batch_size * context)  # B12 holds bf16 weights, on CPU too
    built = {"bf16": Engine.from_config(config), "b12": Engine.from_config(with_b12(config))}
    if built["b12"].weights_info()["format"] != "b12":
        raise SystemExit("the B12 engine holds no B12 matrix (the b12 mechanism's precondition failed)")
    for engine in built.values():
        engine.warm_up()
    return built


def measure(args: argparse.Namespace, batch_size: int) -> dict:
    built = engines(args.device, batch_size, args.context)
    tokenizer = built["bf16"].tokenizer
    prompts = [apply_chat_template(tokenizer, p) for p in load_prompts(args.dataset, args.num_prompts)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    modes = [(f"{kind}-{fmt}", fmt, kind == "ar") for kind in ("ar", "spec") for fmt in FORMATS]
    clocks = {fmt: pass_clock(engine) for fmt, engine in built.items()}
    rates: dict[str, list[float]] = {name: [] for name, _, _ in modes}
    tau: dict[str, list[float]] = {name: [] for name, _, ar in modes if not ar}
    ids: dict[str, list[list[int]]] = {}
    for r in range(args.repeats):  # interleaved: every mode once a repeat
        for name, fmt, ar in modes:
            engine = built[fmt]
            engine.reset_spec_stats()
            reqs, wall, _ = timed_generate(engine, prompts, params, ar, clocks[fmt])
            rates[name].append(sum(len(q.output_ids) for q in reqs) / wall)
            if not ar:
                tau[name].append(engine.spec_stats.tau)
            ids[name] = [q.output_ids for q in reqs]
        print(f"B={batch_size} repeat {r + 1}: " + ", ".join(f"{m} {v[-1]:.1f} tok/s" for m, v in rates.items()),
              flush=True)
    ar = statistics.median(rates["ar-bf16"])
    return {"batch_size": batch_size, "tokens_per_s": {m: spread(v) for m, v in rates.items()},
            "tau": {m: spread(v) for m, v in tau.items()},
            "over_bf16_ar": {m: statistics.median(v) / ar for m, v in rates.items()},
            "ids_equal_to_bf16_ar": {m: ids[m] == ids["ar-bf16"] for m in ids},
            "weights": {fmt: engine.weights_info() for fmt, engine in built.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dataset", default="humaneval", help="the prompts' dataset (specpilot.bench.datasets)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024, help="KV positions a request may reach")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [measure(args, b) for b in args.batch_size]
    for row in rows:
        equal = all(row["ids_equal_to_bf16_ar"].values())
        print(f"B={row['batch_size']}: " + ", ".join(f"{m} {x:.2f}x" for m, x in row["over_bf16_ar"].items())
              + f" bf16 AR's tokens/s; ids equal to bf16 AR's: {equal}; weight bytes "
              + " / ".join(f"{fmt} {w['bytes'] / 2**20:.1f} MiB" for fmt, w in row["weights"].items()))
    device = torch.device(args.device)
    write_json(out_dir(args.out) / "b12_embedded.json",
               {"provenance": collect(device, "bfloat16"),
                "command": " ".join(sys.argv), "dataset": args.dataset, "num_prompts": args.num_prompts,
                "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "rows": rows})
    if not all(all(row["ids_equal_to_bf16_ar"].values()) for row in rows):
        raise SystemExit("a mode's output ids differ from bf16 AR's")


if __name__ == "__main__":
    main()
