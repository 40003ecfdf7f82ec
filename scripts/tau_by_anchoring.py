"""τ figures for one DFlash drafter on the same greedy sequences of the embedded model: the engine's,
the chained estimate the trainer validates with, the all-anchor figure training batches used to report
(docs/RESULTS.md: it overstates τ on repetitive text), and the chained τ with --speculative-ngram-assist N
(the drafter's block replaced by prompt lookup where the context's last N+ tokens repeat).

    python scripts/tau_by_anchoring.py DRAFTER_DIR --dataset humaneval --num-prompts 4 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specpilot.bench.datasets import BENCH_DATASETS, TRAIN_DATASETS, apply_chat_template, load_prompts
from specpilot.config import SamplingParams
from specpilot.drafters.dflash_model import load_dflash_model, read_dflash_config
from specpilot.drafters.ngram import NgramIndex
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.models.rope import RotaryTable
from specpilot.training.data import Sample, make_batch, pad_features, tap_features
from specpilot.training.train import NOT_COUNTED, ValidationStats, block_targets, draft_hidden


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafter", type=Path)
    p.add_argument("--dataset", default="humaneval", choices=sorted(set(BENCH_DATASETS) | set(TRAIN_DATASETS)))
    p.add_argument("--split", default="bench", choices=["bench", "train"])
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--ngram-assist", type=int, default=2, help="N of --speculative-ngram-assist")
    args = p.parse_args()
    cpu = torch.device("cpu")
    cfg = read_dflash_config(args.drafter)
    engine = Engine.from_config(EngineConfig(device="cpu", speculative_algorithm="dflash", context_length=2048,
                                             speculative_draft_model_path=str(args.drafter),
                                             speculative_num_draft_tokens=cfg.block_size))
    prompts = [apply_chat_template(engine.tokenizer, q) for q in load_prompts(args.dataset, args.num_prompts, args.split)]
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens))
    samples = [Sample(torch.tensor(r.all_ids, dtype=torch.int32), len(r.prompt_ids)) for r in reqs]

    model = load_dflash_model(args.drafter, cfg, cpu, torch.float32)
    rope = RotaryTable(cfg.layers.head_dim, cfg.layers.rope_theta, cfg.layers.rope_scaling, 4096, cpu)
    batch = make_batch(samples, list(range(len(samples))), engine.context_length, torch.Generator(), cpu)
    feats = pad_features(tap_features(engine, [s.tokens.tolist() for s in samples], tuple(cfg.target_layer_ids)), cpu)
    targets, ok = block_targets(batch, cfg.block_size)
    with torch.no_grad():
        hidden = draft_hidden(model, engine.model, rope, feats, batch.tokens, batch.anchors, cfg.mask_token_id,
                              cfg.block_size)
        logits = engine.model.logits(hidden[:, :, 1:].reshape(-1, hidden.shape[-1]))
        rank = (logits > logits.gather(-1, targets.reshape(-1, 1))).sum(-1).view(targets.shape)
    ranks = torch.where(ok, rank, NOT_COUNTED)
    correct = ranks == 0
    stats, assisted = ValidationStats(), ValidationStats()
    stats.add(ranks, ok, batch.anchor_valid)
    hits = ngram_assisted(correct, targets, ok, batch.tokens, batch.anchors, samples, args.ngram_assist)
    assisted.add(torch.where(hits, 0, NOT_COUNTED), ok, batch.anchor_valid)
    all_anchors = 1 + correct.long().cumprod(-1).sum(-1)[batch.anchor_valid].float().mean().item()
    print(f"engine tau {engine.spec_stats.tau:.2f} | chained tau {stats.summary()['tau']:.2f} | "
          f"all-anchor tau {all_anchors:.2f} | slot-1 accuracy {stats.summary()['accuracy'][0]:.2f} | "
          f"chained tau with n-gram assist {args.ngram_assist}: {assisted.summary()['tau']:.2f}")


def ngram_assisted(correct: torch.Tensor, targets: torch.Tensor, ok: torch.Tensor, tokens: torch.Tensor,
                   anchors: torch.Tensor, samples: list[Sample], min_match: int) -> torch.Tensor:
    """`correct` with each anchor's row replaced by the lookup's where the context repeats an n-gram of
    at least `min_match` tokens (NgramAssistedDrafter's rule)."""
    out = correct.clone()
    for j, sample in enumerate(samples):
        index, seen = NgramIndex(min_match, 4), 0
        for i, a in enumerate(anchors[j].tolist()):
            if a < sample.prompt_len or a >= len(sample.tokens):
                continue
            index.extend(tokens[j, seen : a + 1].tolist())
            seen = a + 1
            proposal, n = index.match(targets.shape[-1])
            if n >= min_match:
                out[j, i] = (torch.tensor(proposal) == targets[j, i]) & ok[j, i]
    return out


if __name__ == "__main__":
    main()
