"""Does a drafter training step repeat bit for bit on this device, and does the loss's chunking change its bits?

The trainer's own steps (specpilot.training.train, strict deterministic mode) on a synthetic target of the
embedded model's shapes (benchmarks/train_step_profile.py's set-up), from one saved state, several times:
- `repeat`: the same steps again, as a rerun of the same command would take them;
- `memory`: again after holding and freeing a large allocation (what generating the responses leaves behind);
- `chunk/N`: with the loss's logit chunks cut to 1/N of the trainer's (another device, or the chunk rule of
  before session 44, which followed free memory).
Each is compared with the first: the step losses, and every parameter after the last step, bitwise; the first
step whose loss differs is named. No ferry is needed on the device:

    PYTHONPATH=$PWD python3 benchmarks/train_determinism.py --out $OUT/train_determinism.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step_profile import build_trainer  # noqa: E402
from train_step_profile import parse_args as profile_args  # noqa: E402

from specpilot.training.train import DraftTrainer, deterministic_algorithms  # noqa: E402


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="steps per trial")
    p.add_argument("--chunk-divisors", type=int, nargs="*", default=[3, 16])
    p.add_argument("--hold-gib", type=float, default=8.0, help="the `memory` trial's allocation")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (the test suite's run)")
    own, rest = p.parse_known_args(argv)
    if own.smoke:
        rest = ["--device", "cpu", "--batch-size", "2", "--anchors-per-seq", "4", "--max-seq-len", "64",
                "--prompt-len", "16", "--response-len", "16", "--num-layers", "1", *rest]
        own.hold_gib = 0.01
        own.chunk_divisors = [3, 400]  # 400: chunks of 6 rows, so the tiny batches do split
    profile = profile_args([*rest, "--modes", "deterministic", "--warmup", "0", "--steps", str(own.steps),
                            "--profiled-steps", "0"])
    return own, profile


class Snapshot:
    """The trainer's state before the trials' steps; `restore` puts it back."""

    def __init__(self, trainer: DraftTrainer) -> None:
        self.model = copy.deepcopy(trainer.model.state_dict())
        self.optimizer = copy.deepcopy(trainer.optimizer.state_dict())
        self.scheduler = copy.deepcopy(trainer.scheduler.state_dict())
        self.chunk = trainer.logit_chunk

    def restore(self, trainer: DraftTrainer) -> None:
        trainer.model.load_state_dict(self.model)
        trainer.optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        trainer.scheduler.load_state_dict(self.scheduler)
        trainer.step, trainer.step_losses, trainer.epochs = 0, [], []
        trainer.logit_chunk = self.chunk


def trial(trainer: DraftTrainer, snapshot: Snapshot, steps: int, chunk: int | None = None,
          hold_bytes: int = 0) -> dict:
    snapshot.restore(trainer)
    if chunk is not None:
        trainer.logit_chunk = chunk
    if hold_bytes:  # a large allocation, freed: the allocator's and the device's free memory change
        held = torch.empty(hold_bytes, dtype=torch.uint8, device=trainer.device)
        del held
    with deterministic_algorithms():
        for _ in range(steps):
            trainer.train_step()
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return {"losses": list(trainer.step_losses), "params": params, "chunk": trainer.logit_chunk}


def compare(first: dict, other: dict) -> dict:
    differing = [i for i, (a, b) in enumerate(zip(first["losses"], other["losses"])) if a != b]
    params = [n for n, p in first["params"].items() if not torch.equal(p, other["params"][n])]
    return {"logit_chunk": other["chunk"], "identical": not differing and not params,
            "first_differing_step": differing[0] if differing else None,
            "max_loss_difference": max(abs(a - b) for a, b in zip(first["losses"], other["losses"])),
            "parameters_differing": len(params), "parameters": len(first["params"]), "losses": other["losses"]}


def main(argv: list[str] | None = None) -> dict:
    own, args = parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts, as train_drafter sets it
    torch.manual_seed(args.seed)
    trainer = build_trainer(args)
    snapshot = Snapshot(trainer)
    first = trial(trainer, snapshot, own.steps)
    trials = {"repeat": trial(trainer, snapshot, own.steps),
              "memory": trial(trainer, snapshot, own.steps, hold_bytes=int(own.hold_gib * (1 << 30)))}
    for n in own.chunk_divisors:
        trials[f"chunk/{n}"] = trial(trainer, snapshot, own.steps, chunk=max(1, snapshot.chunk // n))
    device = trainer.device
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "args": {k: str(v) for k, v in (vars(args) | vars(own)).items()},
               "logit_chunk": snapshot.chunk, "first_losses": first["losses"],
               "trials": {name: compare(first, t) for name, t in trials.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    for name, r in results["trials"].items():
        print(f"{name:10s} chunk {r['logit_chunk']:>12,d}: " + ("identical" if r["identical"] else
              f"differs from step {r['first_differing_step']} (max |loss diff| {r['max_loss_difference']:.3g}, "
              f"{r['parameters_differing']}/{r['parameters']} parameters)"))
    return results


if __name__ == "__main__":
    main()
