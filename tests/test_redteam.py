"""Red team: planted candidates that token forcing must fail (CPU statistical mode). Each breaks the
decode/verify path in a way an optimizer or a kernel change could, some too subtly to flip a token. With
SPECPILOT_TEST_DEVICE=cuda (test_speculative.engine_for) the same candidates face exact forcing in bf16."""

from __future__ import annotations

import pytest
import torch
from test_speculative import GREEDY, engine_for, mixed_prompts, tiny  # noqa: F401  (module fixture)

from specpilot.config import SamplingParams
from specpilot.drafters.ngram import NgramDrafter
from specpilot.engine.step import SpeculativeStep
from specpilot.forcing import run_forcing
from specpilot.models.runner import ModelRunner
from specpilot.state.draft import Draft
from specpilot.state.tree import TreeLayout


def _forcing(ckpt, cand, params=GREEDY, n=8):
    return run_forcing(engine_for(ckpt), cand, mixed_prompts(ckpt.config.vocab_size, n), params, "planted")


class SiblingTree(NgramDrafter):
    """Prompt lookup as a tree whose first draft node is a wrong sibling: the accepted path sits at rows
    one past its depths, so every accepted node's K/V must be moved (the tree's compaction)."""

    def propose(self, reqs):
        look = super().propose(reqs).tokens
        n, k = look.shape
        tokens = torch.cat([(look[:, :1] + 1) % self.vocab, look[:, :-1]], 1)
        parents = torch.tensor([0, 0, *range(2, k)]).expand(n, k)
        depths = torch.tensor([1, *range(1, k)]).expand(n, k)
        bits = [1, 1 | 2, 1 | 4]
        for j in range(3, k + 1):
            bits.append(bits[j - 1] | (1 << j))
        return Draft(tokens, tree=TreeLayout(tokens, parents, depths, torch.tensor(bits).expand(n, k + 1)))


def _noisy_verify(monkeypatch, cand, sigma: float) -> None:
    """The candidate's verify passes get N(0, sigma^2) added to their logits."""
    gen = torch.Generator().manual_seed(0)
    run = ModelRunner.run

    def noisy(self, batch):
        out = run(self, batch)
        if batch.max_q_len > 1 and self is cand.runner:  # verify passes only
            out.logits.add_(torch.randn(out.logits.shape, generator=gen).to(out.logits.device) * sigma)
        return out

    monkeypatch.setattr(ModelRunner, "run", noisy)


@pytest.mark.parametrize("sigma", [0.3, 0.05])
def test_noisy_verify_logits_fail_forcing(tiny, monkeypatch, sigma):  # noqa: F811
    ckpt, paths = tiny
    cand = engine_for(ckpt, "dflash", paths["dflash"], graphs=False)
    _noisy_verify(monkeypatch, cand, sigma)
    verdict = _forcing(ckpt, cand)
    assert not verdict.passed, verdict.as_dict()


def test_a_stale_kv_row_fails_forcing(tiny, monkeypatch):  # noqa: F811
    """After each verify the first request's newest cached row is overwritten by the one before it, so
    the next pass reads one stale K/V row."""
    ckpt, _ = tiny
    cand = engine_for(ckpt, "ngram", block=4)
    verify = SpeculativeStep.verify

    def stale(self, plan):
        out = verify(self, plan)
        req = plan.reqs[0]
        pos = req.cached_len - 1
        if pos > 0:
            rows = self.cache.pages.physical(torch.tensor([pos, pos - 1], device=self.cache.kv.device)
                                             + req.slot * self.cache.max_len)
            for k in self.cache.k:
                flat = k.view(-1, *k.shape[2:])
                flat[rows[0]] = flat[rows[1]]
        return out

    monkeypatch.setattr(SpeculativeStep, "verify", stale)
    assert not _forcing(ckpt, cand).passed


def test_positions_off_by_one_at_one_step_in_a_hundred_fail_forcing(tiny, monkeypatch):  # noqa: F811
    """One request's verify rows sit one RoPE position too far, once in every hundred (request, step)."""
    ckpt, _ = tiny
    cand = engine_for(ckpt, "ngram", block=4)
    plan, pairs, hits = SpeculativeStep.plan, [0], [0]

    def shifted(self, reqs, draft):
        out = plan(self, reqs, draft)
        offsets = out.offsets
        for i in range(len(reqs)):
            pairs[0] += 1
            if pairs[0] % 100 == 0:
                hits[0] += 1
                out.batch.positions[offsets[i] : offsets[i + 1]] += 1
        return out

    monkeypatch.setattr(SpeculativeStep, "plan", shifted)
    verdict = _forcing(ckpt, cand, SamplingParams(max_new_tokens=200, ignore_eos=True), n=4)
    assert hits[0] >= 2 and not verdict.passed, (hits, verdict.as_dict())


def test_tree_compaction_to_the_wrong_row_fails_forcing(tiny, monkeypatch):  # noqa: F811
    """A tree's accepted K/V move one row too far for the first request."""
    ckpt, _ = tiny
    cand = engine_for(ckpt, "ngram", block=5, graphs=False)
    cand.drafter = SiblingTree(5)
    cand.drafter.vocab = ckpt.config.vocab_size
    assert _forcing(ckpt, cand).passed  # the tree itself is lossless, and gets accepted
    assert cand.spec_stats.tau > 1.2
    commit = type(cand.cache).commit_accepted

    def off(self, base, counts, nodes):
        base = base.clone()
        base[0] += 1
        commit(self, base, counts, nodes)

    monkeypatch.setattr(type(cand.cache), "commit_accepted", off)
    assert not _forcing(ckpt, cand).passed


def test_noise_too_small_to_flip_a_token_still_fails_forcing(tiny, monkeypatch):  # noqa: F811
    """sigma 0.01 rarely flips a token; the candidate's logits still move past the tie band at stock's
    top tokens, which the verdict counts."""
    ckpt, paths = tiny
    cand = engine_for(ckpt, "dflash", paths["dflash"], graphs=False)
    _noisy_verify(monkeypatch, cand, 0.01)
    verdict = _forcing(ckpt, cand)
    assert not verdict.passed and verdict.logit_deviations > 0, verdict.as_dict()
    assert verdict.max_logit_deviation < 0.1


def test_near_tie_flips_beyond_the_null_drafters_rate_fail_forcing(tiny, monkeypatch):  # noqa: F811
    """With a band so wide that every flip counts as a near-tie, σ 0.3 verify noise still fails: the
    candidate flips far more often than stock through the same verify width (the null drafter)."""
    ckpt, paths = tiny
    cand = engine_for(ckpt, "dflash", paths["dflash"], graphs=False)
    _noisy_verify(monkeypatch, cand, 0.3)
    verdict = run_forcing(engine_for(ckpt), cand, mixed_prompts(ckpt.config.vocab_size, 8), GREEDY, "planted",
                          tie_epsilon=1e9)
    assert verdict.non_tie_mismatches == 0 and verdict.tie_mismatches > 3, verdict.as_dict()
    if verdict.exact:  # the invariant path (CUDA): any flip fails, no baseline is needed or run
        assert verdict.null_positions is None and not verdict.passed
        return
    assert verdict.null_positions == verdict.positions_checked and verdict.null_tie_mismatches <= 1
    assert verdict.tie_mismatches > verdict.tie_allowance and not verdict.passed
