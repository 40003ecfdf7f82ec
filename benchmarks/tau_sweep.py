"""τ (tokens per verify pass) of DFlash drafting settings that change no device work per step, on any
device: the tree's top-k, n-gram assistance, the probability a tree gives prompt lookup's path, and the drafter
(`--draft DIR ...`: checkpoints side by side; `shipped` is the embedded model's default).

Greedy decoding commits the same tokens whatever the batch, so prompts run `--batch` at a time (fast on
CPU) and only τ is reported — no timings. Speed needs `specpilot bench` at B=1.

    python benchmarks/tau_sweep.py --dataset humaneval math --num-prompts 20 --max-new-tokens 256 \\
        --topk 4 --assist 2 --lookup-prob 0.8 0.9 0.95 [--device cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402

from specpilot.bench.datasets import apply_chat_template, load_prompts  # noqa: E402
from specpilot.config import SamplingParams  # noqa: E402
from specpilot.drafters import SHIPPED_DRAFTER  # noqa: E402
from specpilot.engine.engine import Engine, EngineConfig  # noqa: E402

DEFAULT_LOOKUP_PROB = EngineConfig.speculative_lookup_prob


def tau(draft: str, topk: int, assist: int, lookup_prob: float, datasets: list[str],
        args: argparse.Namespace) -> dict:
    engine = Engine.from_config(EngineConfig(
        device=args.device, speculative_algorithm="dflash", speculative_num_draft_tokens=args.block,
        speculative_draft_model_path=None if draft == SHIPPED_DRAFTER else draft,
        speculative_eagle_topk=topk, speculative_ngram_assist=assist, max_running_requests=args.batch,
        # the tunable applies to trees only (a chain merges no lookup)
        speculative_lookup_prob=lookup_prob if topk > 1 else DEFAULT_LOOKUP_PROB))
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    row = {"draft": draft, "topk": topk, "assist": assist, "lookup_prob": lookup_prob}
    for name in datasets:
        prompts = [apply_chat_template(engine.tokenizer, p) for p in load_prompts(name, args.num_prompts)]
        engine.reset_spec_stats()
        engine.generate(prompts, params)  # continuous batching, --batch requests at a time
        row[name] = engine.spec_stats.tau
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", nargs="+", default=["humaneval"])
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--draft", nargs="+", default=[SHIPPED_DRAFTER],
                   help=f"DFlash checkpoint directories ({SHIPPED_DRAFTER}: the default)")
    p.add_argument("--topk", type=int, nargs="+", default=[4])
    p.add_argument("--assist", type=int, nargs="+", default=[2])
    p.add_argument("--lookup-prob", type=float, nargs="+", default=[DEFAULT_LOOKUP_PROB])
    p.add_argument("--batch", type=int, default=8, help="prompts decoded together")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out")
    args = p.parse_args()
    rows = []
    for draft, topk, assist, prob in itertools.product(args.draft, args.topk, args.assist, args.lookup_prob):
        rows.append(tau(draft, topk, assist, prob, args.dataset, args))
        print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[-1].items()),
              flush=True)
    out = out_dir(args.out)
    write_json(out / "tau_sweep.json", {"args": vars(args), "rows": rows})
    chart(rows, args.dataset, args.block, out / "tau_sweep.png")


def chart(rows: list[dict], datasets: list[str], block: int, path: Path) -> None:
    """τ per dataset, a bar per setting (the settings that vary between rows name it)."""
    varying = [k for k in ("draft", "topk", "assist", "lookup_prob") if len({str(r[k]) for r in rows}) > 1]
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(datasets) * len(rows) ** 0.5), 4))
    for i, row in enumerate(rows):
        label = ", ".join(f"{k} {row[k]}" for k in varying) or "tau"
        xs = [d + (i - (len(rows) - 1) / 2) * width for d in range(len(datasets))]
        bars = ax.bar(xs, [row[name] for name in datasets], width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set(ylabel="tau (tokens per verify pass)", title=f"tau at block {block}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
