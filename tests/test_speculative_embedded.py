"""Token forcing on the embedded SmolLM2 model: n-gram and a random DFlash drafter of its shapes."""

from __future__ import annotations

import pytest
from spec_fixtures import OracleDrafter, write_random_dflash, write_random_pard

from specpilot.config import SamplingParams
from specpilot.drafters import DFLASH_CPU_BLOCK
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.forcing import run_forcing, run_stock
from specpilot.forcing.forcing import NEAR_TIE
from specpilot.state.graphs import GraphBackend, eager_capture

PROMPTS = [
    "Write a haiku about the sea.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):",
    "List the days of the week.",
    "Repeat after me: one two three, one two three, one two three.",
    "What is 12 times 12?",
    "Explain what a hash map is in two sentences.",
    "Name three colors of the rainbow.",
    "Write the alphabet in lowercase letters separated by commas.",
]


PARAMS = SamplingParams(max_new_tokens=32)


@pytest.fixture(scope="module")
def smol(embedded_checkpoint):
    """The checkpoint, the prompts, a stock engine and one stock run every candidate is forced against."""
    ckpt = embedded_checkpoint
    tok = ckpt.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True,
                                       return_dict=False) for p in PROMPTS]
    stock_engine = engine(ckpt)
    return ckpt, prompts, stock_engine, run_stock(stock_engine, prompts, PARAMS)


def engine(ckpt, **spec) -> Engine:
    return Engine(ckpt, EngineConfig(device="cpu", max_running_requests=8, context_length=512, **spec))


@pytest.mark.parametrize("algorithm", ["ngram", "dflash", "pard"])
def test_embedded_forcing(smol, tmp_path, algorithm):
    ckpt, prompts, stock_engine, stock = smol
    spec = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": 6}
    if algorithm == "dflash":
        cfg = ckpt.config
        spec["speculative_draft_model_path"] = str(write_random_dflash(
            tmp_path / "dflash", hidden=cfg.hidden_size, num_target_layers=cfg.num_layers, mask_token_id=0,
            num_layers=1, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate=256))
    if algorithm == "pard":
        spec["speculative_draft_model_path"] = str(write_random_pard(tmp_path / "pard", pard_token=0,
                                                                     vocab_size=ckpt.config.vocab_size))
    verdict = run_forcing(stock_engine, engine(ckpt, **spec), prompts, PARAMS, algorithm, stock=stock)
    print(verdict.as_dict())
    assert verdict.passed, verdict.as_dict()
    assert verdict.positions_checked >= 8 * 4


def test_embedded_oracle_accepts_exactly(smol):
    ckpt, prompts, _, stock = smol
    ar = stock.tokens
    cand = engine(ckpt)
    reqs = [cand.add_request(p, PARAMS) for p in prompts]
    cand.drafter = OracleDrafter(6, {r.rid: a for r, a in zip(reqs, ar)}, 2, ckpt.config.vocab_size)
    cand.spec_stats.block_size = 6
    while cand.has_work:
        cand.step()
    assert [r.output_ids for r in reqs] == ar
    assert all(n == 3 for r in reqs for n in r.accept_lengths[:-1])  # the last step may end at EOS


def test_embedded_model_defaults_to_the_shipped_drafter(smol, tmp_path, monkeypatch):
    import specpilot.drafters as drafters

    ckpt = smol[0]
    cfg = ckpt.config
    shipped = write_random_dflash(tmp_path / "shipped", hidden=cfg.hidden_size, num_target_layers=cfg.num_layers,
                                  mask_token_id=16, num_layers=1, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, intermediate=256, block_size=5)
    monkeypatch.setattr(drafters, "EMBEDDED_DRAFTER", shipped)
    eng = engine(ckpt, speculative_algorithm="dflash")
    assert eng.drafter.name == "dflash" and eng.drafter.block_size == DFLASH_CPU_BLOCK  # CPU: at most 4
    # the settings in effect, as /get_server_info reports them
    assert eng.config.speculative_draft_model_path == str(shipped)
    assert eng.config.speculative_num_draft_tokens == DFLASH_CPU_BLOCK
    assert engine(ckpt, speculative_algorithm="dflash", speculative_num_draft_tokens=5).drafter.block_size == 5
    # a tree keeps the checkpoint's block on CPU too
    assert engine(ckpt, speculative_algorithm="dflash", speculative_eagle_topk=4).drafter.block_size == 5
    monkeypatch.setattr(drafters, "EMBEDDED_DRAFTER", tmp_path / "missing")
    with pytest.raises(ValueError, match="drafter is missing from the package"):
        engine(ckpt, speculative_algorithm="dflash")
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        engine(ckpt, speculative_algorithm="pard")


def test_embedded_forcing_with_the_shipped_drafter(smol, monkeypatch):
    """The packaged drafter is what `--speculative-algorithm dflash` loads on the embedded model; alone,
    with n-gram assistance and as a draft tree with assistance it is lossless, and the assistance and then
    the tree (same verify width) each add accepted tokens on these prompts (several repeat themselves). The
    tree run takes the CUDA-graph paths (eager stand-in), as served on a GPU."""
    ckpt, prompts, stock_engine, stock = smol
    taus = {}
    for assist, topk, graphs in ((0, 1, False), (2, 1, False), (2, 4, True)):
        if graphs:
            monkeypatch.setattr(GraphBackend, "capture", staticmethod(eager_capture))
        # The prompts' prefill (8 prompts, 329 tokens) replays the (8, 512) prefill graph, as at the default 2048
        # tokens; the larger buckets would never replay, and each costs a whole eager pass to capture on CPU.
        candidate = engine(ckpt, speculative_algorithm="dflash", speculative_num_draft_tokens=16,
                           speculative_ngram_assist=assist, speculative_eagle_topk=topk, prefill_graph_tokens=512)
        assert bool(candidate.runner.graphs) == graphs
        verdict = run_forcing(stock_engine, candidate, prompts, PARAMS, candidate.drafter.name, stock=stock)
        print(verdict.as_dict())
        assert verdict.passed, verdict.as_dict()
        taus[assist, topk] = verdict.tau
    assert taus[0, 1] > 1.5 and taus[2, 1] > taus[0, 1] and taus[2, 4] > taus[2, 1], taus


def test_stock_noise_keeps_the_fp32_tie_floor(smol):
    """fp32 decode and teacher-forced logits agree far below the tie floor, so it is the floor that counts."""
    *_, stock = smol
    assert stock.noise < NEAR_TIE / 10


def test_embedded_seeded_sampling_is_identical_with_and_without_speculation(smol):
    """Keyed sampling on the embedded model with its shipped drafter at make serve's CPU settings (chain
    of 4 + assist 2) and as a tree: per-request seeds give AR's exact text at T=0.8, top-p 0.95."""
    ckpt, prompts, stock_engine, _ = smol
    prompts = prompts[1:4]  # code, a list, a repetition: the drafter and the lookup both get accepted
    params = [SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=7 + i) for i in range(len(prompts))]
    ar = [r.output_ids for r in stock_engine.generate(prompts, params)]
    for topk, block in ((1, DFLASH_CPU_BLOCK), (4, 16)):
        candidate = engine(ckpt, speculative_algorithm="dflash", speculative_num_draft_tokens=block,
                           speculative_ngram_assist=2, speculative_eagle_topk=topk)
        assert [r.output_ids for r in candidate.generate(prompts, params)] == ar
        assert candidate.spec_stats.tau > 1.2
