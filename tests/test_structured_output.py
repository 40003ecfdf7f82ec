"""Structured output under speculation: a JSON schema, a regex or an EBNF grammar masks the target's
distribution at every decided position, so constrained speculative decoding equals constrained AR token for
token, whatever the drafter proposes (drafts that break the grammar are rejected)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from spec_fixtures import OracleDrafter, write_random_dflash
from test_logprobs import _flat, _same
from test_redteam import _noisy_verify
from test_speculative import TEST_DEVICE, TEST_DTYPE
from tiny_models import make_tiny_model_dir

from specpilot.config import SamplingParams
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.forcing import run_forcing
from specpilot.models.checkpoint import load_checkpoint
from specpilot.state.graphs import GraphBackend, eager_capture

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                           "tag": {"type": "string", "maxLength": 6}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
REGEX = r"(yes|no)-[0-9]{2,4}"
EBNF = 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [a-c] | "[" [a-c] "]"'
CONSTRAINTS = {"json_schema": json.dumps(SCHEMA), "regex": REGEX, "ebnf": EBNF}


@pytest.fixture(scope="module")
def spelled(tmp_path_factory):
    """The tiny Llama whose tokenizer spells text out (ids 6..99 are characters), and a random DFlash drafter."""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("spelled"), spelled=True)
    cfg = load_checkpoint(path).config
    dflash = write_random_dflash(tmp_path_factory.mktemp("dflash"), hidden=cfg.hidden_size,
                                 num_target_layers=cfg.num_layers, mask_token_id=cfg.vocab_size - 1)
    return path, dflash


def engine(path, **spec) -> Engine:
    return Engine(load_checkpoint(path), EngineConfig(device=TEST_DEVICE, dtype=TEST_DTYPE, context_length=256,
                                                      max_running_requests=4, **spec))


def text(eng: Engine, ids: list[int]) -> str:
    """The characters the ids spell, without the stop token."""
    return "".join(eng.tokenizer.convert_ids_to_tokens([i for i in ids if i != 2]))


def prompts(eng: Engine) -> list[list[int]]:
    return [eng.tokenizer.encode(t) for t in ("hello world", "abc", "x y z 1 2 3")]


def _valid(kind: str, out: str) -> bool:
    if kind == "json_schema":
        value = json.loads(out)
        return (set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
                and isinstance(value["tag"], str) and len(value["tag"]) <= 6)
    if kind == "regex":
        return re.fullmatch(REGEX, out) is not None
    return re.fullmatch(r"\((\[[a-c]\]|[a-c])(,(\[[a-c]\]|[a-c])){0,2}\)", out) is not None


# greedy constrained requests are checked against their grammar after acceptance: on the host's walk (ngram's
# ragged chains; a tree without device acceptance), after the device's acceptance of a chain (the next draft
# launched early, dropped when a decision changes) and of a tree (whose accepted K/V the device already moved)
SPEC = {"ngram": {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4},
        "dflash chain": {"speculative_algorithm": "dflash"},
        "dflash tree + assist": {"speculative_algorithm": "dflash", "speculative_eagle_topk": 3,
                                 "speculative_ngram_assist": 1},
        "dflash tree, host walk": {"speculative_algorithm": "dflash", "speculative_eagle_topk": 3,
                                   "mechanisms": frozenset()},
        # the graph paths (their eager stand-in): a draft launched early overwrites the drafter graph's outputs,
        # which the step's draft views, before the grammar check walks them
        "dflash chain, graph paths": {"speculative_algorithm": "dflash", "cuda_graphs": True},
        "dflash tree + assist, graph paths": {"speculative_algorithm": "dflash", "speculative_eagle_topk": 3,
                                              "speculative_ngram_assist": 1, "cuda_graphs": True}}


@pytest.mark.parametrize("kind", CONSTRAINTS)
@pytest.mark.parametrize("drafter", SPEC)
def test_constrained_speculation_equals_constrained_ar(spelled, kind, drafter, monkeypatch):
    path, dflash = spelled
    if SPEC[drafter].get("cuda_graphs"):
        monkeypatch.setattr(GraphBackend, "capture", staticmethod(eager_capture))
    params = SamplingParams(max_new_tokens=60, **{kind: CONSTRAINTS[kind]})
    ar_engine = engine(path)
    ar = ar_engine.generate(prompts(ar_engine), params)
    spec_engine = engine(path, speculative_draft_model_path=str(dflash), **SPEC[drafter])
    spec = spec_engine.generate(prompts(spec_engine), params)
    for a, s in zip(ar, spec):
        assert s.output_ids == a.output_ids and s.accept_lengths
        if a.finish_reason["type"] == "stop":  # the grammar finished within the length
            assert _valid(kind, text(ar_engine, a.output_ids)), text(ar_engine, a.output_ids)
    assert any(a.finish_reason["type"] == "stop" for a in ar)


@pytest.mark.parametrize("first_error", [2, 40])
@pytest.mark.parametrize("tree,graphs", [(False, False), (True, False), (True, True)],
                         ids=["chain", "one-branch tree", "one-branch tree, graph paths"])
def test_drafts_are_accepted_up_to_the_first_that_breaks_or_misses(spelled, first_error, tree, graphs, monkeypatch):
    """An oracle drafter proposes constrained AR's own tokens (wrong ones from `first_error` on, which may
    break the grammar): each full step accepts exactly min(first_error, K) drafts, deeper rows' masks
    included. As a tree (the chain beside a decoy), where the device's acceptance stops at the target's plain
    argmax and moves the accepted K/V before the grammar refuses that argmax, the redone decision goes on down the
    drafts the move left, whose K/V move then (on the graph paths too, whose acceptance has already laid the
    next verify out from the device's decision)."""
    path, dflash = spelled
    if graphs:
        monkeypatch.setattr(GraphBackend, "capture", staticmethod(eager_capture))
    block = 8
    params = SamplingParams(max_new_tokens=40, json_schema=CONSTRAINTS["json_schema"], ignore_eos=True)
    ar_engine = engine(path)
    ar = [r.output_ids for r in ar_engine.generate(prompts(ar_engine), params)]
    # graphs of the oracle's width are captured for a DFlash drafter's tree of a block, which the oracle replaces
    spec = dict(speculative_algorithm="dflash", speculative_draft_model_path=str(dflash), speculative_eagle_topk=3,
                speculative_num_draft_tokens=block, mechanisms=frozenset({"device-acceptance", "layout-ahead"}))
    cand = engine(path, cuda_graphs=True, **spec) if graphs else engine(path)
    reqs = [cand.add_request(p, params) for p in prompts(cand)]
    oracle = OracleDrafter(block, {r.rid: a for r, a in zip(reqs, ar)}, first_error, cand.checkpoint.config.vocab_size,
                           tree, cand.device)
    if graphs:  # in place of the drafter the graphs were captured for (the setter would set up eager passes)
        cand._drafter = oracle
    else:
        cand.drafter = oracle
    cand.spec_stats.block_size = block
    while cand.has_work:
        cand.step()
    assert [r.output_ids for r in reqs] == ar
    for r in reqs:
        full = r.accept_lengths[:-1]
        assert full and all(n == min(first_error, block - 1 - tree) + 1 for n in full)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph paths"])
def test_the_drafter_reads_the_taps_of_the_redone_decision(spelled, monkeypatch, graphs):
    """After a tree's device acceptance, a decision the grammar redoes down other drafts hands the drafter those
    drafts' taps: each request's first taps are its decided path's rows, in order (what its context is made of);
    the draft launched early from the old decision is dropped."""
    path, dflash = spelled
    if graphs:
        monkeypatch.setattr(GraphBackend, "capture", staticmethod(eager_capture))
    spec = dict(SPEC["dflash tree + assist"], cuda_graphs=graphs, speculative_draft_model_path=str(dflash))
    step_type = type(engine(path, **spec).speculation)
    accept, resumed = step_type.accept, []
    move = step_type._move_resumed

    def checked(self, plan, out, clock):
        acceptance = accept(self, plan, out, clock)
        q = plan.widths[0]
        for i, decision in enumerate(acceptance.decisions):
            rows = torch.tensor(decision.rows) + i * q
            assert torch.equal(acceptance.taps[i * q : i * q + len(rows)], out.taps[rows])
        return acceptance

    monkeypatch.setattr(step_type, "accept", checked)
    monkeypatch.setattr(step_type, "_move_resumed", lambda self, *a: (resumed.append(a[2]), move(self, *a))[1])
    eng = engine(path, **spec)
    assert ("layout-ahead" in eng.mechanisms) == graphs
    ar = engine(path)
    for kind in CONSTRAINTS:
        params = SamplingParams(max_new_tokens=60, **{kind: CONSTRAINTS[kind]})
        assert [r.output_ids for r in eng.generate(prompts(eng), params)] == \
            [r.output_ids for r in ar.generate(prompts(ar), params)]
    assert resumed  # some decision went on down drafts the device had not moved


def test_seeded_constrained_sampling_is_the_same_with_and_without_speculation(spelled):
    path, dflash = spelled
    params = SamplingParams(max_new_tokens=40, temperature=0.8, top_p=0.95, seed=3, regex=REGEX)
    ar_engine = engine(path)
    ar = ar_engine.generate(prompts(ar_engine), params)
    spec = engine(path, speculative_algorithm="dflash", speculative_draft_model_path=str(dflash)).generate(
        prompts(ar_engine), params)
    assert [s.output_ids for s in spec] == [a.output_ids for a in ar]
    assert all(_valid("regex", text(ar_engine, a.output_ids)) for a in ar)


def test_logprobs_of_constrained_speculation_are_ar_s(spelled):
    """The rows that decided a constrained request's tokens are masked as AR's were before its logprobs are read
    (its verify rows were checked against the grammar after acceptance, not masked)."""
    path, dflash = spelled
    params = SamplingParams(max_new_tokens=40, json_schema=CONSTRAINTS["json_schema"], return_logprob=True,
                            top_logprobs_num=2)
    ar_engine = engine(path)
    ar = ar_engine.generate(prompts(ar_engine), params)
    spec = engine(path, **SPEC["dflash tree + assist"], speculative_draft_model_path=str(dflash)).generate(
        prompts(ar_engine), params)
    for a, s in zip(ar, spec):
        assert s.output_ids == a.output_ids and _same(_flat(s), _flat(a))
        assert all(e.top[0][1] == t for e, t in zip(s.logprobs, s.output_ids))  # masked: the token is the top


def test_forcing_passes_with_a_grammar(spelled):
    path, dflash = spelled
    stock, cand = engine(path), engine(path, speculative_algorithm="dflash", speculative_draft_model_path=str(dflash),
                                       speculative_eagle_topk=3)
    params = SamplingParams(max_new_tokens=30, ebnf=EBNF)
    verdict = run_forcing(stock, cand, prompts(stock), params, "dflash")
    assert verdict.passed, verdict.as_dict()
    # stock's teacher-forced rows carry the grammar's masks too: no masked id reads as noise, which would
    # widen the tie band to everything
    assert verdict.stock_noise < 1e-3, verdict.as_dict()


def test_forcing_with_a_grammar_still_fails_noisy_verify_logits(spelled, monkeypatch):
    path, dflash = spelled
    stock = engine(path)
    cand = engine(path, speculative_algorithm="dflash", speculative_draft_model_path=str(dflash),
                  speculative_eagle_topk=3, cuda_graphs=False)
    _noisy_verify(monkeypatch, cand, 0.05)
    verdict = run_forcing(stock, cand, prompts(stock), SamplingParams(max_new_tokens=30, ebnf=EBNF), "planted")
    assert not verdict.passed, verdict.as_dict()


def test_rollback_rewinds_the_grammar(spelled):
    path, _ = spelled
    eng = engine(path)
    params = SamplingParams(max_new_tokens=40, json_schema=CONSTRAINTS["json_schema"])
    solo = eng.generate(prompts(eng)[:1], params)[0]
    req = eng.add_request(prompts(eng)[0], params)
    while len(req.output_ids) < 8:
        eng.step()
    eng.rollback(req, 3)
    while not req.finished:
        eng.step()
    assert req.output_ids == solo.output_ids


def test_a_bad_constraint_is_a_value_error_naming_it(spelled):
    path, _ = spelled
    eng = engine(path)
    with pytest.raises(ValueError, match="json_schema"):
        eng.add_request([6, 7], SamplingParams(json_schema="{not json"))
    with pytest.raises(ValueError, match="at most one of"):
        SamplingParams(regex="a", ebnf='root ::= "a"')
