"""The `budget` mechanism: a decode step speculates or runs AR by each batch bucket's measured rates (with
hysteresis and probes); output never depends on the choice, and the drafter keeps its context through AR
stretches."""

from __future__ import annotations

import itertools
from dataclasses import replace

import httpx
import pytest
import torch
from test_server_support import LiveServer
from test_speculative import GREEDY, TEST_DEVICE, TEST_DTYPE, mixed_prompts, tiny  # noqa: F401  (module fixture)

from specpilot.config import SamplingParams
from specpilot.engine.budget import SpeculationBudget, bucket
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.forcing import run_forcing


def _feed(budget: SpeculationBudget, batch: int, steps: int, spec_rate: float, ar_rate: float) -> list[bool]:
    """`steps` decisions, each step recorded at the given mode's rate (tokens per second)."""
    chosen = []
    for _ in range(steps):
        speculate = budget.speculate(batch)
        chosen.append(speculate)
        budget.record(batch, speculate, 100, 100 / (spec_rate if speculate else ar_rate))
    return chosen


def test_buckets_are_powers_of_two():
    assert [bucket(b) for b in (1, 2, 3, 4, 31, 32, 33, 64, 100)] == [1, 2, 2, 4, 16, 32, 32, 64, 64]


def test_speculation_goes_where_ar_is_faster_and_comes_back():
    budget = SpeculationBudget(margin=0.05, probe_every=8)
    chosen = _feed(budget, 32, 40, spec_rate=800, ar_rate=1000)
    assert chosen[:4] == [True] * 4 and not chosen[4]  # a first AR step once speculation has a rate
    assert chosen[5:].count(True) == 5 and all(c == (i % 8 == 7) for i, c in enumerate(chosen[5:], start=5))
    # acceptance rises: the next probe of speculation measures it, speculation takes over again, and AR is
    # probed in turn
    chosen = _feed(budget, 32, 16, spec_rate=2000, ar_rate=1000)
    assert chosen == [False] * 7 + [True] * 8 + [False]
    assert budget.as_dict()["buckets"]["32"]["speculate"]


def test_within_the_margin_the_mode_in_use_stays():
    budget = SpeculationBudget(margin=0.05, probe_every=1000)
    chosen = _feed(budget, 8, 30, spec_rate=1000, ar_rate=1030)  # AR 3% faster: not enough to switch
    assert chosen.count(False) == 1 and not chosen[4]


def test_each_bucket_decides_on_its_own():
    budget = SpeculationBudget(probe_every=1000)
    _feed(budget, 1, 10, spec_rate=3000, ar_rate=1000)
    _feed(budget, 32, 10, spec_rate=500, ar_rate=1000)
    assert budget.speculate(1) and not budget.speculate(32)


def test_a_new_bucket_starts_in_its_nearest_measured_bucket_s_mode():
    budget = SpeculationBudget(probe_every=1000)
    _feed(budget, 32, 10, spec_rate=500, ar_rate=1000)
    assert not budget.speculate(16)  # as busy as 32's: AR, whose rate the bucket then measures
    assert budget.speculate(1) is False  # nearest measured is still 32 (16 has one mode's rate only)


def _engine(ckpt, paths, **changes) -> Engine:
    config = EngineConfig(device=TEST_DEVICE, dtype=TEST_DTYPE, max_running_requests=4, context_length=256,
                          speculative_algorithm="dflash", speculative_draft_model_path=str(paths["dflash"]))
    return Engine(ckpt, replace(config, **changes))


def _alternating(engine: Engine, pattern: tuple[bool, ...]) -> None:
    modes = itertools.cycle(pattern)
    engine.budget.speculate = lambda batch_size: next(modes)


@pytest.mark.parametrize("topk,assist", [(1, 0), (3, 1)], ids=["chain", "tree+assist"])
def test_output_is_ar_s_whichever_mode_decides(tiny, topk, assist):  # noqa: F811
    ckpt, paths = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 6, seed=2)  # 6 requests in 4 slots: joins mid-run
    ar = [r.output_ids for r in _engine(ckpt, paths, speculative_algorithm=None).generate(prompts, GREEDY)]
    spec = dict(speculative_eagle_topk=topk, speculative_ngram_assist=assist)
    defaults = _engine(ckpt, paths, **spec).mechanisms  # with every mechanism on by default here
    engine = _engine(ckpt, paths, **spec, mechanisms=defaults | {"budget"})
    _alternating(engine, (True, False, False, True, True, False))
    assert [r.output_ids for r in engine.generate(prompts, GREEDY)] == ar
    assert engine.budget.ar_steps and engine.budget.spec_steps


def drafter_context(engine: Engine, prompt: list[int], pattern: tuple[bool, ...]) -> list[torch.Tensor]:
    """Per drafter layer, the DFlash context rows of a request's prompt and first 30 new positions, once 40 tokens
    are decoded under the budget's modes `pattern` (written by then: the newest rows wait for the next draft)."""
    _alternating(engine, pattern)
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=60, ignore_eos=True))
    while len(req.output_ids) < 40:
        engine.step()
    drafter = engine.drafter
    return [torch.cat(drafter.cache.read(layer, req.slot, len(prompt) + 30)) for layer in range(len(drafter.model.layers))]


def test_the_drafter_keeps_its_context_through_ar_steps(tiny):  # noqa: F811
    """The DFlash context rows of every committed position equal those pure speculation writes."""
    ckpt, paths = tiny
    prompt = mixed_prompts(ckpt.config.vocab_size, 1, seed=5)[0]
    contexts = [drafter_context(_engine(ckpt, paths, mechanisms=frozenset({"budget"})), prompt, pattern)
                for pattern in ((True,), (False, False, True, False, True, True, False))]
    for mixed, pure in zip(*contexts):
        torch.testing.assert_close(mixed, pure, atol=2e-3, rtol=2e-3)


def test_forcing_passes_with_the_budget(tiny):  # noqa: F811
    ckpt, paths = tiny
    stock = _engine(ckpt, paths, speculative_algorithm=None)
    cand = _engine(ckpt, paths, speculative_eagle_topk=3, mechanisms=frozenset({"budget", "device-acceptance",
                                                                                 "early-launch"}))
    _alternating(cand, (True, True, False))
    verdict = run_forcing(stock, cand, mixed_prompts(ckpt.config.vocab_size, 4, seed=3), GREEDY, "budget")
    assert verdict.passed, verdict.as_dict()
    assert cand.budget.ar_steps and cand.budget.spec_steps


def test_budget_needs_a_drafter(tiny):  # noqa: F811
    ckpt, paths = tiny
    with pytest.raises(ValueError, match="--mechanisms: budget needs a drafter"):
        _engine(ckpt, paths, speculative_algorithm=None, mechanisms=frozenset({"budget"}))


def test_server_info_reports_the_budget(tiny_dir):
    with LiveServer(tiny_dir, speculative_algorithm="ngram", mechanisms=frozenset({"budget"}),
                    max_running_requests=2, context_length=256) as server:
        reply = httpx.post(f"{server.url}/generate", json={"input_ids": [5, 6, 7, 5, 6, 7, 5, 6],
                                                             "sampling_params": {"max_new_tokens": 24}}, timeout=60)
        assert reply.status_code == 200
        budget = server.info()["internal_states"][0]["spec_stats"]["budget"]
    assert budget["spec_steps"] >= 1 and budget["ar_steps"] >= 1 and "1" in budget["buckets"]


def test_steps_return_the_requests_they_finish_in_either_mode(tiny):  # noqa: F811
    """An AR step while speculation is paused reports its finished requests (the running list it was handed
    shrinks as they retire) and hands the drafter the rows of those still running."""
    ckpt, paths = tiny
    engine = _engine(ckpt, paths, mechanisms=frozenset({"budget"}))
    _alternating(engine, (False, False, True))
    prompts = mixed_prompts(ckpt.config.vocab_size, 6, seed=7)
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, (3, 9, 4, 12, 5, 7))]
    finished = []
    while engine.has_work:
        finished += engine.step()
    assert sorted(id(r) for r in finished) == sorted(id(r) for r in reqs)
    assert all(len(r.output_ids) == n for r, n in zip(reqs, (3, 9, 4, 12, 5, 7)))
