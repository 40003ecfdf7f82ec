"""H200: one speculative step (DFlash-shaped draft + verify of a 16-token block) against one AR step,
on Llama-3.1-8B shapes with synthetic bf16 weights, through the real engine loop (host work included)
and as bare graph replays. A DFlash-shaped drafter: 5 layers at the target's width, 5 taps, block 16.

Today's fastest kernels and the batch-invariant ones run in one process (two engines over the same weights),
their AR and speculative runs interleaved `--repeats` times; rows give median, min and max. `--mechanisms` compares
mechanism sets instead (engines over the same weights, the default kernels): each a --mechanisms value, `default`
for the defaults; two-level reads the synthetic target's cost table, profiled first where none is cached.

    python benchmarks/gpu_spec.py [--out DIR] [--batch 1 8 32] [--repeats 3] [--smoke]   (--smoke: tiny, CPU)
        [--replay TRACE_OR_BENCH_JSON[:DATASET] [--replay-tau 6.5]] [--mechanisms stock default +two-level,+budget]
        [--tuned-tiles]

--replay: replayed acceptance (specpilot/bench/replay.py): the drafter's passes run as they are, but each verify
pass accepts a count drawn from a recorded run's acceptance (scaled to --replay-tau if given) of the target's own
AR tokens, recorded first per engine; rows are labelled so. From a confidence trace, each pass also carries the
confidences of a recorded pass that accepted as many (what two-level reads); from a bench JSON, one vector for all.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    LLAMA31_8B,
    QWEN35_STYLE_8B,
    TritonCompiles,
    ensure_cost_table,
    hybrid_config,
    out_dir,
    synthetic_hybrid,
    synthetic_model,
    time_cuda,
    write_json,
)

from specpilot.bench.harness import spread  # noqa: E402
from specpilot.bench.replay import LABEL, AcceptTrace, ReplayDrafter  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.drafters.base import DrafterContext  # noqa: E402
from specpilot.drafters.dflash import DFlashDrafter  # noqa: E402
from specpilot.drafters.dflash_model import DFlashConfig, DFlashModel  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402
from specpilot.engine.gemm_tiles import load_tile_table, save_tile_table, tune  # noqa: E402
from specpilot.engine.registry import parse_mechanisms  # noqa: E402
from specpilot.engine.spec_stats import SpecStats  # noqa: E402
from specpilot.models.checkpoint import Checkpoint  # noqa: E402
from specpilot.models.config import ModelConfig  # noqa: E402
from specpilot.models.linear import iter_linears  # noqa: E402
from specpilot.state.request import Request  # noqa: E402

TINY = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=8,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096)
TINY_HYBRID = hybrid_config({
    "model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 8, "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
    + ["full_attention"], "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4})
TARGETS = {"llama": (LLAMA31_8B, TINY, "Llama-3.1-8B shapes"), "hybrid": (QWEN35_STYLE_8B, TINY_HYBRID,
                                                                           "Qwen3.5-style hybrid at ~8B")}


def even_taps(num_layers: int, n: int) -> list[int]:
    """n taps spread evenly from layer 1 to L-3 (the published drafters' default)."""
    lo, hi = 1, num_layers - 3
    return [round(lo + i * (hi - lo) / (n - 1)) for i in range(n)]


def dflash_factory(target_cfg: ModelConfig, layers: int, block: int):
    def build(config: EngineConfig, ctx: DrafterContext) -> DFlashDrafter:
        lc = replace(target_cfg, architecture="qwen3", num_layers=layers, qk_norm=True, hybrid=None)
        cfg = DFlashConfig(lc, even_taps(target_cfg.num_layers, 5), mask_token_id=target_cfg.vocab_size - 1,
                           block_size=block)
        torch.manual_seed(1)
        with torch.device(ctx.device):
            model = DFlashModel(cfg).to(ctx.dtype)
        for name, p in model.named_parameters():
            p.data.uniform_(0.8, 1.2) if name.endswith("norm.weight") else p.data.normal_(0.0, 0.02)
        return DFlashDrafter(model.eval(), cfg, ctx.model, ctx.pages, ctx.context_length,
                             ctx.device, ctx.dtype)
    return build


def per_step(engine: Engine, prompts: list[list[int]], new_tokens: int,
             rids: list[str] | None = None) -> tuple[float, SpecStats, list[Request]]:
    """Mean wall time of a decode step (AR when the drafter is off), the spec stats of the run and its requests."""
    import time

    engine.spec_stats = SpecStats(block_size=engine.drafter.block_size if engine.drafter else 0)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params, rid=None if rids is None else rids[i]) for i, p in enumerate(prompts)]
    engine.step()  # prefill
    steps, start = 0, time.perf_counter()
    while engine.has_work:
        engine.step()
        steps += 1
    assert all(len(r.output_ids) == new_tokens for r in reqs)
    return (time.perf_counter() - start) / steps, engine.spec_stats, reqs


KERNELS = {"fastest": False, "invariant": True}  # EngineConfig.batch_invariant
COST_ROWS = (1, 2, 4, 8, 16)  # rows per request the cost table is profiled at


def variants(args: argparse.Namespace, config: EngineConfig, hybrid: bool) -> dict[str, EngineConfig]:
    """The engines' configs: the two kernel sets, or (`--mechanisms`) one per mechanism set on the default kernels
    (a hybrid runs plain torch either way)."""
    if not args.mechanisms:
        kernels = {"fastest": False} if hybrid else KERNELS
        return {k: replace(config, batch_invariant=on) for k, on in kernels.items()}
    return {m: replace(config, batch_invariant=not hybrid, mechanisms=None if m == "default" else parse_mechanisms(m))
            for m in args.mechanisms}


def target_cost_table(ckpt: Checkpoint, config: EngineConfig, model: torch.nn.Module, batches: list[int],
                      context: int) -> None:
    """Two-level's cost table of this target on this device, profiled (AR engine, graphs) where none is cached."""
    ar = Engine(ckpt, replace(config, speculative_algorithm=None, mechanisms=None), model=model)
    ensure_cost_table(ar, batches, list(COST_ROWS), context)


def record_verifies(engine: Engine) -> Counter:
    """Counts the verify passes the engine runs from now on, by the graph each replays (None: an eager pass)."""
    used: Counter = Counter()
    verify = engine.speculation.verify

    def recorded(plan):
        used[plan.graph] += 1
        return verify(plan)
    engine.speculation.verify = recorded
    return used


def step_graphs_ms(engine: Engine, b: int, verify_ms: float, spec_step_ms: float,
                   verifies: Counter) -> dict[str, float | None]:
    """The speculative step's other graphs at bucket b, each replayed alone (acceptance after a 16-token verify,
    the drafter's body), the verify graphs as the timed runs used them (each replayed alone, weighted by its
    passes: two-level's narrower widths and ragged's row buckets, where the whole block's graph overstates them),
    and the step over the sum of its graphs: what the engine loop adds to them. Replays after the timed runs, on
    slots whose requests are done."""
    acceptance = engine.speculation.acceptance.get((16, b))
    drafter = getattr(engine.drafter, "inner", engine.drafter)  # replayed acceptance wraps the real drafter
    body = getattr(drafter, "graphs", {}).get(b)
    graphed = {g: n for g, n in verifies.items() if g is not None}
    as_run = (sum(n * time_cuda(g.graph.replay) for g, n in graphed.items()) / sum(graphed.values())
              if graphed else None)
    out = {"graph_acceptance_ms": time_cuda(acceptance.graph.replay) if acceptance else None,
           "graph_draft_ms": time_cuda(body.graph.replay) if body else None}
    graphs = (as_run or verify_ms) + sum(v for v in out.values() if v is not None)
    return out | {"graph_verify_as_run_ms": as_run, "eager_verify_share": verifies[None] / max(1, verifies.total()),
                  "spec_over_graphs": spec_step_ms / graphs}


def allocator_retries(device: torch.device) -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if device.type == "cuda" else 0


def profile_steps(engine: Engine, prompts: list[list[int]], rids: list[str], top: int, label: str) -> None:
    """Operators by device time over 8 AR, then 8 speculative, decode steps (prefill left out)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    for spec in (False, True):
        with engine.autoregressive() if not spec else nullcontext():
            params = SamplingParams(max_new_tokens=8 * (engine.drafter.block_size if spec else 1) + 1, ignore_eos=True)
            for p, rid in zip(prompts, rids):  # the timed runs' ids: a replayed trace's reference is theirs
                engine.add_request(p, params, rid=rid)
            engine.step()  # prefill
            with torch_profile(activities=activities) as prof:
                for _ in range(8):
                    engine.step()
            while engine.has_work:
                engine.step()
        print(f"\n{label}, {'speculative' if spec else 'AR'}: 8 steps")
        print(prof.key_averages().table(sort_by=sort, row_limit=top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script runs")
    ap.add_argument("--target", choices=list(TARGETS), default="llama",
                    help="llama: Llama-3.1-8B shapes; hybrid: a Qwen3.5-style hybrid (no graphs, not exact)")
    ap.add_argument("--replay", default=None, metavar="JSON[:DATASET]",
                    help="replayed acceptance: a confidence trace (benchmarks/record_confidences.py: each pass's "
                         "acceptance with its drafter's confidences), or a specpilot bench JSON's accept histogram")
    ap.add_argument("--replay-tau", type=float, default=None, help="the replayed trace scaled to this tau")
    ap.add_argument("--mechanisms", nargs="+", default=None, metavar="SET",
                    help="compare these mechanism sets (each a --mechanisms value; default: the defaults) instead of "
                         "the kernel sets")
    ap.add_argument("--tuned-tiles", action="store_true",
                    help="tune the target's GEMM tiles (decode and verify rows) on this device first; every set then "
                         "runs on the untuned tiles and, as 'NAME tuned', on the tuned ones")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, print the N operators of most device time in 8 AR and 8 speculative steps "
                         "at the largest batch (torch.profiler)")
    args = ap.parse_args()
    trace = None
    if args.replay:
        path, _, dataset = args.replay.partition(":")
        trace = AcceptTrace.load(path, dataset or None)
        trace = trace.scaled_to(args.replay_tau) if args.replay_tau else trace
    device = torch.device("cpu" if args.smoke else "cuda")
    full, tiny, target_name = TARGETS[args.target]
    target_cfg = tiny if args.smoke else full
    dtype = torch.float32 if args.smoke else torch.bfloat16
    hybrid = target_cfg.hybrid is not None
    model = (synthetic_hybrid if hybrid else synthetic_model)(target_cfg, device, dtype)
    if hybrid and trace is not None:
        # The hybrid's kernels are not batch-invariant, and random weights leave near-ties everywhere, so a
        # verify would disagree with the AR reference by rounding alone. A zero output head makes every
        # position's logits exactly 0 (argmax: token 0, whatever the pass), so acceptance follows the trace;
        # the head's matmul still runs, so the step costs what it did.
        model.lm_head.weight.data.zero_()
    ckpt = Checkpoint(config=target_cfg, state_dict={}, tokenizer=None, source="synthetic")
    config = EngineConfig(device=device.type, dtype=str(dtype).removeprefix("torch."),
                          max_running_requests=max(args.batch), context_length=args.context + args.new_tokens + 32)
    reference: dict[str, list[int]] = {}  # replay: each engine's AR tokens per rid, filled per batch
    factory = dflash_factory(target_cfg, 5, 16)
    if trace is not None:
        dflash = factory

        def factory(config: EngineConfig, ctx: DrafterContext) -> ReplayDrafter:
            return ReplayDrafter(dflash(config, ctx), reference, trace, target_cfg.vocab_size)
    configs = variants(args, config, hybrid)
    tiles = None
    if args.tuned_tiles:
        tiles = tune({(lin.out_features, lin.in_features) for _, lin in iter_linears(model)}, kernels=["bf16"])
        save_tile_table(tiles, load_tile_table(device)[0])  # where the tuned engines load it from
        configs = {**{k: replace(c, tuned_tiles=False) for k, c in configs.items()},
                   **{f"{k} tuned": replace(c, tuned_tiles=True) for k, c in configs.items()}}
    if any(c.asks_for("two-level") for c in configs.values()):
        target_cost_table(ckpt, next(iter(configs.values())), model, sorted(set(args.batch)), args.context)
    with TritonCompiles() as start_compiles:  # what the engines compile as they start (eager drafters warm theirs)
        engines = {k: Engine(ckpt, c, model=model, drafter_factory=factory) for k, c in configs.items()}
    rng = random.Random(0)
    rows = []
    for b in args.batch:
        prompts = [[rng.randrange(target_cfg.vocab_size - 1) for _ in range(args.context)] for _ in range(b)]
        rids = {k: [f"{k}-{b}-{i}" for i in range(b)] for k in engines}
        if trace is not None:
            for name, engine in engines.items():
                with engine.autoregressive():
                    reqs = per_step(engine, prompts, args.new_tokens, rids[name])[2]
                reference.update({r.rid: r.output_ids for r in reqs})
        for name, engine in engines.items():
            for spec in (False, True):  # warm-up: first-call costs stay out of the timings
                with engine.autoregressive() if not spec else nullcontext():
                    per_step(engine, prompts, 4, rids[name])
        seen = {k: {"ar": [], "spec": [], "verify": [], "draft": [], "tau": []} for k in engines}
        verifies = {k: record_verifies(e) for k, e in engines.items()}
        retries = allocator_retries(device)
        with TritonCompiles() as compiles:  # a compile inside a timed step is charged to it
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    with engine.autoregressive():
                        ar_step = per_step(engine, prompts, args.new_tokens, rids[name])[0]
                    spec_step, stats, _ = per_step(engine, prompts, args.new_tokens, rids[name])
                    passes = stats.steps / b  # verify passes per request = engine steps
                    split = stats.time_split(wait=True)
                    for key, value in (("ar", ar_step), ("spec", spec_step), ("verify", split["verify"] / passes),
                                       ("draft", split["draft"] / passes)):
                        seen[name][key].append(1e3 * value)
                    seen[name]["tau"].append(stats.tau)
        for engine in engines.values():
            del engine.speculation.verify  # record_verifies' wrapper: the class's method again
        # the caching allocator's retries (it frees its cache and asks again when a request does not fit): a step
        # that waits on them costs far more than its kernels
        row: dict = {"batch": b, "allocator_retries": allocator_retries(device) - retries,
                     "triton_compiles": compiles.report(),
                     "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
        for name, engine in engines.items():
            row[name] = {f"{k}_step_ms" if k in ("ar", "spec") else f"{k}_ms": spread(v)
                         for k, v in seen[name].items() if k != "tau"}
            row[name]["tau"] = spread(seen[name]["tau"])
            row[name]["throughput_over_ar"] = (row[name]["ar_step_ms"]["median"] * row[name]["tau"]["median"]
                                               / row[name]["spec_step_ms"]["median"])
            if device.type == "cuda" and not hybrid:
                row[name]["graph_verify_ms"] = time_cuda(engine.runner.graph_for(16, b).graph.replay)
                row[name]["graph_decode_ms"] = time_cuda(engine.runner.graph_for(1, b).graph.replay)
                row[name].update(step_graphs_ms(engine, b, row[name]["graph_verify_ms"],
                                                row[name]["spec_step_ms"]["median"], verifies[name]))
        if "stock" in engines:
            for name in engines:
                row[name]["over_stock"] = row[name]["throughput_over_ar"] / row["stock"]["throughput_over_ar"]
        for step in ("ar", "spec") if "invariant" in engines and "fastest" in engines else ():
            row[f"{step}_invariant_over_fastest"] = (row["invariant"][f"{step}_step_ms"]["median"]
                                                     / row["fastest"][f"{step}_step_ms"]["median"])
        rows.append(row)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
              "target": f"{target_name}, synthetic bf16" if not args.smoke else f"tiny {args.target}",
              "drafter": "DFlash-shaped: 5 layers, 5 taps, block 16", "context": args.context,
              "acceptance": (f"{LABEL}: {trace.source} (tau {trace.tau:.2f})"
                             + ("; output head zeroed: every argmax is token 0" if hybrid else "")) if trace
              else "the drafter's own",
              "repeats": args.repeats, "start_compiles": start_compiles.report(), "rows": rows,
              "tuned_tiles": json.loads(tiles.to_json()) if tiles else None}
    if args.profile:
        for name, engine in engines.items():
            profile_steps(engine, prompts, rids[name], args.profile, f"{name}, B={args.batch[-1]}")
    write_json(out_dir(args.out) / "gpu_spec.json", result)
    print(f"\n{result['device']}: {result['target']}; {result['drafter']}; context {args.context}; acceptance: "
          f"{result['acceptance']}")
    for r in rows:
        for name in engines:
            k = r[name]
            mechanisms = ", ".join(sorted(engines[name].mechanisms)) or "stock"
            print(f"B={r['batch']:>2} {name:>9} ({mechanisms}): AR step {k['ar_step_ms']['median']:.3f} ms | spec step "
                  f"{k['spec_step_ms']['median']:.3f} ms (draft {k['draft_ms']['median']:.3f}, verify "
                  f"{k['verify_ms']['median']:.3f}), tau {k['tau']['median']:.2f}, throughput "
                  f"{k['throughput_over_ar']:.2f}x AR" + (f", {k['over_stock']:.2f}x stock's" if "over_stock" in k else ""))
        for name in engines:
            if "spec_over_graphs" in r[name]:
                k = r[name]
                as_run = k["graph_verify_as_run_ms"]
                print(f"      {name}: graphs alone: verify {k['graph_verify_ms']:.3f}"
                      + (f" (as run: {as_run:.3f}, eager share {k['eager_verify_share']:.2f})" if as_run else "")
                      + ", acceptance "
                      f"{k['graph_acceptance_ms'] or 0:.3f}, draft {k['graph_draft_ms'] or 0:.3f} ms; spec step / graphs "
                      f"{k['spec_over_graphs']:.3f}; AR step / decode graph {k['ar_step_ms']['median'] / k['graph_decode_ms']:.3f}")
        if r["triton_compiles"]["count"]:
            print(f"      {r['triton_compiles']['count']} Triton compiles in the timed runs "
                  f"({r['triton_compiles']['seconds']:.1f} s): {r['triton_compiles']['kernels']}")
        if r["allocator_retries"]:
            print(f"      the allocator retried {r['allocator_retries']} times (peak {r['peak_gib']:.1f} GiB)")
        if "invariant" in engines and "fastest" in engines:
            print(f"      invariant / fastest: AR {r['ar_invariant_over_fastest']:.3f}, "
                  f"spec {r['spec_invariant_over_fastest']:.3f}")


if __name__ == "__main__":
    main()
