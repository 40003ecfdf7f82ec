"""Where a drafter training step's time goes: the trainer's own step (specpilot.training.train) on a synthetic
target of the embedded model's shapes, random sequences of the recipe's lengths, and the recipe's drafter.

Modes (MODES): the trainer's (deterministic algorithms, the fused hard-label loss), the same with the fp32 loss
path, torch's strict deterministic mode that also fills fresh memory, and torch's defaults. Each warms up; then the
timed steps run one at a time with the device drained between them, the modes interleaved step by step (wall time
per step, median and spread); then a few more steps per mode under torch's profiler: each named phase of the step
(STEP_PHASES: batch, features, forward, backward, optimizer) with its device time, and the operators that take the
most. On the device no ferry is needed:

    PYTHONPATH=$PWD python3 benchmarks/train_step_profile.py --out $OUT/train_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import synthetic_model, timed_ms  # noqa: E402

from specpilot.bench.harness import spread  # noqa: E402
from specpilot.models.checkpoint import Checkpoint  # noqa: E402
from specpilot.models.config import ModelConfig  # noqa: E402
from specpilot.training.data import FeatureSource, Sample  # noqa: E402
from specpilot.training.train import (  # noqa: E402
    STEP_PHASES, DraftTrainer, TrainConfig, build_target_layer_ids, deterministic_algorithms, draft_config,
    target_engine,
)

# The embedded SmolLM2-135M-Instruct's shapes (tests/test_train_step_profile.py holds them to the GGUF's)
SMOLLM2_135M = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
    tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2],
)
# (deterministic algorithms, their filling of fresh allocations, the fused hard-label loss): the trainer's mode;
# the loss's fp32 path; torch's own strict mode, which fills every new tensor's memory (a write per allocation);
# torch's default
MODES = {"deterministic": (True, False, True), "fp32-loss": (True, False, False),
         "deterministic-fill": (True, True, True), "default": (False, False, True)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # the recipe's (benchmarks/gpu_drafter.sh) drafter and batch
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--num-taps", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--anchors-per-seq", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=1024)
    # session 39's data: 9.38 M prompt and 6.60 M response tokens over 36,446 sequences
    p.add_argument("--prompt-len", type=int, default=257, help="mean prompt tokens (lengths spread +-50%%)")
    p.add_argument("--response-len", type=int, default=181, help="mean response tokens (lengths spread +-50%%)")
    p.add_argument("--distill", type=float, default=0.0)
    p.add_argument("--rank-loss", type=float, default=0.0)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    p.add_argument("--profiled-steps", type=int, default=3)
    p.add_argument("--top", type=int, default=12, help="kernels listed per mode")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def random_samples(args: argparse.Namespace, count: int, vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(args.seed)

    def length(mean: int) -> int:
        return max(2, int(mean * (0.5 + torch.rand(1, generator=g).item())))

    samples = []
    for _ in range(count):
        prompt = min(length(args.prompt_len), args.max_seq_len - 2)
        total = min(prompt + length(args.response_len), args.max_seq_len)
        samples.append(Sample(torch.randint(3, vocab, (total,), generator=g, dtype=torch.int32), prompt))
    return samples


def build_trainer(args: argparse.Namespace) -> DraftTrainer:
    device = torch.device(args.device)
    cfg = TrainConfig(out=Path("unused"), num_layers=args.num_layers, intermediate_size=args.intermediate_size,
                      num_taps=args.num_taps, block_size=args.block_size, batch_size=args.batch_size,
                      anchors_per_seq=args.anchors_per_seq, max_seq_len=args.max_seq_len, gen_batch_size=1,
                      distill=args.distill, rank_loss=args.rank_loss, seed=args.seed, device=args.device,
                      dtype="bfloat16" if device.type == "cuda" else "float32")
    model = synthetic_model(SMOLLM2_135M, device, getattr(torch, cfg.dtype), args.seed)
    engine = target_engine(cfg, Checkpoint(config=SMOLLM2_135M, state_dict={}, tokenizer=None, source="synthetic"),
                           model)
    taps = build_target_layer_ids(SMOLLM2_135M.num_layers, args.num_taps)
    dcfg = draft_config(SMOLLM2_135M, args.num_layers, taps, SMOLLM2_135M.vocab_size - 1, args.block_size,
                        args.intermediate_size)
    steps = args.warmup + args.steps + args.profiled_steps
    samples = random_samples(args, args.batch_size * steps * len(args.modes), SMOLLM2_135M.vocab_size)
    features = FeatureSource(engine, samples, tuple(taps), False, args.batch_size, None, with_final=args.distill > 0)
    return DraftTrainer(cfg, engine, dcfg, samples, features)


def profile_steps(trainer: DraftTrainer, steps: int, top: int) -> dict:
    """The profiled steps' time per phase and per kernel, ms per step: device time on CUDA, CPU time elsewhere.
    An operator counts to the phase whose range was open when it started, on any thread (on CUDA autograd runs
    the backward's operators on a thread of its own, outside the main thread's ranges)."""
    cuda = trainer.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            trainer.train_step()
        if cuda:
            torch.cuda.synchronize(trainer.device)

    def own_us(event) -> float:
        return event.self_device_time_total if cuda else event.self_cpu_time_total

    # operators only: a kernel's own entry would count its time a second time, beside its operator's
    events = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    ranges = [(e.time_range.start, e.time_range.end, e.name) for e in events if e.name in STEP_PHASES]
    phases = dict.fromkeys(STEP_PHASES, 0.0)
    for event in events:
        if event.name in STEP_PHASES or not own_us(event):
            continue
        start = event.time_range.start
        for first, last, name in ranges:
            if first <= start <= last:
                phases[name] += own_us(event) / 1e3 / steps
                break
    ops = [e for e in prof.key_averages()
           if e.device_type == DeviceType.CPU and e.key not in STEP_PHASES and own_us(e) > 0]
    ops.sort(key=own_us, reverse=True)
    listed = [{"name": e.key[:120], "ms": own_us(e) / 1e3 / steps, "calls": e.count / steps} for e in ops[:top]]
    return {"clock": "device" if cuda else "cpu", "phases_ms": phases, "top": listed,
            "total_ms": sum(map(own_us, ops)) / 1e3 / steps}


@contextmanager
def mode_of(trainer: DraftTrainer, mode: str) -> Iterator[None]:
    deterministic, fill, fused = MODES[mode]
    trainer.fused_loss = fused
    with deterministic_algorithms(deterministic, fill):
        yield


def run_modes(trainer: DraftTrainer, args: argparse.Namespace) -> dict[str, dict]:
    for mode in args.modes:
        with mode_of(trainer, mode):
            for _ in range(args.warmup):
                trainer.train_step()
    wall: dict[str, list[float]] = {mode: [] for mode in args.modes}
    for _ in range(args.steps):  # interleaved: a drift of the device's clocks or heat spreads over every mode
        for mode in args.modes:
            with mode_of(trainer, mode):
                wall[mode].append(timed_ms(trainer.train_step, trainer.device))
    results = {}
    for mode in args.modes:
        with mode_of(trainer, mode):
            profiled = profile_steps(trainer, args.profiled_steps, args.top)
        results[mode] = {"step_ms": spread(wall[mode]), "step_ms_each": wall[mode], **profiled}
    return results


def report(results: dict, console: Console) -> None:
    table = Table(title="a training step, ms (wall: median of the timed steps; phases: the profiled steps' device "
                        "time, CPU time off CUDA)")
    table.add_column("mode")
    table.add_column("wall")
    for name in STEP_PHASES:
        table.add_column(name)
    table.add_column("profiled total")
    for mode, r in results["modes"].items():
        table.add_row(mode, f"{r['step_ms']['median']:.1f}",
                      *(f"{r['phases_ms'][n]:.1f}" for n in STEP_PHASES), f"{r['total_ms']:.1f}")
    console.print(table)
    for mode, r in results["modes"].items():
        console.print(f"[bold]{mode}[/]: the most {r['clock']} time")
        for op in r["top"]:
            console.print(f"  {op['ms']:8.2f} ms  x{op['calls']:<5g} {op['name']}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts, as train_drafter sets it
    torch.manual_seed(args.seed)
    trainer = build_trainer(args)
    device = trainer.device
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
               "drafter_parameters": sum(p.numel() for p in trainer.model.parameters()), "modes": {}}
    results["modes"] = run_modes(trainer, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    report(results, Console())
    return results


if __name__ == "__main__":
    main()
