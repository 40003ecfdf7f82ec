"""What keyed sampling costs a step: B rows of the embedded model's vocabulary at T=0.8 / top-p 0.95, each its
own seed and position, sampled row by row (keyed_sample per row, the engine's loop before batching; up to
--loop-max rows) and together (keyed_sample_rows), interleaved; checks both give the same tokens; then the
together call's two stages alone (the distribution with its top-p cut, target_probs; the keyed draw,
keyed_argmax). 512 rows: a B=32 verify of 16 tokens. Median and range of the repeats, ms per call.

    python benchmarks/sampling_cost.py --device cpu|cuda [--batch 1 8 32 512] [--repeats 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import timed_ms  # noqa: E402

from specpilot.bench import provenance  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.engine.sampling import as_seeds, keyed_sample, keyed_sample_rows, target_probs  # noqa: E402
from specpilot.kernels.keyed_argmax import keyed_argmax  # noqa: E402

VOCAB = 49152  # SmolLM2's
PARAMS = SamplingParams(temperature=0.8, top_p=0.95)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 512])
    ap.add_argument("--loop-max", type=int, default=32, help="the per-row loop only up to this many rows")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    report = {"provenance": provenance.collect(device, "float32"), "vocab": VOCAB, "params": "T=0.8, top-p 0.95",
              "ms": {}}
    for b in args.batch:
        logits = (torch.randn(b, VOCAB, generator=g) * 4).to(device)
        seeds, positions = list(range(7, 7 + b)), torch.arange(b, device=device) * 3
        rows = lambda: torch.cat([keyed_sample(logits[i : i + 1], PARAMS, seeds[i], positions[i : i + 1])  # noqa: E731
                                  for i in range(b)])
        together = lambda: keyed_sample_rows(logits, [PARAMS] * b, seeds, positions)  # noqa: E731
        probs = target_probs(logits, PARAMS)
        stages = {"target_probs": lambda: target_probs(logits, PARAMS),
                  "keyed_argmax": lambda: keyed_argmax(probs, as_seeds(seeds, device), positions)}
        fns = ({"per_row": rows} if b <= args.loop_max else {}) | {"together": together} | stages
        if b <= args.loop_max and not torch.equal(rows(), together()):
            raise SystemExit(f"B={b}: the batched samples differ from the per-row ones")
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                times[name].append(timed_ms(fn, device))
        report["ms"][str(b)] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in times.items()}
        m = report["ms"][str(b)]
        print(f"B={b:3d}: " + ", ".join(f"{k} {v['median']:.3f} ms ({v['min']:.3f}-{v['max']:.3f})" for k, v in m.items()))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"sampling_cost_{device.type}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
