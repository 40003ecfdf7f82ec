"""A confidence trace of the embedded pair: the shipped DFlash drafter's chains (block 16, no trees, every draft
verified), per request and verify pass its confidence in each draft and how many drafts the target accepted
(specpilot/bench/replay.RecordingDrafter). `gpu_spec.py --replay TRACE.json [--replay-tau 6.5]` replays it on
large shapes: each pass's acceptance and the confidences of a real pass that accepted as many, so two-level's
level 1 reads what a real drafter would give it.

    python benchmarks/record_confidences.py [--device cpu] [--dataset humaneval] [--num-prompts 20]
        [--max-new-tokens 256] [--block-size 16] [--out DIR]     -> DIR/confidence_trace_DATASET.json and .png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402

from specpilot.bench.charts import plt, save  # noqa: E402
from specpilot.bench.datasets import apply_chat_template, load_prompts  # noqa: E402
from specpilot.bench.provenance import collect, label  # noqa: E402
from specpilot.bench.replay import AcceptTrace, RecordingDrafter  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402
from specpilot.engine.registry import parse_mechanisms  # noqa: E402
from specpilot.engine.two_level import BINS  # noqa: E402
from specpilot.progress import bar  # noqa: E402


def calibration(passes: list[tuple[int, list[float]]]) -> list[dict]:
    """Per confidence decile, the drafts that were reached (every draft before them accepted) and the share of
    them accepted (two-level's bins): how far the drafter's confidence is from the chance that level 1 needs."""
    reached, accepted, said = [0] * BINS, [0] * BINS, [0.0] * BINS
    for a, confidences in passes:
        for j, c in enumerate(confidences[: a + 1]):  # drafts 0..a were reached; 0..a-1 accepted
            b = min(int(c * BINS), BINS - 1)
            reached[b] += 1
            accepted[b] += j < a
            said[b] += c
    return [{"bin": f"{b / BINS:.1f}-{(b + 1) / BINS:.1f}", "reached": reached[b],
             "mean_confidence": said[b] / reached[b] if reached[b] else None,
             "accepted": accepted[b] / reached[b] if reached[b] else None} for b in range(BINS)]


def chart(result: dict, path: Path) -> Path:
    """Acceptance by draft slot (the share of passes accepting at least j drafts) beside the block's ceiling, and
    the confidence's calibration."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    passes, slots = result["passes"], result["block_size"] - 1
    survival = [sum(a >= j for a, _ in passes) / len(passes) for j in range(1, slots + 1)]
    ax1.plot(range(1, slots + 1), survival, marker="o", label=f"the drafter (tau {result['tau']:.2f})")
    ax1.plot(range(1, slots + 1), [1.0] * slots, ls="--", color="gray", label=f"the block's ceiling (tau {slots + 1})")
    ax1.set_xlabel("draft slot j")
    ax1.set_ylabel("passes accepting drafts 1..j")
    ax1.legend()
    ax1.set_title(f"{result['dataset']}: acceptance by slot")
    rows = [r for r in result["calibration"] if r["reached"]]
    ax2.plot([r["mean_confidence"] for r in rows], [r["accepted"] for r in rows], marker="o", label="observed")
    ax2.plot([0, 1], [0, 1], ls="--", color="gray", label="calibrated")
    ax2.set_xlabel("the drafter's confidence (decile mean)")
    ax2.set_ylabel("accepted, of drafts reached")
    ax2.legend()
    ax2.set_title("calibration")
    return save(fig, path, f"{label(result['provenance'])} | {result['command']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16, help="the block the replay's drafter will draft")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = Engine.from_config(EngineConfig(device=args.device, speculative_algorithm="dflash",
                                             speculative_num_draft_tokens=args.block_size, speculative_eagle_topk=1, speculative_ngram_assist=0,
                                             mechanisms=parse_mechanisms("stock")))
    recording = RecordingDrafter(engine.drafter)
    engine.drafter = recording
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for prompt in bar(load_prompts(args.dataset, args.num_prompts), f"recording {args.dataset}"):
        engine.generate([apply_chat_template(engine.tokenizer, prompt)], params)
    passes = [(a, [round(c, 4) for c in confidences]) for a, confidences in recording.passes]
    trace = AcceptTrace.from_passes(passes, args.dataset)
    result = {"provenance": collect(engine.device, str(engine.dtype)), "command": " ".join(sys.argv),
              "dataset": args.dataset, "block_size": recording.block_size, "tau": trace.tau,
              "engine_tau": engine.spec_stats.tau, "calibration": calibration(passes), "passes": passes}
    path = out_dir(args.out) / f"confidence_trace_{args.dataset}.json"
    write_json(path, result)
    chart(result, path.with_suffix(".png"))
    print(f"{len(passes)} passes, tau {trace.tau:.2f} (the engine's, every pass counted: "
          f"{engine.spec_stats.tau:.2f}) -> {path}")


if __name__ == "__main__":
    main()
