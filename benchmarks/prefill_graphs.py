"""What graphed prefills (EngineConfig.prefill_graph_tokens) do to throughput under continuous batching: one
engine (the embedded model and its DFlash drafter with the device's shipped profile), `--waves` batches' worth
of prompts, so the batch refills as requests end and each refill is a prefill pass of a few prompts; AR and
speculation, each with eager prefills and with the prefill graphs, interleaved per repeat on the same engine and
graphs; output ids checked equal. Reports tokens per second (median and range), and per mode the prefill passes
and decode steps with their host seconds.

    python benchmarks/prefill_graphs.py [--device cuda] [--batch-size 32] [--waves 4] [--max-new-tokens 256]
        [--dataset sharegpt] [--stop-at-eos] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, pass_clock, shipped_config, timed_generate, write_json  # noqa: E402

from specpilot.bench.datasets import apply_chat_template, load_prompts  # noqa: E402
from specpilot.bench.harness import spread  # noqa: E402
from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.engine.engine import Engine  # noqa: E402

MODES = ("ar eager", "ar graphed", "spec eager", "spec graphed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--waves", type=int, default=4, help="batches' worth of prompts (the batch refills as they end)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024, help="KV positions a request may reach")
    ap.add_argument("--dataset", default="sharegpt", help="the prompts' dataset (specpilot.bench.datasets)")
    ap.add_argument("--stop-at-eos", action="store_true", help="requests end at EOS too (default: ignore it)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = Engine.from_config(shipped_config(args.device, max_running_requests=args.batch_size,
                                               context_length=args.context,
                                               max_total_tokens=args.batch_size * args.context))
    if not engine.runner.prefills:
        raise SystemExit("prefill_graphs.py: the engine captured no prefill graphs (needs CUDA graphs)")
    engine.warm_up()
    graphs = engine.runner.prefills
    prompts = [apply_chat_template(engine.tokenizer, p) for p in load_prompts(args.dataset, args.waves * args.batch_size)]
    prompts = [p for p in prompts if len(p) + args.max_new_tokens <= engine.context_length]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=not args.stop_at_eos)
    clock = pass_clock(engine)
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    passes: dict[str, list[dict]] = {m: [] for m in MODES}
    ids: dict[str, list[list[int]]] = {}
    for r in range(args.repeats):
        for mode in MODES:
            decoding, prefill = mode.split()
            engine.runner.prefills = graphs if prefill == "graphed" else {}
            reqs, wall, tallies = timed_generate(engine, prompts, params, decoding == "ar", clock)
            rates[mode].append(sum(len(q.output_ids) for q in reqs) / wall)
            passes[mode].append(tallies)
            ids[mode] = [q.output_ids for q in reqs]
        print(f"repeat {r + 1}: " + ", ".join(f"{m} {v[-1]:.1f}" for m, v in rates.items()) + " tok/s", flush=True)
    engine.runner.prefills = graphs
    same = all(ids[m] == ids["ar eager"] for m in MODES)
    result = {"provenance": collect(engine.device, str(engine.dtype)), "command": " ".join(sys.argv),
              "batch_size": args.batch_size, "waves": args.waves, "max_new_tokens": args.max_new_tokens,
              "prompts": len(prompts), "dataset": args.dataset, "ignore_eos": params.ignore_eos,
              "mechanisms": sorted(engine.mechanisms), "prefill_graphs": sorted(graphs),
              "tok_s": {m: spread(v) for m, v in rates.items()}, "ids_equal": same, "passes": passes}
    write_json(out_dir(args.out) / "prefill_graphs.json", result)
    med = {m: statistics.median(v) for m, v in rates.items()}
    print("tok/s median: " + ", ".join(f"{m} {med[m]:.1f} ({med[m] / med['ar eager']:.2f}x)" for m in MODES)
          + f"; ids equal: {same}")
    for kind in clock:
        print(f"{kind} passes / seconds (last repeat): "
              + ", ".join(f"{m} {p[-1][kind]['passes']} / {p[-1][kind]['s']:.3f} s" for m, p in passes.items()))


if __name__ == "__main__":
    main()
