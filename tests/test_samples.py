"""n samples of a prompt: one prefill shared by copying its K/V (and taps, and last logits), each sample
with its own keyed seed; a sample's tokens are those it would get on its own."""

from __future__ import annotations

import pytest
from test_speculative import engine_for, mixed_prompts, tiny  # noqa: F401 (the fixture)

from specpilot.config import SamplingParams
from specpilot.server.protocol import sample_params

SAMPLED = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.95, seed=5)


def _prefilled_rows(engine, monkeypatch) -> list[int]:
    """The prompt rows each prefill pass computed."""
    rows: list[int] = []
    forward = engine.runner.forward

    def counting(slots, start_lens, token_lists, last_only=False, keep_hidden=False):
        if last_only:
            rows.append(sum(map(len, token_lists)))
        return forward(slots, start_lens, token_lists, last_only=last_only, keep_hidden=keep_hidden)

    monkeypatch.setattr(engine.runner, "forward", counting)
    return rows


@pytest.mark.parametrize("algorithm", [None, "dflash"])
def test_samples_share_one_prefill_and_match_their_solo_runs(tiny, monkeypatch, algorithm):
    ckpt, paths = tiny
    prompt = mixed_prompts(ckpt.config.vocab_size, 1, seed=8)[0]
    engine = engine_for(ckpt, algorithm, paths.get(algorithm))
    prefilled = _prefilled_rows(engine, monkeypatch)
    first = engine.add_request(prompt, sample_params(SAMPLED, 0))
    others = [engine.add_request(prompt, sample_params(SAMPLED, j), prefill_from=first) for j in (1, 2)]
    while engine.has_work:
        engine.step()
    assert prefilled == [len(prompt)]  # one pass over one copy of the prompt
    samples = [first, *others]
    assert len({r.sampling_seed for r in samples}) == 3
    for j, req in enumerate(samples):
        solo = engine_for(ckpt, algorithm, paths.get(algorithm)).generate([prompt], sample_params(SAMPLED, j))[0]
        assert req.output_ids == solo.output_ids
    assert len({tuple(r.output_ids) for r in samples}) > 1


def test_a_sample_admitted_after_its_first_prefills_its_own(tiny, monkeypatch):
    ckpt, _ = tiny
    prompt = mixed_prompts(ckpt.config.vocab_size, 1, seed=9)[0]
    engine = engine_for(ckpt, slots=1)
    prefilled = _prefilled_rows(engine, monkeypatch)
    greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)
    first = engine.add_request(prompt, greedy)
    second = engine.add_request(prompt, greedy, prefill_from=first)
    while engine.has_work:
        engine.step()
    assert prefilled == [len(prompt)] * 2 and second.output_ids == first.output_ids


def test_only_the_same_prompt_shares_a_prefill(tiny):
    ckpt, _ = tiny
    engine = engine_for(ckpt)
    first = engine.add_request([5, 6, 7], SAMPLED)
    with pytest.raises(ValueError, match="same prompt"):
        engine.add_request([5, 6], SAMPLED, prefill_from=first)
