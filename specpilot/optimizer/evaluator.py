"""The sealed evaluator: a separate process (`python -P -s -m specpilot.optimizer.evaluator REQUEST.json`: no
current directory or user site on its path, so it imports the installed package and nothing from a
candidate's directory) that judges one candidate against stock on this deployment and prints its verdict as
JSON.

A profile candidate (settings of the installed engine):
1. Token forcing of the candidate against stock AR on a held-out prompt slice no agent sees (exact on the
   batch-invariant CUDA path).
2. Interleaved repeated runs on the benchmark slice, stock's profile and the candidate's turn about: the
   speedup per repeat, its median and range, and the noise band (stock's own run-to-run spread); one AR
   run for the gate below.
3. The plausibility gate: the candidate's speedup over AR may not exceed the cost model's ceiling over
   that AR run (every draft accepted, at the speculative step's floor).
Accepted: forcing passed, plausible, and shown faster than stock by the paired sign-flip test over the
interleaved repeats (each repeat pairs a stock run with the candidate's next to it, so slow drift of the
machine cancels; the noise band, stock's own spread across repeats, is recorded beside it). A patch candidate (code) runs in servers of its own
(optimizer/patched.py) under the same rule.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from specpilot.bench.datasets import apply_chat_template, load_prompts
from specpilot.bench.harness import tpot_ms
from specpilot.config import SamplingParams
from specpilot.costmodel.measure import speedup_ceiling
from specpilot.engine.config import EngineConfig
from specpilot.engine.engine import Engine
from specpilot.engine.registry import STOCK, Profile, ar_changes
from specpilot.forcing import run_forcing
from specpilot.optimizer.patched import evaluate_patch
from specpilot.optimizer.verdicts import Request, Verdict, decide


def _tpot_ms(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Mean TPOT of the prompts run one at a time (B=1, the latency regime)."""
    return tpot_ms([r for p in prompts for r in engine.generate([p], params)])


def evaluate_profile(request: Request) -> Verdict:
    start = time.perf_counter()
    base = EngineConfig.from_fields(request.config)
    try:
        candidate_cfg = Profile.parse(request.candidate, "the candidate").apply(base)
        stock_cfg = Profile.parse(request.stock, "the stock profile").apply(base)
        candidate = Engine.from_config(candidate_cfg)
    except ValueError as err:
        return Verdict(False, f"invalid candidate: {err}", seconds=time.perf_counter() - start)
    stock = Engine(candidate.checkpoint, stock_cfg, model=candidate.model)
    ar = candidate.twin(**ar_changes(candidate.config))
    texts = load_prompts(request.dataset, 2 * request.num_prompts)
    prompts = [apply_chat_template(candidate.tokenizer, p) for p in texts]
    bench, held_out = prompts[: request.num_prompts], prompts[request.num_prompts :]
    params = SamplingParams(max_new_tokens=request.max_new_tokens, ignore_eos=True)

    verdict = run_forcing(ar, candidate, held_out, params, "candidate")
    forcing = verdict.as_dict()
    if not verdict.passed:
        return Verdict(False, f"forcing failed: {verdict.non_tie_mismatches} mismatches, {verdict.row_mismatches} "
                       "rows differing", forcing, seconds=time.perf_counter() - start)

    for engine in (stock, candidate, ar):
        engine.warm_up()
    runs: dict[str, list[float]] = {"stock": [], "candidate": []}
    for _ in range(request.repeats):  # interleaved, so drift hits both sides alike
        runs["stock"].append(_tpot_ms(stock, bench, params))
        runs["candidate"].append(_tpot_ms(candidate, bench, params))
    # AR only bounds the claim (the plausibility gate): one run after the candidate's
    ar_ms = _tpot_ms(ar, bench, params)
    over_ar = ar_ms / statistics.median(runs["candidate"])
    context = int(statistics.mean(len(p) for p in bench) + request.max_new_tokens / 2)
    is_stock = request.stock.get("mechanisms") == STOCK and not request.stock.get("tunables")
    reference = "stock" if is_stock else "the profile it is set against"
    return decide(runs["stock"], runs["candidate"], over_ar, speedup_ceiling(candidate, ar_ms, context), forcing,
                  time.perf_counter() - start, reference=reference)


def evaluate(request: Request) -> Verdict:
    """A patch candidate in servers of its own, a profile candidate in this process."""
    return evaluate_patch(request) if request.patch is not None else evaluate_profile(request)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -P -s -m specpilot.optimizer.evaluator REQUEST.json", file=sys.stderr)
        return 2
    path = Path(argv[0])
    request = Request(**json.loads(path.read_text()))
    verdict = evaluate(request)
    print(json.dumps(asdict(verdict)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
