"""What a step mechanism that can be switched per run (`budget`, `two-level`, `ragged`) does to offline throughput:
one engine (the embedded model and its DFlash drafter as serve runs it: the shipped profile, the device's default
mechanisms), a batch of ShareGPT
prompts decoded AR, with speculation as the defaults run it, and with the mechanism on (`ragged`: two-level
without it, then with it); the modes interleaved per repeat, output ids checked equal. Reports tokens per
second (median and range), accept length, and the mechanism's own report at the end. `two-level` reads the
cost table of this device and model, profiled first where none is cached (`specpilot bench
--profile-cost-table`'s grid). `--waves K` sends K batches' worth of prompts, so the engine refills its batch as
requests end: one wave's tail (requests reaching their length at different steps, the last steps running few of
them) is a cost only speculation pays; K waves make it a K-th as large.

    python benchmarks/mechanism_cost.py [--mechanism budget|two-level|ragged] [--device cpu] [--batch-size 32]
        [--max-new-tokens 48] [--topk K] [--waves 1] [--prefill-waves 1] [--repeats 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_cost_table, out_dir, pass_clock, shipped_config, timed_generate, write_json  # noqa: E402

from specpilot.bench.datasets import apply_chat_template, load_prompts  # noqa: E402
from specpilot.bench.harness import spread  # noqa: E402
from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.engine.budget import SpeculationBudget  # noqa: E402
from specpilot.engine.cost_table import key_for, load_cost_table  # noqa: E402
from specpilot.engine.engine import Engine  # noqa: E402
from specpilot.engine.two_level import VerifyLengths  # noqa: E402

COST_GRID = ([1, 2, 4, 8, 16, 32], [1, 2, 4, 8, 16])  # batch sizes, rows per request
STAGES = ("propose", "plan", "verify", "accept", "commit", "prepare")


def _stage_clock(engine: Engine) -> dict[str, float]:
    """Host seconds per speculative stage, summed into the returned dict as the stages run (a stage that syncs, e.g. plan
    under two-level or accept, also holds the wait for the device work before it)."""
    spent = dict.fromkeys(STAGES, 0.0)
    step = engine.speculation
    for name in STAGES:
        stage = getattr(step, name)

        def timed(*args, stage=stage, name=name):
            start = time.perf_counter()
            try:
                return stage(*args)
            finally:
                spent[name] += time.perf_counter() - start

        setattr(step, name, timed)
    return spent


def _engine(args: argparse.Namespace) -> Engine:
    """The device's default mechanisms, plus `two-level` (its graphs of every width, and `ragged`'s where that
    is measured) when it is measured; the mechanism is switched on and off between runs by setting its engine
    and step attributes, so all modes share one engine, its weights and graphs."""
    config = shipped_config(args.device, max_running_requests=args.batch_size, context_length=args.context,
                            max_total_tokens=args.batch_size * args.context, min_prefill_batch=args.prefill_waves)
    config = replace(config, speculative_eagle_topk=args.topk) if args.topk else config
    engine = Engine.from_config(config)
    if args.mechanism in ("two-level", "ragged"):
        ensure_cost_table(engine, [b for b in COST_GRID[0] if b <= args.batch_size], COST_GRID[1], args.context // 2)
        added = {"two-level"} | ({"ragged"} if args.mechanism == "ragged" else set())
        engine = Engine(engine.checkpoint, replace(engine.config, mechanisms=engine.mechanisms | added),
                        model=engine.model, cache=engine.cache)
    return engine


def _switch(engine: Engine, measured: str, mode: str) -> dict | None:
    """Sets the engine up for the next run's mode ("ar" and "spec" without the measured mechanism; a mechanism's
    name with it on; "ragged" is two-level with ragged graphs); returns the state of the run before (its report)."""
    if measured == "budget":
        before, engine.budget = engine.budget, SpeculationBudget() if mode == "budget" else None
    else:
        table = load_cost_table(key_for(engine.device, engine.checkpoint.source, engine.dtype, engine.exact))
        on = mode in ("two-level", "ragged")
        before, engine.verify_lengths = engine.verify_lengths, VerifyLengths(table) if on else None
        step = engine.speculation
        step.mechanisms = step.mechanisms - {"ragged"} | ({"ragged"} if mode == "ragged" else set())
    return None if before is None else before.as_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mechanism", choices=("budget", "two-level", "ragged"), default="budget")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--context", type=int, default=1024, help="KV positions a request may reach")
    ap.add_argument("--topk", type=int, default=None, help="draft tree top-k (default: the shipped profile's; 1: chains)")
    ap.add_argument("--dataset", default="sharegpt", help="the prompts' dataset (specpilot.bench.datasets)")
    ap.add_argument("--waves", type=int, default=1, help="batches' worth of prompts (the batch refills as they end)")
    ap.add_argument("--prefill-waves", type=int, default=1,
                    help="free slots that admit waiting prompts while requests run (EngineConfig.min_prefill_batch)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = _engine(args)
    engine.warm_up()
    prompts = [apply_chat_template(engine.tokenizer, p)
               for p in load_prompts(args.dataset, args.waves * args.batch_size)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    on = args.mechanism
    modes = ["ar", "spec", *(["two-level"] if on == "ragged" else []), on]
    rates: dict[str, list[float]] = {m: [] for m in modes}
    tau: dict[str, list[float]] = {m: [] for m in modes[1:]}
    stage_ms: dict[str, list[dict[str, float]]] = {m: [] for m in modes[1:]}  # host ms per step, per stage
    spent = _stage_clock(engine)
    clock = pass_clock(engine)
    pass_runs: dict[str, list[dict]] = {m: [] for m in modes}  # prefill and decode passes and seconds per run
    ids, reports = {}, []
    for r in range(args.repeats):
        for mode in rates:
            report = _switch(engine, on, mode)
            if report is not None:
                reports.append(report)
            engine.reset_spec_stats()
            spent.update(dict.fromkeys(spent, 0.0))
            reqs, wall, tallies = timed_generate(engine, prompts, params, mode == "ar", clock)
            if mode != "ar":
                tau[mode].append(engine.spec_stats.tau)
                passes = engine.spec_stats.steps / args.batch_size  # verify steps, roughly (the batch drains)
                stage_ms[mode].append({k: round(1e3 * v / passes, 3) for k, v in spent.items()})
            rates[mode].append(sum(len(q.output_ids) for q in reqs) / wall)
            pass_runs[mode].append(tallies)
            ids[mode] = [q.output_ids for q in reqs]
        print(f"repeat {r + 1}: " + ", ".join(f"{m} {v[-1]:.1f} tok/s" for m, v in rates.items()), flush=True)
    reports.append(_switch(engine, on, "spec"))
    same = all(ids[m] == ids["ar"] for m in modes)
    result = {"provenance": collect(engine.device, str(engine.dtype)), "command": " ".join(sys.argv),
              "mechanism": on, "batch_size": args.batch_size, "waves": args.waves, "prefill_waves": args.prefill_waves,
              "max_new_tokens": args.max_new_tokens,
              "mechanisms": sorted(engine.mechanisms | {on}), "tok_s": {m: spread(v) for m, v in rates.items()},
              "accept_length": {m: spread(v) for m, v in tau.items()}, "ids_equal_ar": same, "reports": reports,
              "host_ms_per_step": {m: {k: statistics.median(r[k] for r in runs) for k in STAGES}
                                   for m, runs in stage_ms.items()},
              "passes": pass_runs}
    write_json(out_dir(args.out) / f"{on.replace('-', '_')}_cost.json", result)
    med = {m: statistics.median(v) for m, v in rates.items()}
    print(f"tok/s median: AR {med['ar']:.1f}, " + ", ".join(f"{m} {med[m]:.1f} ({med[m] / med['ar']:.2f}x)" for m in modes[1:])
          + "; accept length " + ", ".join(f"{m} {statistics.median(v):.2f}" for m, v in tau.items())
          + f"; ids equal AR's: {same}; last report: {reports[-1]}")
    for kind in clock:
        print(f"{kind} passes / seconds / share of the run (last repeat): "
              + ", ".join(f"{m} {r[-1][kind]['passes']} / {r[-1][kind]['s']:.3f} s / {r[-1][kind]['share']:.0%}"
                          for m, r in pass_runs.items()))
    for m, ms in result["host_ms_per_step"].items():
        print(f"host ms per step, {m}: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items()))


if __name__ == "__main__":
    main()
