"""What following a stream's text costs the event loop: S streams of the embedded tokenizer's ids growing by
a speculative step's few tokens at a time to N tokens, the text decoded whole each step (the server before
server/detokenize.py) and incrementally, interleaved; mean ms a step for all streams, median and range of the
repeats. Any machine (the tokenizer runs on the host).

    python benchmarks/detokenize_cost.py [--streams 32] [--tokens 512] [--per-step 3] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specpilot.bench.datasets import load_prompts
from specpilot.bench.provenance import collect
from specpilot.models.checkpoint import load_checkpoint
from specpilot.server.detokenize import IncrementalText


def whole(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def incremental(tokenizer):
    return IncrementalText(tokenizer).update


def run(make, tokenizer, outputs: list[list[int]], per_step: int) -> float:
    """Mean seconds a step spends following every stream's text."""
    followers = [make(tokenizer) for _ in outputs]
    steps = max(len(o) for o in outputs) // per_step
    start = time.perf_counter()
    for s in range(1, steps + 1):
        for follow, ids in zip(followers, outputs):
            follow(ids[: s * per_step])
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--per-step", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tokenizer = load_checkpoint(None).tokenizer
    texts = [" ".join(m["content"] for m in p.messages) for p in load_prompts("sharegpt", args.streams)]
    outputs = [(tokenizer.encode(t, add_special_tokens=False) * 8)[: args.tokens] for t in texts]
    ms: dict[str, list[float]] = {"whole": [], "incremental": []}
    for _ in range(args.repeats):
        ms["whole"].append(run(whole, tokenizer, outputs, args.per_step) * 1e3)
        ms["incremental"].append(run(incremental, tokenizer, outputs, args.per_step) * 1e3)
    report = {"provenance": collect(None, None), "args": vars(args),
              "ms_per_step": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in ms.items()}}
    for k, v in report["ms_per_step"].items():
        print(f"{k:12s} {v['median']:.3f} ms a step ({v['min']:.3f}-{v['max']:.3f}) for {args.streams} streams")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "detokenize_cost.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
