"""How far a verify policy could take speculation at a batch, from measured parts and no device: a cost table
T(B, rows per request), the step's other graphs (the drafter's body, acceptance) and the AR step, all from a
`gpu_spec.py` run, and an acceptance trace scaled to a tau. Per batch, throughput over AR of:

  whole block   every request verifies the whole block (what the defaults do)
  width w       every request verifies w rows (w - 1 drafts and the anchor), w from the table's columns: the best
                one uniform width can do (two-level under graphs of one width)
  level 1, best  level 1 of two-level (engine/two_level.VerifyLengths) choosing each request's drafts from this
                step's confidences — the trace's recorded ones of passes that accepted as many — at any row count,
                learning its calibration as it goes over --steps steps
  level 1, ragged graphs  as the engine runs it under `ragged`: the step's rows (one of the ragged graphs' row
                buckets) forecast from the last step's drafts, then the likeliest drafts filling them
  oracle        each request verifies exactly its accepted drafts and the anchor, packed without padding (ragged at
                its ideal): no policy that reads confidences can do better

A step is priced as T(B, rows) + draft + acceptance, the graphs alone (the measured step was 0.91-0.97x that sum);
tokens per step are E[min(accepted, w - 1)] + 1 over the trace. The trace's tau holds in the steady state; a timed
run's requests near their last tokens verify fewer drafts and reach less.

    python benchmarks/verify_bound.py --run docs/results/.../replay/gpu_spec.json --cost-table .../cost_table.json
            --trace docs/results/2026-12-06_cpu_s31/confidence_trace_humaneval.json --tau 6.5 [--set default] [--steps N]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402

from specpilot.bench.replay import AcceptTrace  # noqa: E402
from specpilot.engine.cost_table import CostTable  # noqa: E402
from specpilot.engine.two_level import VerifyLengths  # noqa: E402
from specpilot.state.graphs import ragged_token_buckets  # noqa: E402


def tokens_at(trace: AcceptTrace, width: int) -> float:
    """Tokens a pass commits when it verifies `width` rows: the accepted drafts among its width - 1, then one more."""
    return sum(p * (min(a, width - 1) + 1) for a, p in enumerate(trace.probs))


def level_one(table: CostTable, trace: AcceptTrace, batch: int, block: int, other_ms: float, steps: int,
              graphs: bool, seed: int = 0) -> tuple[float, float]:
    """Level 1's mean rows per request and tokens per request a step, over `steps` steps of `batch` sampled passes
    (the first half learning its calibration, the second measured); `graphs`: as under ragged graphs."""
    if not trace.passes:
        raise ValueError(f"{trace.source}: level 1 needs a confidence trace (recorded passes), not a histogram")
    rng, level = random.Random(seed), VerifyLengths(table)
    buckets = ragged_token_buckets(batch, block)
    rows = tokens = 0.0
    for step in range(steps):
        passes = [trace.sample_pass(rng) for _ in range(batch)]
        confidences = np.array([c for _, c in passes], dtype=np.float32)
        if graphs:
            lengths, step_rows = level.choose_rows_ahead(torch.from_numpy(confidences), buckets)
            lengths = lengths.tolist()
        else:
            lengths = level.choose(confidences.astype(np.float64))
            step_rows = batch + sum(lengths)
        kept = [min(a, n) for (a, _), n in zip(passes, lengths)]
        level.learn([list(range(k + 1)) for k in kept])
        level.observe(table.at(batch, step_rows / batch) + other_ms, batch, step_rows)
        if step >= steps // 2:
            rows += step_rows / batch
            tokens += sum(k + 1 for k in kept) / batch
    measured = steps - steps // 2
    return rows / measured, tokens / measured


def bounds(table: CostTable, trace: AcceptTrace, batch: int, block: int, draft_ms: float, accept_ms: float,
           ar_ms: float, steps: int) -> dict[str, dict[str, float]]:
    """Per policy: rows per request, tokens per step, step ms and throughput over AR."""
    def policy(rows: float, tokens: float) -> dict[str, float]:
        step = table.at(batch, rows) + draft_ms + accept_ms
        return {"rows": rows, "tokens": tokens, "step_ms": step, "over_ar": tokens / step * ar_ms}

    out = {"whole block": policy(block, tokens_at(trace, block))}
    out |= {f"width {w}": policy(w, tokens_at(trace, w)) for w in table.tokens if 2 <= w < block}
    if trace.passes:
        for name, graphs in (("level 1, best", False), ("level 1, ragged graphs", True)):
            out[name] = policy(*level_one(table, trace, batch, block, draft_ms + accept_ms, steps, graphs))
    out["oracle"] = policy(trace.tau, trace.tau)  # rows = accepted + 1 = tokens, per request
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a gpu_spec.py JSON with graph_draft_ms, graph_acceptance_ms and "
                                                 "ar_step_ms per batch")
    ap.add_argument("--cost-table", required=True, help="the same target's cost table (JSON)")
    ap.add_argument("--trace", required=True, help="a confidence trace or bench JSON (specpilot.bench.replay)")
    ap.add_argument("--tau", type=float, default=None, help="scale the trace to this tau (default: as recorded)")
    ap.add_argument("--set", default="default", help="the mechanism set of --run whose graphs price the step")
    ap.add_argument("--block", type=int, default=16, help="verify rows of the whole block")
    ap.add_argument("--steps", type=int, default=400, help="steps of level 1's simulation (half of them learning)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    run = json.loads(Path(args.run).read_text())
    table = CostTable.from_json(Path(args.cost_table).read_text())
    trace = AcceptTrace.load(args.trace)
    if args.tau is not None:
        trace = trace.scaled_to(args.tau)
    rows = []
    for row in run["rows"]:
        parts = row[args.set]
        b = row["batch"]
        result = bounds(table, trace, b, args.block, parts["graph_draft_ms"], parts["graph_acceptance_ms"] or 0.0,
                        parts["ar_step_ms"]["median"], args.steps)
        rows.append({"batch": b, "policies": result})
        print(f"B={b:3d}  " + "  ".join(f"{name}: {p['over_ar']:.2f}x ({p['rows']:.1f} rows, {p['tokens']:.2f} tokens, "
                                        f"{p['step_ms']:.1f} ms)" for name, p in result.items()))
    write_json(out_dir(args.out) / "verify_bound.json",
               {"run": args.run, "cost_table": args.cost_table, "trace": trace.source, "tau": trace.tau,
                "set": args.set, "rows": rows})


if __name__ == "__main__":
    main()
