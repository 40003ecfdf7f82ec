"""H200: where a speculative step's time goes, embedded target + shipped DFlash drafter, at B=1 or a batch.

For each configuration, HumanEval prompts are generated greedily --batch-size at a time (AR, then speculative;
a batch's requests ignore EOS, so it stays whole);
a step's time (speculative TPOT x tau) is compared with the device time of its CUDA graphs (verify,
acceptance, the drafter's prep, body and tree build), each replayed back to back and all of them chained
in step order, with no host work between them: the rest is time the GPU waits (host work, launch gaps,
eager kernels). Each graph's kernels are listed by name with their count and device time per replay, and
one request decoded under the profiler shows where the device sits idle (the gaps between what it ran,
by the work on either side).

    python benchmarks/gpu_step_profile.py [--out DIR] [--num-prompts 8] [--topk 1 4] [--assist 0 2]
        [--temperature T --top-p P] [--batch-invariant 1 0] [--batch-size 32 --num-prompts 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, time_cuda, write_json  # noqa: E402

from specpilot.bench.datasets import apply_chat_template, load_prompts  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402

BLOCK = 16


def replay_ms(graph, reps: int = 20) -> float:
    """Device milliseconds of one replay: `reps` replays back to back, so launches overlap execution."""
    def run() -> None:
        for _ in range(reps):
            graph.replay()
    return time_cuda(run, iters=20) / reps


def chain_ms(graphs: list, reps: int = 20) -> float:
    """Device milliseconds of one pass through `graphs` replayed in order, back to back: a step's graphs
    with no host work between them (against the sum of their bare replays: the cost of switching)."""
    def run() -> None:
        for _ in range(reps):
            for g in graphs:
                g.replay()
    return time_cuda(run, iters=10) / reps


def kernels(graph, reps: int = 10) -> dict:
    """What one replay runs: its kernels (count, summed device time) grouped by name, longest first; the
    gap between the replay's time and its kernels' time is launch latency between them."""
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    table = [(e.key, e.count / reps, e.device_time_total / reps) for e in prof.key_averages()
             if e.device_time_total > 0 and e.count > 0]
    table.sort(key=lambda row: -row[2])
    return {"kernels": sum(c for _, c, _ in table), "kernel_us": sum(t for _, _, t in table),
            "by_name": [{"name": n[:90], "count": c, "us": round(t, 2)} for n, c, t in table]}


def idle_gaps(spans: list[tuple[str, float, float]], steps: int, top: int = 12) -> dict:
    """Where the GPU waits in a real run: `spans` (kernel or copy name, start us, end us) of everything
    the device ran; the gaps between them are grouped by (what ran before, what ran after), largest
    total first, and averaged over `steps` speculative steps."""
    spans = sorted(spans, key=lambda s: s[1])
    groups: dict[tuple[str, str], list[float]] = {}
    busy_end, prev, idle = spans[0][2], spans[0][0], 0.0
    for name, start, end in spans[1:]:
        if start > busy_end:
            groups.setdefault((prev[:50], name[:50]), []).append(start - busy_end)
            idle += start - busy_end
        if end >= busy_end:
            busy_end, prev = end, name
    span = busy_end - spans[0][1]
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"span_us_per_step": span / steps, "idle_us_per_step": idle / steps,
            "gaps": [{"before": b, "after": a, "count": len(g), "us_per_step": sum(g) / steps} for (b, a), g in ranked]}


def timeline(engine: Engine, batch: list[list[int]], params: SamplingParams) -> dict:
    """One batch decoded under the profiler (device activity only, so the host runs at its own pace)."""
    engine.reset_spec_stats()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(batch, params)
        torch.cuda.synchronize()
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return idle_gaps(spans, max(engine.spec_stats.steps, 1))


def tpot_ms(engine: Engine, prompts: list[list[int]], params: SamplingParams, batch: int) -> tuple[float, int]:
    """Mean time per output token after the first (as `specpilot bench` reports it), the prompts `batch` at a
    time, and the tokens generated."""
    reqs = [r for i in range(0, len(prompts), batch) for r in engine.generate(prompts[i : i + batch], params)]
    tpots = [(r.finished_time - r.first_token_time) / (len(r.output_ids) - 1) for r in reqs if len(r.output_ids) > 1]
    return 1e3 * statistics.mean(tpots), sum(len(r.output_ids) for r in reqs)


def profile(topk: int, assist: int, invariant: bool, prompts: list[list[int]], params: SamplingParams,
            batch: int) -> dict:
    engine = Engine.from_config(EngineConfig(
        device="cuda", speculative_algorithm="dflash", speculative_num_draft_tokens=BLOCK,
        speculative_eagle_topk=topk, speculative_ngram_assist=assist, max_running_requests=max(8, batch),
        batch_invariant=invariant))
    engine.warm_up()
    with engine.autoregressive():
        ar_ms, _ = tpot_ms(engine, prompts, params, batch)
    engine.reset_spec_stats()
    spec_ms, tokens = tpot_ms(engine, prompts, params, batch)
    stats = engine.spec_stats
    drafter = engine.drafter.model if assist else engine.drafter  # under the lookup wrapper
    b = min(size for q, size in engine.runner.graphs if q == 1 and size >= batch)  # the batch's graph bucket
    draft = drafter.graphs[b]
    step = engine.speculation
    graphs = {"ar_graph": engine.runner.graphs[(1, b)].graph, "verify_graph": engine.runner.graphs[(BLOCK, b)].graph,
              "acceptance_graph": step.acceptance[(BLOCK, b)].graph, "draft_prep_graph": draft.preps[0][1] if draft.preps else None,
              "draft_body_graph": draft.graph, "draft_tree_graph": draft.tree_graph,
              "tree_placement_graph": step.placement.get(b)}
    bare = {k: replay_ms(g) if g is not None else 0.0 for k, g in graphs.items()}
    step_graphs = [g for k, g in graphs.items() if k != "ar_graph" and g is not None]
    chained = chain_ms(step_graphs)
    kernel_tables = {k: kernels(g) for k, g in graphs.items() if g is not None}
    waits = timeline(engine, prompts[:batch], params)
    step_ms = spec_ms * stats.tau  # a verify pass commits tau tokens a request, the batch's requests together
    return {
        "batch_size": batch, "graph_bucket": b, "topk": topk, "assist": assist, "batch_invariant": invariant, "tau": stats.tau, "steps": stats.steps, "tokens": tokens,
        "ar_tpot_ms": ar_ms, "spec_tpot_ms": spec_ms, "speedup": ar_ms / spec_ms, "step_ms": step_ms,
        "step_split_ms": {k: 1e3 * v / stats.steps for k, v in stats.time_split(wait=True).items()},
        "bare_replay_ms": bare, "chained_step_graphs_ms": chained, "kernels": kernel_tables, "timeline": waits,
        "host_exposed_ms": step_ms - sum(v for k, v in bare.items() if k != "ar_graph"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--topk", type=int, nargs="+", default=[1, 4])
    p.add_argument("--assist", type=int, nargs="+", default=[0, 2])
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: keyed sampling (seed 1)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--batch-invariant", type=int, nargs="+", choices=[0, 1], default=[1],
                   help="1: the batch-invariant kernels (the default path), 0: the fastest kernel per pass")
    p.add_argument("--batch-size", type=int, default=1, help="requests decoded together (ignoring EOS where > 1)")
    args = p.parse_args()
    if args.num_prompts < args.batch_size:
        p.error(f"--num-prompts ({args.num_prompts}) must be at least --batch-size ({args.batch_size})")
    out = out_dir(args.out)
    probe = Engine.from_config(EngineConfig(device="cuda", cuda_graphs=False, max_running_requests=1))
    prompts = [apply_chat_template(probe.tokenizer, q) for q in load_prompts("humaneval", args.num_prompts)]
    del probe
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=1 if args.temperature > 0 else None, ignore_eos=args.batch_size > 1)
    rows = [profile(k, a, bool(i), prompts, params, args.batch_size) for i in args.batch_invariant for k in args.topk
            for a in args.assist]
    write_json(out / "step_profile.json", rows)
    print("inv topk assist   tau  AR TPOT  spec TPOT  speedup  step ms (draft/verify/other)  "
          "bare AR/verify/accept/prep/body/tree  chained  exposed")
    for r in rows:
        s, b = r["step_split_ms"], r["bare_replay_ms"]
        bare = "/".join(f"{b[k]:.3f}" for k in ("ar_graph", "verify_graph", "acceptance_graph", "draft_prep_graph",
                                                "draft_body_graph", "draft_tree_graph"))
        print(f"{r['batch_invariant']:3d} {r['topk']:4d} {r['assist']:6d} {r['tau']:5.2f} {r['ar_tpot_ms']:8.3f} {r['spec_tpot_ms']:10.3f} "
              f"{r['speedup']:8.2f}  {r['step_ms']:.3f} ({s['draft']:.3f}/{s['verify']:.3f}/{s['other']:.3f})  "
              f"{bare}  {r['chained_step_graphs_ms']:.3f}  {r['host_exposed_ms']:.3f}")
    for r in rows:
        print(f"-- kernels per replay, invariant {r['batch_invariant']} topk {r['topk']} assist {r['assist']}")
        for name, t in r["kernels"].items():
            top = ", ".join(f"{k['name'][:40]} {k['count']:g}x {k['us']:.1f}us" for k in t["by_name"][:6])
            print(f"{name}: {t['kernels']:g} kernels, {t['kernel_us']:.1f} us of kernels, "
                  f"replay {1e3 * r['bare_replay_ms'][name]:.1f} us | {top}")
        t = r["timeline"]
        print(f"-- device idle in a profiled run: {t['idle_us_per_step']:.1f} of {t['span_us_per_step']:.1f} us "
              "per step; largest gaps (before -> after: us per step, count):")
        for g in t["gaps"]:
            print(f"   {g['before']} -> {g['after']}: {g['us_per_step']:.1f} us, {g['count']}x")

if __name__ == "__main__":
    main()
