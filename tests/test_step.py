"""The speculative step's stages and mechanisms: every set of mechanisms decodes what AR decodes, and
per-request verify widths (ragged chains) run end to end."""

from __future__ import annotations

import pytest
from test_graph_paths import replays  # noqa: F401  (fixture)
from test_speculative import GREEDY, mixed_prompts, tiny  # noqa: F401  (module fixture)

from specpilot.drafters.ngram import NgramDrafter
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.forcing import run_forcing
from specpilot.state.draft import Draft

MECHANISM_SETS = [frozenset(), frozenset({"device-acceptance"}), frozenset({"device-acceptance", "early-launch"}),
                  frozenset({"device-acceptance", "layout-ahead"}), None]


def _engine(ckpt, **config) -> Engine:
    return Engine(ckpt, EngineConfig(device="cpu", max_running_requests=8, context_length=256, **config))


@pytest.mark.parametrize("mechanisms", MECHANISM_SETS, ids=lambda m: "default" if m is None else ",".join(sorted(m)) or "stock")
def test_every_mechanism_set_passes_forcing_on_the_graph_paths(tiny, replays, mechanisms):  # noqa: F811
    ckpt, paths = tiny
    cand = _engine(ckpt, speculative_algorithm="dflash", speculative_draft_model_path=str(paths["dflash"]),
                   speculative_num_draft_tokens=6, speculative_eagle_topk=3, speculative_ngram_assist=2,
                   mechanisms=mechanisms)
    if mechanisms is not None:
        assert cand.mechanisms == mechanisms
    else:
        assert cand.mechanisms == {"device-acceptance", "early-launch", "layout-ahead", "device-lookup", "overlap"}
    assert bool(cand.speculation.acceptance) == ("device-acceptance" in cand.mechanisms)
    prompts = mixed_prompts(ckpt.config.vocab_size, 6, seed=3)
    verdict = run_forcing(_engine(ckpt), cand, prompts, GREEDY, "dflash")
    assert verdict.passed, verdict.as_dict()


def test_a_mechanism_whose_precondition_fails_is_refused(tiny):  # noqa: F811
    ckpt, _ = tiny
    with pytest.raises(ValueError, match="--mechanisms: early-launch"):
        _engine(ckpt, speculative_algorithm="ngram", speculative_num_draft_tokens=4,
                mechanisms=frozenset({"device-acceptance", "early-launch"}))


class RaggedNgram(NgramDrafter):
    """Prompt lookup that verifies fewer drafts for some requests: widths differ within a step."""

    def propose(self, reqs):
        draft = super().propose(reqs)
        return Draft(draft.tokens, lengths=[(len(r.output_ids) + i) % self.block_size for i, r in enumerate(reqs)])


def test_ragged_verify_widths_decode_like_ar(tiny):  # noqa: F811
    ckpt, _ = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 5, seed=7)
    ar = [r.output_ids for r in _engine(ckpt).generate(prompts, GREEDY)]
    cand = _engine(ckpt, speculative_algorithm="ngram", speculative_num_draft_tokens=5)
    cand.drafter = RaggedNgram(5)
    reqs = cand.generate(prompts, GREEDY)
    assert [r.output_ids for r in reqs] == ar
    widths = {n for r in reqs for n in r.accept_lengths}
    assert max(widths) <= 5 and cand.spec_stats.steps > 0


@pytest.mark.parametrize("topk", [1, 3])
def test_sampled_steps_accept_on_the_device_and_decode_like_ar(tiny, replays, monkeypatch, topk):  # noqa: F811
    """T>0 requests (mixed with greedy ones) accept on the device by their keyed samples, on the graph
    paths with a padded bucket, and decode exactly what AR decodes with the same seeds."""
    from specpilot.config import SamplingParams
    from specpilot.engine.step import SpeculativeStep

    ckpt, paths = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 6, seed=9)
    params = [SamplingParams(max_new_tokens=32, temperature=0.0 if i % 3 == 0 else 0.9, top_p=0.95, seed=i,
                             ignore_eos=True) for i in range(6)]
    ar = [r.output_ids for r in _engine(ckpt).generate(prompts, params)]
    cand = _engine(ckpt, speculative_algorithm="dflash", speculative_draft_model_path=str(paths["dflash"]),
                   speculative_num_draft_tokens=6, speculative_eagle_topk=topk)
    walks = []
    walk = SpeculativeStep._walk
    monkeypatch.setattr(SpeculativeStep, "_walk", lambda self, *a: (walks.append(1), walk(self, *a))[1])
    assert [r.output_ids for r in cand.generate(prompts, params)] == ar
    assert not walks and cand.spec_stats.steps > 0
