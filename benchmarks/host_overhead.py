"""Host work of one speculative step on the CUDA-graph path, measured on CPU.

The graph paths run with the eager stand-in for CUDA graphs (specpilot.state.graphs) and every replay
stubbed out, so what is timed is only what the host does around the graphs on a GPU: input fills,
context rows, tree bookkeeping, acceptance, commit. A tiny random target and DFlash drafter keep
prefill negligible; outputs are meaningless (replays do nothing), the step count is what a GPU would do.

    python benchmarks/host_overhead.py [--topk 1 4] [--block 16] [--steps 300] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from spec_fixtures import write_random_dflash  # noqa: E402
from tiny_models import tiny_hf_model  # noqa: E402

from specpilot.config import SamplingParams  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402
from specpilot.models.checkpoint import load_checkpoint  # noqa: E402
from specpilot.state import graphs  # noqa: E402
from specpilot.state.graphs import EagerReplay, GraphBackend, eager_capture  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topk", type=int, nargs="+", default=[1, 4], help="--speculative-eagle-topk values")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--steps", type=int, default=300, help="speculative steps per measurement")
    p.add_argument("--profile", action="store_true", help="print the top host functions")
    args = p.parse_args()
    torch.set_num_threads(1)
    GraphBackend.capture = staticmethod(eager_capture)
    EagerReplay.replay = lambda self: None  # host work only
    graphs._poison = lambda outputs: None  # outputs keep the capture run's values: replays never fill them
    with tempfile.TemporaryDirectory() as tmp:
        tiny_hf_model("qwen3").save_pretrained(tmp)
        ckpt = load_checkpoint(tmp)
        drafter = write_random_dflash(Path(tmp) / "dflash", hidden=ckpt.config.hidden_size,
                                      num_target_layers=ckpt.config.num_layers,
                                      mask_token_id=ckpt.config.vocab_size - 1, block_size=args.block)
        for topk in args.topk:
            engine = Engine(ckpt, EngineConfig(
                device="cpu", max_running_requests=8, context_length=4 * args.steps + 64,
                speculative_algorithm="dflash", speculative_draft_model_path=str(drafter),
                speculative_num_draft_tokens=args.block, speculative_eagle_topk=topk))
            params = SamplingParams(max_new_tokens=args.steps, ignore_eos=True)
            engine.generate([[5, 6, 7, 8]], params)  # warm
            profiler = cProfile.Profile()
            start = time.perf_counter()
            if args.profile:
                profiler.enable()
            [req] = engine.generate([[5, 6, 7, 9]], params)
            profiler.disable()
            wall = time.perf_counter() - start
            steps = len(req.accept_lengths)
            print(f"top-k {topk}, block {args.block}: {wall / steps * 1e3:.3f} ms of host work per step ({steps} steps)")
            if args.profile:
                pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
