"""`overlap` (engine/ahead.py): AR steps that launch the next decode pass before the host commits decode what
plain AR steps decode, through joins, finishes, sampled, logprob and stop-banning requests and speculative steps
in between; and they do use the launched passes. On CPU the graphs are the eager stand-in; with
SPECPILOT_TEST_DEVICE=cuda the real graphs."""

from __future__ import annotations

import pytest
import torch
from test_budget import _alternating, drafter_context
from test_speculative import GREEDY, TEST_DEVICE, TEST_DTYPE, mixed_prompts, tiny  # noqa: F401  (module fixture)

from specpilot.config import SamplingParams
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.engine.registry import catalog
from specpilot.state.graphs import GraphBackend, eager_capture


@pytest.fixture
def graphs(monkeypatch):
    if TEST_DEVICE == "cpu":
        monkeypatch.setattr(GraphBackend, "capture", staticmethod(eager_capture))


def _engine(ckpt, overlap: bool, slots: int = 4, **spec) -> Engine:
    mechanisms = None if not overlap else frozenset({"overlap"})
    return Engine(ckpt, EngineConfig(device=TEST_DEVICE, dtype=TEST_DTYPE, max_running_requests=slots,
                                     context_length=256, mechanisms=mechanisms, **spec))


def _params(n: int) -> list[SamplingParams]:
    """Different lengths, so requests finish at different steps and waiting ones join."""
    return [SamplingParams(max_new_tokens=12 + 7 * (i % 4), ignore_eos=True) for i in range(n)]


def test_overlap_decodes_like_plain_ar_through_joins_and_finishes(tiny, graphs):  # noqa: F811
    ckpt, _ = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 9, seed=4)  # 9 requests through 4 slots
    plain = [r.output_ids for r in _engine(ckpt, False).generate(prompts, _params(9))]
    engine = _engine(ckpt, True)
    take, taken = engine.ahead.take, []
    engine.ahead.take = lambda reqs: (taken.append((len(reqs), take(reqs))), taken[-1][1])[1]
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, _params(9))]
    while engine.has_work:
        engine.step()
    assert [r.output_ids for r in reqs] == plain
    joined = [t for n, t in taken if t is not None and len(t.kept) < n]
    # every decode step but the first takes the pass the one before launched, joins included
    assert taken[0][1] is None and all(t is not None for _, t in taken[1:]) and joined


def test_overlap_goes_on_as_requests_finish(tiny, graphs):  # noqa: F811
    """Requests of different lengths, all admitted at once: after the first decode step's host fill every step
    takes the launched pass (the finished requests' rows moved out on the device), the same tokens as plain."""
    ckpt, _ = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 4, seed=8)
    plain = [r.output_ids for r in _engine(ckpt, False).generate(prompts, _params(4))]
    engine = _engine(ckpt, True)
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, _params(4))]
    engine.step()  # prefill
    assert engine.last_step == "prefill"
    before = engine.runner.static[1].fills
    while engine.has_work:
        engine.step()
    assert [r.output_ids for r in reqs] == plain
    assert engine.runner.static[1].fills == before + 1


def test_overlap_falls_back_where_the_host_reads_the_logits(tiny, graphs):  # noqa: F811
    """Sampled, logprob and stop-banning requests beside greedy ones: each step they share runs plain (their
    tokens need the host's reading of the logits); the greedy ones overlap again once they are alone."""
    ckpt, _ = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 5, seed=5)
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True),
              SamplingParams(max_new_tokens=10, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_new_tokens=12, return_logprob=True, ignore_eos=True),
              SamplingParams(max_new_tokens=14, min_new_tokens=8),
              SamplingParams(max_new_tokens=30, ignore_eos=True)]
    plain = _engine(ckpt, False, slots=8).generate(prompts, params)
    overlapped = _engine(ckpt, True, slots=8).generate(prompts, params)
    assert [r.output_ids for r in overlapped] == [r.output_ids for r in plain]
    assert overlapped[2].logprobs == plain[2].logprobs


def test_speculative_steps_between_overlapped_ar_steps(tiny, graphs):  # noqa: F811
    """A launched AR pass goes stale when speculative steps commit tokens after it: AR, then speculation,
    then AR again on one engine decode what AR alone does."""
    ckpt, paths = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 4, seed=7)
    params = SamplingParams(max_new_tokens=36, ignore_eos=True)
    ar = [r.output_ids for r in _engine(ckpt, False).generate(prompts, params)]
    engine = _engine(ckpt, True, speculative_algorithm="dflash", speculative_draft_model_path=str(paths["dflash"]))
    assert "overlap" in engine.mechanisms
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.step()  # prefill
    for phase in ("ar", "spec", "ar", "spec", "ar"):
        for _ in range(3):
            if phase == "ar":
                with engine.autoregressive():
                    engine.step()
            else:
                engine.step()
    with engine.autoregressive():
        while engine.has_work:
            engine.step()
    assert [r.output_ids for r in reqs] == ar


def _budget_engine(ckpt, paths, overlap: bool, **spec) -> Engine:
    spec = dict(speculative_algorithm="dflash", speculative_draft_model_path=str(paths["dflash"]), **spec)
    defaults = _engine(ckpt, False, **spec).mechanisms
    return Engine(ckpt, EngineConfig(device=TEST_DEVICE, dtype=TEST_DTYPE, max_running_requests=4, context_length=256,
                                     mechanisms=defaults | {"budget"} | ({"overlap"} if overlap else set()), **spec))


PATTERN = (False, False, False, True, False, False, True, True)  # the budget's modes, step by step (True: speculate)


@pytest.mark.parametrize("topk,assist", [(1, 0), (3, 1)], ids=["chain", "tree+assist"])
def test_budget_ar_steps_overlap(tiny, graphs, topk, assist):  # noqa: F811
    """The budget's AR steps take the launched passes: runs of AR steps between speculative ones, through joins,
    decode what AR alone does."""
    ckpt, paths = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 6, seed=9)  # 6 requests in 4 slots: joins mid-run
    ar = [r.output_ids for r in _engine(ckpt, False).generate(prompts, GREEDY)]
    engine = _budget_engine(ckpt, paths, True, speculative_eagle_topk=topk, speculative_ngram_assist=assist)
    _alternating(engine, PATTERN)
    take, taken = engine.ahead.take, []
    engine.ahead.take = lambda reqs: (taken.append(take(reqs)), taken[-1])[1]
    assert [r.output_ids for r in engine.generate(prompts, GREEDY)] == ar
    assert sum(t is not None for t in taken) >= 5


def test_budget_ar_steps_keep_the_drafter_s_context_under_overlap(tiny, graphs):  # noqa: F811
    """Each overlapped AR step hands the drafter its committed token's taps (copied before the next pass
    overwrites the graph's): the DFlash context rows equal those of the same steps without overlap, bit for bit."""
    ckpt, paths = tiny
    prompt = mixed_prompts(ckpt.config.vocab_size, 1, seed=5)[0]
    contexts = [drafter_context(_budget_engine(ckpt, paths, overlap), prompt, PATTERN) for overlap in (False, True)]
    assert all(torch.equal(a, b) for a, b in zip(*contexts))


def test_overlap_needs_graphs(tiny):  # noqa: F811
    ckpt, _ = tiny
    with pytest.raises(ValueError, match="overlap needs CUDA graphs"):
        Engine(ckpt, EngineConfig(device="cpu", max_running_requests=2, context_length=64, cuda_graphs=False,
                                  mechanisms=frozenset({"overlap"})))


def test_overlap_is_listed_on_by_default():
    entry = next(m for m in catalog("cuda", None)["mechanisms"] if m["name"] == "overlap")
    assert entry["on_by_default"] is True and entry["stages"] == ["commit"]
