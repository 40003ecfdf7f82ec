"""Host work of one engine step on the CUDA-graph path, measured on CPU, by batch size.

The graph paths run with the eager stand-in for CUDA graphs (specpilot.state.graphs) and every replay
stubbed out, so what is timed is only what the host does around the graphs on a GPU: input fills,
sampling and acceptance bookkeeping, stop rules, commit, statistics, the drafter's host side. A tiny random
target and DFlash drafter keep prefill negligible; outputs are meaningless (replays do nothing). Modes:

- ar: the AR decode step (decode graphs);
- chain: DFlash chains of --block tokens;
- tree: DFlash trees from each slot's top 4, with n-gram assist 2 (the device lookup);

each under the default mechanisms (device-acceptance, early-launch, layout-ahead, device-lookup where it
applies). A speculative step's acceptance is stubbed too: every request commits --accept tokens a step (the
acceptance graph's host buffer is preset), as a real run with τ = --accept would. Each (batch, mode) runs
B requests of --steps decode steps after their prefill; the (batch, mode) pairs are interleaved --repeats
times; median (min–max) of the host ms per step.

    python benchmarks/host_overhead.py [--batch 1 8 32 64] [--modes ar chain tree] [--block 16] [--accept 4]
        [--steps 100] [--repeats 5] [--profile] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from spec_fixtures import write_random_dflash  # noqa: E402
from tiny_models import tiny_hf_model  # noqa: E402

from specpilot.bench import provenance  # noqa: E402
from specpilot.bench.harness import spread  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402
from specpilot.models.checkpoint import Checkpoint, load_checkpoint  # noqa: E402
from specpilot.state import graphs  # noqa: E402
from specpilot.state.draft import Accepted  # noqa: E402
from specpilot.state.graphs import EagerReplay, GraphBackend, eager_capture  # noqa: E402

PROMPT = 32  # tokens per prompt
MODES = {"ar": {}, "chain": {"speculative_eagle_topk": 1},
         "tree": {"speculative_eagle_topk": 4, "speculative_ngram_assist": 2}}


def build(mode: str, ckpt: Checkpoint, drafter: Path, args: argparse.Namespace) -> Engine:
    new = new_tokens(mode, args)
    spec = {} if mode == "ar" else {"speculative_algorithm": "dflash", "speculative_draft_model_path": str(drafter),
                                    "speculative_num_draft_tokens": args.block, **MODES[mode]}
    context = PROMPT + new + 2 * args.block
    engine = Engine(ckpt, EngineConfig(device="cpu", max_running_requests=max(args.batch), context_length=context,
                                       max_total_tokens=max(args.batch) * (context + 128), **spec))
    if engine.speculation is not None:  # every request commits --accept tokens a step (verify rows 0.., ids 5..)
        for (_, b), graph in engine.speculation.acceptance.items():
            counts = torch.full((b,), args.accept, dtype=torch.int64)
            nodes = torch.arange(args.block).repeat(b, 1)
            with torch.inference_mode():
                graph.host.copy_(Accepted(counts, nodes, nodes + 5, counts).pack())
    return engine


def new_tokens(mode: str, args: argparse.Namespace) -> int:
    """Each request finishes on the last timed step: the prefill's token, then --steps steps' commits."""
    return 1 + args.steps * (1 if mode == "ar" else args.accept)


def host_ms(engine: Engine, mode: str, b: int, args: argparse.Namespace,
            profiler: cProfile.Profile | None = None) -> float:
    """Host ms per decode step of b requests, from after their prefill to their end."""
    params = SamplingParams(max_new_tokens=new_tokens(mode, args), ignore_eos=True)
    reqs = [engine.add_request([(7 * i + j) % 300 + 3 for j in range(PROMPT)], params) for i in range(b)]
    engine.step()
    if engine.last_step != "prefill" or len(engine.running) != b:
        raise SystemExit(f"{mode} B={b}: the requests were not prefilled in one step")
    steps = 0
    if profiler is not None:
        profiler.enable()
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
        steps += 1
    wall = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
    if steps != args.steps or any(len(r.output_ids) != params.max_new_tokens for r in reqs):
        raise SystemExit(f"{mode} B={b}: {steps} steps, expected {args.steps}")
    return wall / steps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--accept", type=int, default=4, help="tokens a speculative step commits per request")
    p.add_argument("--steps", type=int, default=100, help="decode steps per measurement")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds over every (batch, mode)")
    p.add_argument("--profile", action="store_true", help="then one profiled run per mode at the largest batch")
    p.add_argument("--out", default=None, help="JSON file")
    args = p.parse_args()
    torch.set_num_threads(1)
    GraphBackend.capture = staticmethod(eager_capture)
    EagerReplay.replay = lambda self: None  # host work only
    graphs._poison = lambda outputs: None  # outputs keep the capture run's values: replays never fill them
    report = {"provenance": provenance.collect(torch.device("cpu"), "float32"),
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "profile")} | {"prompt": PROMPT},
              "host_ms_per_step": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tiny_hf_model("qwen3").save_pretrained(tmp)
        ckpt = load_checkpoint(tmp)
        drafter = write_random_dflash(Path(tmp) / "dflash", hidden=ckpt.config.hidden_size,
                                      num_target_layers=ckpt.config.num_layers,
                                      mask_token_id=ckpt.config.vocab_size - 1, block_size=args.block)
        engines = {mode: build(mode, ckpt, drafter, args) for mode in args.modes}
        for b in args.batch:  # warm: first-call costs stay out of the timings
            for mode, engine in engines.items():
                host_ms(engine, mode, b, args)
        times: dict[tuple[str, int], list[float]] = {(m, b): [] for b in args.batch for m in args.modes}
        for _ in range(args.repeats):
            for b in args.batch:
                for mode, engine in engines.items():
                    times[mode, b].append(host_ms(engine, mode, b, args))
        for mode in args.modes:
            report["host_ms_per_step"][mode] = {str(b): spread(times[mode, b]) for b in args.batch}
            print(f"{mode:>5}: " + " | ".join(
                f"B={b} {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"
                for b, s in ((b, report["host_ms_per_step"][mode][str(b)]) for b in args.batch)) + " ms")
        if args.profile:
            for mode, engine in engines.items():
                profiler = cProfile.Profile()
                ms = host_ms(engine, mode, max(args.batch), args, profiler)
                print(f"\n{mode}, B={max(args.batch)}: {ms:.3f} ms per step under the profiler")
                pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
