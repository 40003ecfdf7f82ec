"""Hugging Face transformers as the reference implementation in tests."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-3  # top-1/top-2 logit margin under which float reordering may flip the argmax


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of HF `generate` (EOS off) and the top-1/top-2 logit margin at each step."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    margins = []
    for scores in out.scores:
        top2 = torch.topk(scores[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return tokens, margins


def assert_same_up_to_near_tie(ours: list[int], ref: list[int], margins: list[float]) -> int | None:
    """Equal, or first differing at a near-tie of the reference; returns that position (or None)."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert margins[i] < NEAR_TIE, f"token {i}: ours {a} vs ref {b} with margin {margins[i]:.3g}"
            return i
    assert len(ours) == len(ref), f"length {len(ours)} vs {len(ref)}"
    return None
