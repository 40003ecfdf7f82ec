"""Keyed sampling: the same seed gives the same text with speculation on or off, at any sampling
settings, and token forcing at T>0 compares the sampled tokens, so planted samplers fail it."""

from __future__ import annotations

import pytest
import torch
from test_speculative import AcceptEverything, engine_for, mixed_prompts, tiny  # noqa: F401  (module fixture)

from specpilot.config import SamplingParams
from specpilot.engine.sampling import keyed_sample, keyed_sample_rows
from specpilot.kernels.keyed_argmax import keyed_gumbel
from specpilot.forcing import run_forcing

SAMPLED = SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)


def test_keyed_noise_depends_on_seed_and_position_only():
    positions = torch.tensor([0, 5, 5, 9])
    noise = keyed_gumbel(3, positions, 50)
    assert torch.equal(noise[1], noise[2])  # same (seed, position): same noise, whatever the row
    assert not torch.equal(noise[0], noise[1])
    assert torch.equal(keyed_gumbel(3, positions[1:2], 50)[0], noise[1])  # batch-independent
    assert not torch.equal(keyed_gumbel(4, positions, 50), noise)


def test_rows_sampled_together_equal_each_row_alone():
    """keyed_sample_rows over rows of mixed settings, seeds and positions (and tied logits at the top-p cut)
    is bitwise the per-row keyed_sample the engine used to loop over."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 320, generator=g) * 3
    logits[:, 7] = logits[:, 9] = logits[:, 11] = 4.0  # ties
    settings = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.3, top_k=20),
                SamplingParams(temperature=0.6, top_p=0.5, min_p=0.05), SamplingParams(temperature=1.0)]
    params = [settings[i % 4] for i in range(12)]
    seeds = [(2**64 - 1 - i * 977) if i % 3 == 0 else i * 31 for i in range(12)]  # seeds past int64 too
    positions = torch.tensor([0, 5, 5, 9, 100, 3, 0, 7, 7, 2, 50, 1])
    together = keyed_sample_rows(logits, params, seeds, positions)
    alone = torch.cat([keyed_sample(logits[i : i + 1], params[i], seeds[i], positions[i : i + 1]) for i in range(12)])
    assert torch.equal(together, alone)
    # an entry per 3 rows (a request's verify rows): as if each row were given its entry's settings and seed
    per_request = keyed_sample_rows(logits, params[::3], seeds[::3], positions, repeats=3)
    assert torch.equal(per_request, keyed_sample_rows(logits, [params[i - i % 3] for i in range(12)],
                                                      [seeds[i - i % 3] for i in range(12)], positions))


def test_keyed_sample_follows_the_distribution():
    """Over seeds, the keyed sample of a fixed row is distributed as the target (chi-square)."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0]])
    params = SamplingParams(temperature=0.7, max_new_tokens=1)
    from specpilot.engine.sampling import target_probs

    n = 20000
    counts = torch.zeros(5)
    for seed in range(n):
        counts[keyed_sample(logits, params, seed, torch.tensor([3]))] += 1
    expected = target_probs(logits, params)[0] * n
    assert float(((counts - expected) ** 2 / expected).sum()) < 18.5  # 4 dof, p = 0.001


@pytest.mark.parametrize("algorithm,block,assist,topk", [
    ("ngram", 4, 0, 1), ("dflash", None, 0, 1), ("dflash", 6, 2, 4), ("pard", 5, 0, 1)])
def test_the_same_seed_gives_the_same_text_with_speculation_on_or_off(tiny, algorithm, block, assist, topk):  # noqa: F811
    ckpt, paths = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 5, seed=8)
    params = [SamplingParams(max_new_tokens=32, temperature=t, top_p=p, top_k=k, seed=100 + i, ignore_eos=True)
              for i, (t, p, k) in enumerate([(0.8, 0.95, -1), (1.0, 1.0, -1), (0.5, 0.9, 20), (1.3, 1.0, 8),
                                             (0.8, 0.95, -1)])]
    ar = [r.output_ids for r in engine_for(ckpt).generate(prompts, params)]
    spec = engine_for(ckpt, algorithm, paths.get(algorithm), block, assist=assist, topk=topk)
    assert [r.output_ids for r in spec.generate(prompts, params)] == ar
    assert spec.spec_stats.steps > 0 and (spec.spec_stats.tau > 1.0 or algorithm != "ngram")


def test_forcing_at_t_above_zero_compares_tokens(tiny):  # noqa: F811
    ckpt, paths = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 4)
    verdict = run_forcing(engine_for(ckpt), engine_for(ckpt, "dflash", paths["dflash"]), prompts, SAMPLED, "dflash")
    assert verdict.passed and verdict.non_tie_mismatches == 0, verdict.as_dict()
    assert verdict.positions_checked == 4 * 32


def test_planted_accept_everything_fails_forcing_at_t_above_zero(tiny):  # noqa: F811
    ckpt, paths = tiny
    cand = engine_for(ckpt, "dflash", paths["dflash"], graphs=False)
    cand.verifier = AcceptEverything()
    verdict = run_forcing(engine_for(ckpt), cand, mixed_prompts(ckpt.config.vocab_size, 4), SAMPLED, "hack")
    assert not verdict.passed and verdict.non_tie_mismatches > 0


def test_planted_other_stream_sampler_fails_forcing(tiny, monkeypatch):  # noqa: F811
    """A planted sampler: speculation (device acceptance and the host walk) draws from the stream of
    seed + 1; AR keeps the request's own."""
    import specpilot.engine.step as step
    import specpilot.engine.verify as verify

    monkeypatch.setattr(verify, "keyed_sample",
                        lambda logits, params, seed, positions: keyed_sample(logits, params, seed + 1, positions))
    monkeypatch.setattr(step, "keyed_sample_rows", lambda logits, params, seeds, positions, repeats=1: keyed_sample_rows(
        logits, params, [s + 1 for s in seeds], positions, repeats))
    ckpt, _ = tiny
    verdict = run_forcing(engine_for(ckpt), engine_for(ckpt, "ngram", block=4),
                          mixed_prompts(ckpt.config.vocab_size, 4), SAMPLED, "hack")
    assert not verdict.passed and verdict.non_tie_mismatches > 0


def _nucleus_by_stable_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition: sort each row (stable, so equal probabilities keep id order), keep the smallest prefix
    whose mass reaches top_p."""
    values, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.nn.functional.pad(values.cumsum(-1)[:, :-1], (1, 0))
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before < top_p)


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_top_p_nucleus_equals_the_stable_sort_definition(top_p, monkeypatch):
    """Narrow nuclei (found among the candidates), wide ones (past them: a full sort of those rows) and ties at
    the cut (the lower ids kept) give the definition's tokens."""
    from specpilot.engine import sampling

    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 16)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 400, generator=g) * torch.tensor([[8.0], [4.0], [0.5], [0.1], [2.0], [6.0]])
    logits[4, 100:140] = logits[4].max() + 1  # 40 tied tokens at the top: the cut falls among them
    probs = torch.softmax(logits, dim=-1)
    assert torch.equal(sampling.top_p_keep(probs, top_p), _nucleus_by_stable_sort(probs, top_p))
