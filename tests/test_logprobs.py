"""Logprobs under speculation: the same tokens and the same logprobs as AR (bit for bit on the invariant GPU
path; within float rounding on CPU, whose kernels are not batch-invariant), through the engine and both
HTTP APIs."""

from __future__ import annotations

import math

import pytest
import torch
from test_speculative import TEST_DEVICE, engine_for, mixed_prompts, tiny  # noqa: F401 (the fixture)

from specpilot.config import SamplingParams
from specpilot.forcing import run_forcing

NAMED = [3, 7]
WITH_LOGPROBS = SamplingParams(max_new_tokens=24, ignore_eos=True, return_logprob=True, top_logprobs_num=3,
                               token_ids_logprob=NAMED)
EXACT = TEST_DEVICE == "cuda"


def _flat(req) -> list[float]:
    return [v for e in req.logprobs for v in (e.logprob, *(lp for lp, _ in e.top), *(lp for lp, _ in e.named))]


def _same(spec: list[float], ar: list[float]) -> bool:
    if EXACT:
        return spec == ar
    return len(spec) == len(ar) and all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(spec, ar))


@pytest.mark.parametrize("algorithm,block,assist,topk", [
    ("ngram", 4, 0, 1), ("dflash", None, 1, 4), ("pard", 5, 2, 1)])
def test_speculative_logprobs_equal_ar(tiny, algorithm, block, assist, topk):
    ckpt, paths = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 4, seed=3)
    ar = engine_for(ckpt).generate(prompts, WITH_LOGPROBS)
    spec = engine_for(ckpt, algorithm, paths.get(algorithm), block, assist=assist, topk=topk).generate(
        prompts, WITH_LOGPROBS)
    for a, s in zip(ar, spec):
        assert s.output_ids == a.output_ids
        assert len(s.logprobs) == len(s.output_ids) and s.accept_lengths  # it speculated
        assert _same(_flat(s), _flat(a))
        for entry, token in zip(s.logprobs, s.output_ids):  # greedy: the token is the most likely id
            assert entry.top[0][1] == token and entry.top[0][0] == entry.logprob
            assert [lp for lp, _ in entry.top] == sorted((lp for lp, _ in entry.top), reverse=True)
            assert [i for _, i in entry.named] == NAMED and all(lp <= 0 for lp, _ in entry.named)


def test_logprobs_are_the_target_distribution_s(tiny):
    """Each entry is log_softmax of the logits a plain forward pass of the prompt and outputs gives."""
    ckpt, _ = tiny
    engine = engine_for(ckpt)
    prompt = mixed_prompts(ckpt.config.vocab_size, 1, seed=5)[0]
    req = engine.generate([prompt], WITH_LOGPROBS)[0]
    ids = prompt + req.output_ids
    out = engine.runner.forward([0], [0], [ids[:-1]])  # every position's logits, one eager pass
    expected = torch.log_softmax(out.logits[len(prompt) - 1 :].float(), dim=-1)
    for j, entry in enumerate(req.logprobs):
        assert math.isclose(entry.logprob, expected[j, req.output_ids[j]].item(), abs_tol=1e-4)
        assert math.isclose(entry.named[1][0], expected[j, NAMED[1]].item(), abs_tol=1e-4)


def test_sampled_logprobs_are_the_same_with_and_without_speculation(tiny):
    ckpt, paths = tiny
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.95, seed=11,
                            return_logprob=True)
    prompts = mixed_prompts(ckpt.config.vocab_size, 3, seed=4)
    ar = engine_for(ckpt).generate(prompts, params)
    spec = engine_for(ckpt, "dflash", paths["dflash"]).generate(prompts, params)
    for a, s in zip(ar, spec):
        assert s.output_ids == a.output_ids and _same(_flat(s), _flat(a))


def test_forcing_passes_with_logprobs_on(tiny):
    ckpt, paths = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 4)
    verdict = run_forcing(engine_for(ckpt), engine_for(ckpt, "dflash", paths["dflash"], assist=1, topk=3), prompts,
                          WITH_LOGPROBS, "dflash")
    assert verdict.passed, verdict.as_dict()


def test_rollback_drops_the_rolled_back_logprobs(tiny):
    ckpt, _ = tiny
    engine = engine_for(ckpt)
    req = engine.add_request(mixed_prompts(ckpt.config.vocab_size, 1)[0], WITH_LOGPROBS)
    while len(req.output_ids) < 6:
        engine.step()
    engine.rollback(req, 2)
    assert len(req.logprobs) == 2
    while not req.finished:
        engine.step()
    assert len(req.logprobs) == len(req.output_ids) == WITH_LOGPROBS.max_new_tokens


@pytest.mark.parametrize("start", [0, 5])
def test_prompt_logprobs_leave_the_tokens_alone(tiny, start):
    """The prompt's own logprobs (logprob_start_len) come from the prefill's hidden states; the output is that
    of a request without them."""
    ckpt, paths = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 3, seed=6)
    plain = engine_for(ckpt).generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, return_logprob=True, logprob_start_len=start,
                            top_logprobs_num=2)
    engine = engine_for(ckpt, "dflash", paths["dflash"])
    scored = engine.generate(prompts, params)
    for p, a, s in zip(prompts, plain, scored):
        assert s.output_ids == a.output_ids
        expected_len = max(len(p) - start, 0)
        assert len(s.input_logprobs) == expected_len
        if start == 0 and expected_len:
            assert s.input_logprobs[0] is None
        out = engine.runner.forward([0], [0], [p])  # each prompt position's logits, one eager pass
        reference = torch.log_softmax(out.logits.float(), dim=-1)
        for i, entry in enumerate(s.input_logprobs):
            pos = start + i
            if entry is not None:
                assert math.isclose(entry.logprob, reference[pos - 1, p[pos]].item(), abs_tol=1e-4)
                assert len(entry.top) == 2


def test_tied_top_logprobs_put_the_committed_token_first():
    """bf16 logits tie often: the top list's order among equal values must not be torch.topk's."""
    from specpilot.engine.logprobs import token_logprobs

    rows = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]])
    params = SamplingParams(return_logprob=True, top_logprobs_num=2)
    for token in (1, 3, 4):
        (entry,) = token_logprobs(rows, [token], params)
        assert entry.top[0][1] == token and entry.top[0][0] == entry.logprob
        assert entry.top[1][0] == entry.logprob and entry.top[1][1] == min({1, 3, 4} - {token})
