"""`overlap` on and off: the engine's AR step (host work included) against its decode graph's replay, on
Llama-3.1-8B shapes with synthetic bf16 weights (or `--target embedded`: the embedded model, through the ferry),
per batch size. Two AR engines over the same weights (one with
`--mechanisms overlap`), interleaved `--repeats` times; rows give median, min and max, the step over the graph
(issue goal: <= 1.10 at B=32) and whether both decoded the same tokens.

    python benchmarks/ar_overlap.py [--out DIR] [--batch 1 8 32] [--repeats 3] [--target llama8b|embedded]
        [--smoke]   (--smoke: tiny, CPU)
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LLAMA31_8B, out_dir, synthetic_model, time_cuda, write_json  # noqa: E402
from gpu_spec import TINY, per_step  # noqa: E402

from specpilot.bench.harness import spread  # noqa: E402
from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402
from specpilot.models.checkpoint import Checkpoint  # noqa: E402
from specpilot.state.graphs import GraphBackend, eager_capture  # noqa: E402

MODES = {"plain": frozenset(), "overlap": frozenset({"overlap"})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--target", choices=["llama8b", "embedded"], default="llama8b")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (the graphs' eager stand-in)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        GraphBackend.capture = staticmethod(eager_capture)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    config = EngineConfig(device=device.type, dtype=str(dtype).removeprefix("torch."),
                          max_running_requests=max(args.batch), context_length=args.context + args.new_tokens + 32)
    if args.target == "embedded":
        first = Engine.from_config(replace(config, mechanisms=MODES["plain"]))
        ckpt, model, cfg = first.checkpoint, first.model, first.checkpoint.config
    else:
        cfg = TINY if args.smoke else LLAMA31_8B
        model = synthetic_model(cfg, device, dtype)
        ckpt, first = Checkpoint(config=cfg, state_dict={}, tokenizer=None, source="synthetic"), None
    engines = {mode: first if mode == "plain" and first is not None else Engine(ckpt, replace(config, mechanisms=m),
                                                                                  model=model)
               for mode, m in MODES.items()}
    rng = random.Random(0)
    rows = []
    for b in args.batch:
        prompts = [[rng.randrange(cfg.vocab_size) for _ in range(args.context)] for _ in range(b)]
        for engine in engines.values():  # warm-up: first-call costs stay out of the timings
            per_step(engine, prompts, 4)
        steps: dict[str, list[float]] = {mode: [] for mode in engines}
        outputs: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):
            for mode, engine in engines.items():
                ms, _, reqs = per_step(engine, prompts, args.new_tokens)
                steps[mode].append(1e3 * ms)
                outputs[mode] = [r.output_ids for r in reqs]
        graph = engines["plain"].runner.graph_for(1, b)
        graph_ms = time_cuda(graph.graph.replay) if device.type == "cuda" and graph is not None else None
        row = {"batch": b, "graph_decode_ms": graph_ms, "same_tokens": outputs["plain"] == outputs["overlap"]}
        for mode in engines:
            row[f"{mode}_step_ms"] = spread(steps[mode])
            if graph_ms:
                row[f"{mode}_over_graph"] = row[f"{mode}_step_ms"]["median"] / graph_ms
        rows.append(row)
        over = (f", over the graph {row['plain_over_graph']:.3f} -> {row['overlap_over_graph']:.3f}"
                if graph_ms else "")
        print(f"B={b:>3}: AR step {row['plain_step_ms']['median']:.3f} ms -> {row['overlap_step_ms']['median']:.3f} "
              f"with overlap (graph {graph_ms or float('nan'):.3f} ms){over}; same tokens {row['same_tokens']}")
    result = {"provenance": collect(device, str(dtype)), "command": " ".join(sys.argv),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
              "target": ckpt.source if args.target == "embedded" else "Llama-3.1-8B shapes, synthetic bf16"
              if not args.smoke else "tiny llama", "context":
              args.context, "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}
    write_json(out_dir(args.out) / "ar_overlap.json", result)


if __name__ == "__main__":
    main()
