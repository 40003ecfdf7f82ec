"""Where a speculative step's host work goes, by stage, for each mechanism set: the torch operators each stage
dispatches outside graph replays — on a GPU each is a kernel launch or a copy the host issues (microseconds of
host time apiece), against a graph replay's one — and the stage's host time. Runs on CPU: the graphs are the
tests' eager stand-ins (their replays not counted), the target tiny, the acceptance replayed from a confidence
trace at a chosen τ as benchmarks/gpu_spec.py replays it on the device, so two-level and ragged choose as there.

    python benchmarks/step_host_ops.py [--out DIR] [--batch 16] [--steps 12] [--tau 6.5]
        [--mechanisms default +two-level,+ragged] [--smoke]   (--smoke: 4 requests, 3 steps)

Operators that only view a tensor (no kernel) are left out. A stage's host time here includes the tiny model's
CPU work outside replays; its operator count is what carries over to the device.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_cost_table, out_dir, synthetic_model, write_json  # noqa: E402
from gpu_spec import TINY, dflash_factory  # noqa: E402

from specpilot.bench.replay import AcceptTrace, ReplayDrafter  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402
from specpilot.engine.registry import parse_mechanisms  # noqa: E402
from specpilot.models.checkpoint import Checkpoint  # noqa: E402
from specpilot.state.graphs import EagerReplay, GraphBackend, eager_capture  # noqa: E402

STAGES = ("propose", "plan", "verify", "accept", "commit", "prepare")
TRACE = "docs/results/2026-12-06_cpu_s31/confidence_trace_humaneval.json"


class OpCounter(TorchDispatchMode):
    """Counts the operators dispatched outside graph replays, by the stage in `stage[0]`."""

    def __init__(self) -> None:
        super().__init__()
        self.stage = ["other"]
        self.replaying = 0
        self.ops: dict[str, Counter] = defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.replaying and not func.is_view:
            self.ops[self.stage[0]][func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_replays(counter: OpCounter):
    """Graph replays (eager stand-ins) run uncounted: on the device each is one launch."""
    original = EagerReplay.replay

    def replay(self) -> None:
        counter.replaying += 1
        try:
            original(self)
        finally:
            counter.replaying -= 1

    EagerReplay.replay = replay
    try:
        yield
    finally:
        EagerReplay.replay = original


def staged(engine: Engine, counter: OpCounter, seconds: dict[str, float]) -> None:
    """Each stage of the engine's speculative step tags the operators it dispatches and adds up its host time."""
    step = engine.speculation
    for name in STAGES:
        original = getattr(step, name)

        def wrapped(*args, _original=original, _name=name):
            outer, counter.stage[0] = counter.stage[0], _name
            start = time.perf_counter()
            try:
                return _original(*args)
            finally:
                seconds[_name] += time.perf_counter() - start
                counter.stage[0] = outer
        setattr(step, name, wrapped)


def run_set(name: str, mechanisms: str, args: argparse.Namespace, trace: AcceptTrace) -> dict:
    cfg = TINY
    model = synthetic_model(cfg, torch.device("cpu"), torch.float32)
    ckpt = Checkpoint(config=cfg, state_dict={}, tokenizer=None, source="synthetic")
    tokens = args.steps * 16 + 32
    config = EngineConfig(device="cpu", dtype="float32", max_running_requests=args.batch, cuda_graphs=True,
                          context_length=args.context + tokens + 32,
                          mechanisms=None if mechanisms == "default" else parse_mechanisms(mechanisms))
    reference: dict[str, list[int]] = {}
    dflash = dflash_factory(cfg, 5, 16)

    def factory(config: EngineConfig, ctx) -> ReplayDrafter:
        return ReplayDrafter(dflash(config, ctx), reference, trace, cfg.vocab_size)

    if config.asks_for("two-level"):
        ensure_cost_table(Engine(ckpt, replace(config, speculative_algorithm=None, mechanisms=None), model=model),
                          [args.batch], [1, 2, 4, 8, 16], args.context)
    engine = Engine(ckpt, config, model=model, drafter_factory=factory)
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size - 1) for _ in range(args.context)] for _ in range(args.batch)]
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    with engine.autoregressive():
        reqs = [engine.add_request(p, params, rid=f"r{i}") for i, p in enumerate(prompts)]
        while engine.has_work:
            engine.step()
    reference.update({r.rid: r.output_ids for r in reqs})
    for i, p in enumerate(prompts):
        engine.add_request(p, params, rid=f"r{i}")
    engine.step()  # prefill
    for _ in range(3):  # warm: first-step work (graph stand-ins, caches) stays out
        engine.step()
    counter, seconds = OpCounter(), defaultdict(float)
    staged(engine, counter, seconds)
    start = time.perf_counter()
    with counting_replays(counter), counter:
        for _ in range(args.steps):
            engine.step()
    wall = time.perf_counter() - start
    while engine.has_work:
        engine.step()
    per_step = {s: sum(counter.ops[s].values()) / args.steps for s in (*STAGES, "other")}
    return {"set": name, "mechanisms": sorted(engine.mechanisms), "steps": args.steps,
            "ops_per_step": per_step, "ops_total_per_step": sum(per_step.values()),
            "host_ms_per_step": {s: 1e3 * seconds[s] / args.steps for s in STAGES},
            "step_ms": 1e3 * wall / args.steps,
            "top_ops": {s: counter.ops[s].most_common(12) for s in STAGES if counter.ops[s]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12, help="steps counted (after a prefill and 3 warm steps)")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--tau", type=float, default=6.5, help="the replayed trace scaled to this tau")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--mechanisms", nargs="+", default=["default", "+two-level,+ragged"])
    ap.add_argument("--smoke", action="store_true", help="4 requests, 3 steps, context 16: checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.steps, args.context = 4, 3, 16
    torch.manual_seed(0)
    trace = AcceptTrace.load(args.trace).scaled_to(args.tau)
    GraphBackend.capture = staticmethod(eager_capture)
    rows = [run_set(m, m, args, trace) for m in args.mechanisms]
    write_json(out_dir(args.out) / "step_host_ops.json", {"batch": args.batch, "tau": args.tau, "trace": args.trace,
                                                          "rows": rows})
    print(f"operators dispatched per step outside graph replays, by stage (B={args.batch}, replayed tau {args.tau}; "
          "host ms a step in brackets, CPU)")
    print(f"{'set':>24} " + " ".join(f"{s:>14}" for s in STAGES) + f" {'other':>6} {'total':>6}")
    for r in rows:
        cells = " ".join(f"{r['ops_per_step'][s]:>6.1f} ({r['host_ms_per_step'][s]:>5.2f})" for s in STAGES)
        print(f"{r['set']:>24} {cells} {r['ops_per_step']['other']:>6.1f} {r['ops_total_per_step']:>6.1f}")
    for r in rows:
        print(f"\n{r['set']}: the most frequent operators by stage")
        for stage, top in r["top_ops"].items():
            print(f"  {stage:>8}: " + ", ".join(f"{op} {n / args.steps:.1f}" for op, n in top))


if __name__ == "__main__":
    main()
