"""Speculative decoding is lossless: token forcing against stock AR for every drafter."""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest
import torch
from spec_fixtures import OracleDrafter, write_random_dflash, write_random_pard
from tiny_models import tiny_hf_model

from specpilot.config import SamplingParams
from specpilot.drafters.ngram import NgramIndex
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.engine.verify import Verifier
from specpilot.forcing import run_forcing
from specpilot.models.checkpoint import load_checkpoint
from specpilot.state.draft import Accepted

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


def mixed_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths with repeats inside, so n-gram lookup has something to find."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        motif = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))] + motif * rng.randint(1, 4))
    return prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_hf_model("qwen3").save_pretrained(path)
    ckpt = load_checkpoint(path)
    dflash = write_random_dflash(tmp_path_factory.mktemp("dflash"), hidden=ckpt.config.hidden_size,
                                 num_target_layers=ckpt.config.num_layers, mask_token_id=ckpt.config.vocab_size - 1)
    pard = write_random_pard(tmp_path_factory.mktemp("pard"), pard_token=ckpt.config.vocab_size - 1)
    return ckpt, {"dflash": dflash, "pard": pard}


# The forcing tests run on CPU in CI; on a GPU machine SPECPILOT_TEST_DEVICE=cuda (and
# SPECPILOT_TEST_DTYPE=bfloat16) runs them on the batch-invariant kernels, where forcing is exact.
TEST_DEVICE = os.environ.get("SPECPILOT_TEST_DEVICE", "cpu")
TEST_DTYPE = os.environ.get("SPECPILOT_TEST_DTYPE", "auto")


def engine_for(ckpt, algorithm=None, path=None, block=None, slots=8, assist=0, topk=1, graphs=True) -> Engine:
    """`graphs`: False for candidates whose planted bug patches an eager method the graphs bypass."""
    return Engine(ckpt, EngineConfig(device=TEST_DEVICE, dtype=TEST_DTYPE, max_running_requests=slots,
                                     context_length=256, speculative_algorithm=algorithm,
                                     speculative_draft_model_path=path, speculative_num_draft_tokens=block,
                                     speculative_ngram_assist=assist, speculative_eagle_topk=topk,
                                     cuda_graphs=graphs))


@pytest.mark.parametrize("algorithm,block,assist,topk", [
    ("ngram", 4, 0, 1), ("dflash", None, 0, 1), ("pard", 5, 0, 1), ("dflash", None, 1, 1), ("pard", 5, 2, 1),
    ("dflash", None, 0, 3), ("dflash", 6, 1, 4)])
def test_forcing_passes_batched_mixed_lengths(tiny, algorithm, block, assist, topk):
    ckpt, paths = tiny
    stock = engine_for(ckpt)
    cand = engine_for(ckpt, algorithm, paths.get(algorithm), block, assist=assist, topk=topk)
    prompts = mixed_prompts(ckpt.config.vocab_size, 8)
    verdict = run_forcing(stock, cand, prompts, GREEDY, algorithm)
    assert verdict.passed, verdict.as_dict()
    assert verdict.positions_checked == 8 * 40
    assert cand.cache.num_free == cand.cache.num_slots


def test_forcing_passes_with_b12_weights(tiny):
    """The b12 mechanism (the target's matrices as B12 planes) against a bf16 AR reference."""
    ckpt, paths = tiny
    config = EngineConfig(device=TEST_DEVICE, dtype="bfloat16", max_running_requests=8, context_length=256)
    stock = Engine(ckpt, config)
    cand = Engine(ckpt, replace(config, speculative_algorithm="dflash", speculative_draft_model_path=paths["dflash"],
                                mechanisms=frozenset({"b12", "device-acceptance"})))
    assert cand.weights_info()["format"] == "b12" and stock.weights_info()["format"] == "bfloat16"
    verdict = run_forcing(stock, cand, mixed_prompts(ckpt.config.vocab_size, 8), GREEDY, "dflash")
    assert verdict.passed, verdict.as_dict()


@pytest.mark.parametrize("algorithm,block", [("ngram", 4), ("dflash", None), ("pard", 5)])
def test_free_running_output_equals_ar(tiny, algorithm, block):
    ckpt, paths = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 5, seed=1)
    ar = [r.output_ids for r in engine_for(ckpt).generate(prompts, GREEDY)]
    cand = engine_for(ckpt, algorithm, paths.get(algorithm), block)
    spec = [r.output_ids for r in cand.generate(prompts, GREEDY)]
    assert spec == ar
    assert cand.spec_stats.steps > 0


@pytest.mark.parametrize("first_error", [0, 1, 3, 7])
def test_oracle_accept_length_is_exact(tiny, first_error):
    ckpt, _ = tiny
    block = 8
    prompts = mixed_prompts(ckpt.config.vocab_size, 4, seed=2)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ar = [r.output_ids for r in engine_for(ckpt).generate(prompts, params)]
    cand = engine_for(ckpt)
    reqs = [cand.add_request(p, params) for p in prompts]
    cand.drafter = OracleDrafter(block, {r.rid: a for r, a in zip(reqs, ar)}, first_error, ckpt.config.vocab_size)
    cand.spec_stats.block_size = block
    while cand.has_work:
        cand.step()
    assert [r.output_ids for r in reqs] == ar
    for r in reqs:  # every full step commits the accepted drafts + the bonus: first_error + 1 tokens
        full = r.accept_lengths[:-1]
        assert full and all(n == min(first_error, block - 1) + 1 for n in full)


class AcceptEverything(Verifier):
    """A planted hack: commits every draft without checking it."""

    def accept(self, req, rows, draft, argmax, parents=None):
        return list(draft) + [argmax[len(draft)]], list(range(1, len(draft) + 1))

    def greedy(self, argmax, drafts, starts, tree=None):
        n, q = argmax.shape
        return Accepted(torch.full((n,), q, device=argmax.device), torch.arange(q, device=argmax.device).repeat(n, 1),
                        torch.cat([drafts, argmax[:, -1:]], 1), starts)


def test_planted_accept_everything_fails_forcing(tiny, monkeypatch):
    ckpt, paths = tiny
    cand = engine_for(ckpt, "dflash", paths["dflash"], graphs=False)
    cand.verifier = AcceptEverything()
    cancelled = []  # forcing substitutes stock's tokens: each time, the draft launched early is dropped
    cancel = cand.drafter.cancel_launch
    monkeypatch.setattr(cand.drafter, "cancel_launch", lambda: (cancelled.append(cand.drafter._launched), cancel()))
    verdict = run_forcing(engine_for(ckpt), cand, mixed_prompts(ckpt.config.vocab_size, 4), GREEDY, "hack")
    assert not verdict.passed
    assert verdict.non_tie_mismatches > 0 and verdict.first_divergence is not None
    assert cancelled and all(launched is not None for launched in cancelled)


@pytest.mark.parametrize("topk", [1, 3])
def test_sampling_forcing_matches_distributions(tiny, topk):
    """T>0 takes the host walk (chains and trees: the tree's K/V compaction from the host's paths)."""
    ckpt, paths = tiny
    params = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)
    verdict = run_forcing(engine_for(ckpt), engine_for(ckpt, "dflash", paths["dflash"], topk=topk),
                          mixed_prompts(ckpt.config.vocab_size, 4), params, "dflash")
    assert verdict.passed, verdict.as_dict()


def test_sampling_verifier_is_exact_on_toy_distribution():
    """Point-mass drafts at T>0: the committed first token must follow the target distribution
    whatever the draft proposes (chi-square against the target probabilities)."""
    from specpilot.engine.sampling import target_probs
    from specpilot.state.request import Request

    vocab = 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    n = 20000
    for draft_token in (0, 4):  # a likely and an unlikely draft
        counts = torch.zeros(vocab)
        for seed in range(n):  # keyed sampling: one seed, one draw per position
            req = Request([1], params, sampling_seed=seed)
            tokens, _ = Verifier().accept(req, logits, [draft_token], [0, 0])
            counts[tokens[0]] += 1
        expected = target_probs(logits[:1], params)[0] * n
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, chi2  # 5 dof, p = 0.001


def _ngram_lookup_by_scan(ids: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """The definition: longest n-gram first, its latest earlier occurrence, padded to k."""
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start : start + n] == ids[-n:]:
                cont = ids[start + n : start + n + k]
                return cont + [cont[-1]] * (k - len(cont))
    return [ids[-1]] * k


def _indexed(ids: list[int], k: int) -> list[int]:
    index = NgramIndex(1, 4)
    index.extend(ids)
    return index.lookup(k)


def test_ngram_lookup():
    assert _indexed([5, 6, 7, 8, 9, 5, 6], 3) == [7, 8, 9]
    assert _indexed([1, 2, 3], 3) == [3, 3, 3]
    assert _indexed([4, 1, 4], 3) == [1, 4, 4]


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_ngram_index_equals_the_scan_as_the_context_grows(vocab):
    rng = random.Random(vocab)
    for _ in range(20):
        index, ids = NgramIndex(1, 4), []
        for _ in range(60):
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
            index.extend(new)
            ids += new
            assert index.lookup(7) == _ngram_lookup_by_scan(ids, 7), ids


def test_ngram_drafter_follows_committed_tokens_and_releases(tiny):
    ckpt, _ = tiny
    eng = engine_for(ckpt, "ngram")
    reqs = [eng.add_request([5, 6, 7, 8, 5, 6, 7], SamplingParams(max_new_tokens=24)) for _ in range(2)]
    steps = 0
    while eng.has_work:
        eng.step()
        steps += 1
        for r in eng.running:  # synced before this step's draft: the committed tokens up to then
            ids = eng.drafter.indexes[r.rid].ids if steps > 1 else r.prompt_ids
            assert len(ids) >= len(r.prompt_ids) and ids == r.all_ids[: len(ids)]
    assert not eng.drafter.indexes and all(r.finished for r in reqs)


def test_bad_speculative_config(tiny):
    ckpt, paths = tiny
    with pytest.raises(ValueError, match="speculative-algorithm"):
        engine_for(ckpt, "eagle9")
    with pytest.raises(ValueError, match="draft-model-path"):
        engine_for(ckpt, "dflash")
    with pytest.raises(ValueError, match="DFlashDraftModel|pard_token"):
        engine_for(ckpt, "dflash", paths["pard"])
    # the tunables' errors are the registry's (check_tunables), naming the flag
    with pytest.raises(ValueError, match=r"--speculative-ngram-assist \(ngram-assist\) needs a model drafter"):
        engine_for(ckpt, "ngram", assist=2)
    with pytest.raises(ValueError, match=r"--speculative-ngram-assist \(ngram-assist\) must be .*1\.\.4.*got 5"):
        engine_for(ckpt, "dflash", paths["dflash"], assist=5)
    with pytest.raises(ValueError, match=r"--speculative-eagle-topk \(tree-topk\) needs --speculative-algorithm"):
        engine_for(ckpt, "pard", paths["pard"], block=5, topk=2)
    with pytest.raises(ValueError, match=r"--speculative-eagle-topk \(tree-topk\) must be an integer >= 1"):
        engine_for(ckpt, "dflash", paths["dflash"], topk=0)


def test_ngram_assist_replaces_only_repeating_rows(tiny):
    """Rows whose context ends in a repeated 2-gram get the lookup's continuation; the others keep the
    model drafter's block, and the model drafter keeps following every request."""
    ckpt, paths = tiny
    eng = engine_for(ckpt, "dflash", paths["dflash"], block=5, assist=2)
    assert eng.drafter.name == "dflash+ngram" and eng.config.speculative_draft_model_path == str(paths["dflash"])
    repeating = eng.add_request([9, 5, 6, 7, 8, 5], GREEDY)  # + 6: "5 6" occurred before, followed by 7 8 5 6
    fresh = eng.add_request([10, 11, 12, 13], GREEDY)
    eng.step()  # prefill: one token each
    for req in (repeating, fresh):
        req.output_ids[-1:] = [6] if req is repeating else [14]  # pin the newest token
    model_rows = eng.drafter.model.propose([repeating, fresh]).tokens.tolist()
    rows = eng.drafter.propose([repeating, fresh]).tokens.tolist()
    assert rows[0] == [7, 8, 5, 6] and rows[1] == model_rows[1]


def test_min_new_tokens_holds_inside_a_verify_block(tiny):
    """A stop token the target prefers early is banned in every verify row before min_new_tokens, as in AR."""
    ckpt, _ = tiny
    ar, spec = engine_for(ckpt), engine_for(ckpt, "ngram", block=6)
    prompts = mixed_prompts(ckpt.config.vocab_size, 4)
    free = ar.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    for prompt, req in zip(prompts, free):
        stop = req.output_ids[1]  # the target's second token becomes a stop token
        params = SamplingParams(max_new_tokens=20, stop_token_ids=[stop], min_new_tokens=7)
        want = ar.generate([prompt], params)[0].output_ids
        got = spec.generate([prompt], params)[0].output_ids
        assert got == want and len(got) >= 7
        assert stop not in got[:6]


def test_warm_up_leaves_no_trace(tiny):
    ckpt, _ = tiny
    eng = engine_for(ckpt, "ngram")
    eng.warm_up()
    assert not eng.has_work and eng.cache.num_free == 8 and eng.spec_stats.steps == 0
    [req] = eng.generate([[5, 6, 7, 5, 6, 7]], SamplingParams(max_new_tokens=12))
    assert eng.spec_stats.committed == len(req.output_ids) - 1 == 11  # the first token comes from prefill


def test_sampling_verifier_is_exact_on_a_toy_tree():
    """Root with two drafted children (tokens 0 and 4): the first committed token follows the target's
    root distribution, and after each child the second follows that child's row, as AR sampling would."""
    from specpilot.engine.sampling import target_probs
    from specpilot.state.request import Request

    vocab = 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, 1.5, 0.3], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
                           [1.0, -1.0, 0.0, 2.0, 0.0, 0.5]])
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    n = 20000
    first = torch.zeros(vocab)
    second = {1: torch.zeros(vocab), 2: torch.zeros(vocab)}
    for seed in range(n):
        req = Request([1], params, sampling_seed=seed)
        tokens, path = Verifier().accept(req, logits, [0, 4], [0, 0, 0], parents=[0, 0])
        first[tokens[0]] += 1
        if path:
            assert tokens[0] == (0, 4)[path[0] - 1] and len(tokens) == 2
            second[path[0]][tokens[1]] += 1

    def chi2(counts, row):
        expected = target_probs(logits[row : row + 1], params)[0] * counts.sum()
        return float(((counts - expected) ** 2 / expected).sum())

    assert chi2(first, 0) < 20.5  # 5 dof, p = 0.001
    assert chi2(second[1], 1) < 20.5 and chi2(second[2], 2) < 20.5
