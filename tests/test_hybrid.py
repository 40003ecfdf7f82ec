"""Qwen3-Next (models/hybrid.py) against Hugging Face's own implementation on a tiny random config: prefill
logits, then greedy decode through our caches equal to HF's generate, and mixed-length prompts in one batch
equal to one at a time."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from specpilot.models.hybrid import HybridConfig, HybridTransformer
from specpilot.state.batch import ForwardBatch

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48, mlp_only_layers=[2], max_position_embeddings=512,
                          rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"})
    return twins(Qwen3NextForCausalLM(cfg))


def twins(hf):
    """HF's model with random weights, and ours holding the same tensors."""
    hf.eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    ours = HybridTransformer(HybridConfig.from_hf(hf.config.to_dict()), max_positions=512).eval()
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return hf, ours


def run(model: HybridTransformer, batch: ForwardBatch, kv, states, verify: bool = False) -> torch.Tensor:
    return model.logits(model.hidden(batch, kv, states, verify)[0])


def prompts(n: int = 8, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _greedy(ours: HybridTransformer, batch_prompts: list[list[int]], new_tokens: int) -> tuple[list, list]:
    """Prefill logits per prompt and greedy continuations, all prompts in each pass."""
    kv, states = ours.caches(len(batch_prompts), 128, torch.float32, CPU)
    slots = [kv.allocate() for _ in batch_prompts]
    with torch.no_grad():
        logits = run(ours, ForwardBatch.build(slots, [0] * len(slots), batch_prompts, kv.max_len, CPU), kv, states)
        ends = torch.tensor([len(p) for p in batch_prompts]).cumsum(0) - 1
        prefill = [logits[: ends[0] + 1]] + [logits[ends[i - 1] + 1 : ends[i] + 1] for i in range(1, len(ends))]
        outputs = [[int(logits[e].argmax())] for e in ends]
        for _ in range(new_tokens - 1):
            starts = [len(p) + len(o) - 1 for p, o in zip(batch_prompts, outputs)]
            step = run(ours, ForwardBatch.build(slots, starts, [[o[-1]] for o in outputs], kv.max_len, CPU), kv,
                       states)
            for o, row in zip(outputs, step):
                o.append(int(row.argmax()))
    return prefill, outputs


def test_prefill_and_greedy_decode_equal_hugging_face(pair):
    _equal_to_hugging_face(*pair, prompts())


def test_mixed_lengths_batched_equal_one_at_a_time(pair):
    _, ours = pair
    batch = prompts(6, seed=2)
    _, together = _greedy(ours, batch, 16)
    assert together == [_greedy(ours, [p], 16)[1][0] for p in batch]


def test_qwen3_5_text_equals_hugging_face():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(3)
    cfg = Qwen3_5TextConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, max_position_embeddings=512)
    hf, ours = twins(Qwen3_5ForCausalLM(cfg))
    _equal_to_hugging_face(hf, ours, prompts(8, seed=4))


def _equal_to_hugging_face(hf, ours: HybridTransformer, batch: list[list[int]]) -> None:
    """Each prompt alone: prefill logits, and 64 greedy tokens equal to HF's generate."""
    for prompt in batch:
        (prefill,), (output,) = _greedy(ours, [prompt], 64)
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
            generated = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, min_new_tokens=64)
        torch.testing.assert_close(prefill, expected, rtol=1e-4, atol=1e-4)
        assert output == generated[0, len(prompt):].tolist()


def _tree_batch(slot: int, start: int, tokens: list[int], parents: list[int], max_len: int) -> ForwardBatch:
    """A verify of one request's draft tree: node i at its own row start + i, position start + depth."""
    batch = ForwardBatch.build([slot], [start], [tokens], max_len, CPU)
    bits, depth = [], []
    for i, p in enumerate(parents):
        bits.append((bits[p] if p >= 0 else 0) | (1 << i))
        depth.append(depth[p] + 1 if p >= 0 else 0)
    batch.positions = torch.tensor([start + d for d in depth])
    batch.tree_mask = torch.tensor([b - (1 << 64) if b >> 63 else b for b in bits], dtype=torch.int64)  # bit 63: sign
    batch.tree_parents = torch.tensor([max(p, 0) for p in parents])
    return batch


def _random_parents(rows: int, seed: int) -> list[int]:
    """A tree of `rows` verify rows (the root's first, parent -1), each node's parent an earlier row."""
    g = torch.Generator().manual_seed(seed)
    return [-1, *(int(torch.randint(0, i, (1,), generator=g)) for i in range(1, rows))]


@pytest.mark.parametrize("parents", [[-1, 0, 0, 1, 1, 2, 3, 3, 6, 0, 9, 10], _random_parents(64, 7)],
                         ids=["12 rows", "64 rows (every bit of a row's mask)"])
def test_a_tree_verify_equals_decoding_each_path_and_commits_the_accepted_one(pair, parents):
    _, ours = pair
    prompt = prompts(1, seed=5)[0]
    tokens = torch.randint(3, 320, (len(parents),), generator=torch.Generator().manual_seed(6)).tolist()

    def sequential(ids: list[int]) -> torch.Tensor:
        """The logits of ids' last token, decoded one by one after the prompt's prefill."""
        kv, states = ours.caches(1, 128, torch.float32, CPU)
        slot = kv.allocate()
        with torch.no_grad():
            run(ours, ForwardBatch.build([slot], [0], [prompt], kv.max_len, CPU), kv, states)
            for j, t in enumerate(ids):
                row = run(ours, ForwardBatch.build([slot], [len(prompt) + j], [[t]], kv.max_len, CPU), kv, states)
        return row[-1]

    def path(node: int) -> list[int]:
        out = [node]
        while parents[out[-1]] >= 0:
            out.append(parents[out[-1]])
        return out[::-1]

    kv, states = ours.caches(1, 128, torch.float32, CPU)
    slot = kv.allocate()
    with torch.no_grad():
        run(ours, ForwardBatch.build([slot], [0], [prompt], kv.max_len, CPU), kv, states)
        logits = run(ours, _tree_batch(slot, len(prompt), tokens, parents, kv.max_len), kv, states, verify=True)
    for node in range(len(parents)):
        torch.testing.assert_close(logits[node], sequential([tokens[j] for j in path(node)]), rtol=1e-4, atol=1e-4)

    accepted = max((path(node) for node in range(len(parents))), key=len)  # the deepest: 0 -> 1 -> 3 -> 6 -> 8 of 12
    nodes = torch.tensor([accepted + [0] * (len(parents) - len(accepted))])
    with torch.no_grad():
        kv.commit_accepted(torch.tensor([slot * kv.max_len + len(prompt)]), torch.tensor([len(accepted)]), nodes)
        kv.commit_paths([slot], [accepted])
        after = run(ours, ForwardBatch.build([slot], [len(prompt) + len(accepted)], [[7]], kv.max_len, CPU), kv,
                    states)
    torch.testing.assert_close(after[0], sequential([tokens[j] for j in accepted] + [7]), rtol=1e-4, atol=1e-4)
    assert not states.pending


def test_the_engine_loads_a_saved_hybrid_checkpoint_and_decodes_as_hugging_face(pair, tmp_path):
    from specpilot.config import SamplingParams
    from specpilot.engine.engine import Engine, EngineConfig

    hf, _ = pair
    hf.save_pretrained(tmp_path)  # published layout: one tensor per expert
    engine = Engine.from_config(EngineConfig(model_path=str(tmp_path), device="cpu", max_running_requests=4,
                                             context_length=128))
    batch = prompts(6, seed=8)
    reqs = engine.generate(batch, SamplingParams(max_new_tokens=24, ignore_eos=True))
    for prompt, req in zip(batch, reqs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
        assert req.output_ids == expected[0, len(prompt):].tolist()


def test_speculation_on_a_hybrid_target_passes_token_forcing(pair, tmp_path):
    """n-gram chains, batched, greedy and seeded T > 0: the verify writes no recurrent state, the commit keeps
    the accepted path's."""
    from specpilot.config import SamplingParams
    from specpilot.engine.engine import Engine, EngineConfig
    from specpilot.forcing import run_forcing

    hf, _ = pair
    hf.save_pretrained(tmp_path)

    def engine(**kw) -> Engine:
        return Engine.from_config(EngineConfig(model_path=str(tmp_path), device="cpu", max_running_requests=4,
                                               context_length=160, **kw))

    stock, cand = engine(), engine(speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    batch = [p * 3 for p in prompts(4, seed=9)]  # repeats inside, so n-gram lookup drafts
    for params in (SamplingParams(max_new_tokens=32, ignore_eos=True),
                   SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.8, top_p=0.95, seed=3)):
        verdict = run_forcing(stock, cand, batch, params, "ngram")
        assert verdict.passed and verdict.positions_checked == 4 * 32 and verdict.non_tie_mismatches == 0
    assert cand.spec_stats.tau > 1.0  # drafts were accepted, so states were committed past the first row


def _forced_with_a_drafter(pair, tmp_path, algorithm: str, drafter, prompt_seed: int, sampling_seed: int, **kw):
    """Token forcing of `algorithm` with the drafter at `drafter` over the hybrid target against stock AR, 4 requests
    batched, 24 tokens, greedy and seeded T > 0: each must pass with 0 mismatches. Returns the candidate engine."""
    from specpilot.config import SamplingParams
    from specpilot.engine.engine import Engine, EngineConfig
    from specpilot.forcing import run_forcing

    hf, _ = pair
    hf.save_pretrained(tmp_path / "target")

    def engine(**config) -> Engine:
        return Engine.from_config(EngineConfig(model_path=str(tmp_path / "target"), device="cpu",
                                               max_running_requests=4, context_length=160, **config))

    stock = engine()
    cand = engine(speculative_algorithm=algorithm, speculative_draft_model_path=str(drafter), **kw)
    batch = [p * 3 for p in prompts(4, seed=prompt_seed)]
    for params in (SamplingParams(max_new_tokens=24, ignore_eos=True),
                   SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.95,
                                  seed=sampling_seed)):
        verdict = run_forcing(stock, cand, batch, params, algorithm)
        assert verdict.passed and verdict.non_tie_mismatches == 0 and verdict.positions_checked == 4 * 24
    return cand


@pytest.mark.parametrize("topk,block,assist", [(1, None, 0), (4, 6, 1), (3, 16, 0)])
def test_dflash_chains_and_trees_on_a_hybrid_target_pass_token_forcing(pair, tmp_path, topk, block, assist):
    """A random DFlash drafter reading the hybrid target's layers: chains, and trees whose nodes the DeltaNet
    layers verify in one pass and commit along the accepted path, batched, greedy and seeded T > 0."""
    from spec_fixtures import write_random_dflash

    drafter = write_random_dflash(tmp_path / "dflash", hidden=64, num_target_layers=4, mask_token_id=319)
    cand = _forced_with_a_drafter(pair, tmp_path, "dflash", drafter, 11, 5, speculative_num_draft_tokens=block,
                                  speculative_eagle_topk=topk, speculative_ngram_assist=assist)
    if assist:  # prompt lookup's drafts got accepted: tree paths past their root were committed
        assert cand.spec_stats.tau > 1.0


@pytest.mark.parametrize("assist", [0, 2])
def test_pard_on_a_hybrid_target_passes_token_forcing(pair, tmp_path, assist):
    """A PARD drafter (a dense model of the target's vocabulary drafting a block in one pass) over the hybrid
    target, alone and with prompt lookup's assist, batched, greedy and seeded T > 0."""
    from spec_fixtures import write_random_pard

    drafter = write_random_pard(tmp_path / "pard", pard_token=319, vocab_size=320)
    cand = _forced_with_a_drafter(pair, tmp_path, "pard", drafter, 13, 7, speculative_num_draft_tokens=5,
                                  speculative_ngram_assist=assist)
    if assist:  # prompt lookup's drafts got accepted: states were committed past the first row
        assert cand.spec_stats.tau > 1.0


def test_a_planted_wrong_state_commit_fails_forcing(pair, tmp_path, monkeypatch):
    """The recurrent state committed after the newest token only, not the accepted drafts: forcing must see it."""
    from specpilot.config import SamplingParams
    from specpilot.engine.engine import Engine, EngineConfig
    from specpilot.forcing import run_forcing
    from specpilot.models.hybrid import HybridCache

    hf, _ = pair
    hf.save_pretrained(tmp_path)
    commit = HybridCache.commit_paths
    monkeypatch.setattr(HybridCache, "commit_paths", lambda self, slots, paths: commit(self, slots, [p[:1] for p in paths]))

    def engine(**kw) -> Engine:
        return Engine.from_config(EngineConfig(model_path=str(tmp_path), device="cpu", max_running_requests=4,
                                               context_length=160, **kw))

    verdict = run_forcing(engine(), engine(speculative_algorithm="ngram", speculative_num_draft_tokens=4),
                          [p * 3 for p in prompts(4, seed=9)], SamplingParams(max_new_tokens=32, ignore_eos=True), "hack")
    assert not verdict.passed and verdict.non_tie_mismatches > 0


@pytest.mark.parametrize("first_error", [0, 2, 5])
def test_an_oracle_drafter_s_accept_lengths_are_exact_on_a_hybrid_target(pair, tmp_path, first_error):
    """Drafts right up to `first_error`: every full step commits exactly that many plus the bonus, and the
    output is AR's — the committed states follow exactly the accepted drafts."""
    from spec_fixtures import OracleDrafter

    from specpilot.config import SamplingParams
    from specpilot.engine.engine import Engine, EngineConfig

    hf, _ = pair
    hf.save_pretrained(tmp_path)

    def engine() -> Engine:
        return Engine.from_config(EngineConfig(model_path=str(tmp_path), device="cpu", max_running_requests=4,
                                               context_length=160))

    batch, params, block = prompts(4, seed=12), SamplingParams(max_new_tokens=30, ignore_eos=True), 6
    ar = [r.output_ids for r in engine().generate(batch, params)]
    cand = engine()
    reqs = [cand.add_request(p, params) for p in batch]
    cand.drafter = OracleDrafter(block, {r.rid: a for r, a in zip(reqs, ar)}, first_error, 320)
    while cand.has_work:
        cand.step()
    assert [r.output_ids for r in reqs] == ar
    for r in reqs:
        full = r.accept_lengths[:-1]
        assert full and all(n == min(first_error, block - 1) + 1 for n in full)


def test_train_drafter_takes_a_hybrid_target(pair, tiny_dir, tmp_path, capsys):
    import json
    import shutil

    from specpilot.cli import main

    hf, _ = pair
    target = tmp_path / "target"
    hf.save_pretrained(target)
    for f in tiny_dir.iterdir():  # the tiny word-level tokenizer (the same 320 ids)
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, target / f.name)
    out = tmp_path / "drafter"
    assert main(["train-drafter", "--target", str(target), "--out", str(out), "--datasets", "math",
                 "--num-prompts", "4", "--validation-prompts", "2", "--max-new-tokens", "6", "--num-layers", "1",
                 "--intermediate-size", "48", "--block-size", "3", "--target-layer-ids", "0", "2", "--epochs", "1",
                 "--batch-size", "2", "--device", "cpu"]) == 0
    assert "validation tau" in capsys.readouterr().out
    assert json.loads((out / "training.json").read_text())["data"]["num_sequences"] == 4


def test_a_qwen3_5_vision_language_checkpoint_loads_its_language_model(tmp_path):
    """Qwen3.5 as published (model_type qwen3_5: text_config nested, tensors under model.language_model., a
    vision tower beside): the engine loads the language model alone and decodes text as HF's model does."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from specpilot.config import SamplingParams
    from specpilot.engine.engine import Engine, EngineConfig

    torch.manual_seed(6)
    text = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=512, linear_num_key_heads=2,
                layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2)
    hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    engine = Engine.from_config(EngineConfig(model_path=str(tmp_path), device="cpu", max_running_requests=2,
                                             context_length=128))
    for prompt, req in zip(batch := prompts(3, seed=13), engine.generate(batch, SamplingParams(max_new_tokens=20,
                                                                                                ignore_eos=True))):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20)
        assert req.output_ids == expected[0, len(prompt):].tolist()


def _eager_dflash_engine(pair, tmp_path, monkeypatch):
    """A hybrid target (no graphs) with a random DFlash drafter whose key splits follow the request count as on a
    GPU: 4, 2, 1, 1, 1, 1 for 1..6 requests."""
    from spec_fixtures import write_random_dflash

    from specpilot.drafters import dflash
    from specpilot.engine.engine import Engine, EngineConfig

    hf, _ = pair
    hf.save_pretrained(tmp_path / "target")
    path = write_random_dflash(tmp_path / "dflash", hidden=64, num_target_layers=4, mask_token_id=319)
    engine = Engine.from_config(EngineConfig(model_path=str(tmp_path / "target"), device="cpu", max_running_requests=6,
                                             context_length=160, speculative_algorithm="dflash",
                                             speculative_draft_model_path=str(path)))
    monkeypatch.setattr(dflash, "kv_splits", lambda device, b, heads: max(1, 4 // b))
    return engine


def test_the_drafter_compiles_each_key_split_choice_before_serving(pair, tmp_path, monkeypatch):
    """Without graphs (a hybrid target), the drafter's eager passes choose attention's key splits by their request
    count, each a Triton kernel of its own: `warm` runs one pass per choice, the smallest batch making it."""
    engine = _eager_dflash_engine(pair, tmp_path, monkeypatch)
    passes = []
    body = engine.drafter._body_pass
    monkeypatch.setattr(engine.drafter, "_body_pass", lambda inputs, b: passes.append(b) or body(inputs, b))
    engine.drafter.warm(6)
    assert passes == [1, 2, 3]


def test_warm_leaves_no_attention_variant_for_a_batch_tail_to_compile(pair, tmp_path, monkeypatch):
    """Each Triton launch of the drafter's attention (its non-causal block, and the split merge) is recorded with
    its specialisation, the reference computing the result: requests finishing one by one (odd counts among them)
    meet no variant that warm did not."""
    from triton_launches import LaunchRecorder

    from specpilot.config import SamplingParams
    from specpilot.kernels import slot_attention as sa

    engine = _eager_dflash_engine(pair, tmp_path, monkeypatch)
    seen: dict[tuple, str] = {}
    phase = ["warm"]

    triton_attention = sa.slot_attention_triton

    def record_then_reference(q, k, v, slots, starts, q_lens, kv_lens, scale, causal=True, max_q_len=None,
                              num_kv_splits=1, tree_mask=None, page_table=None):
        triton_attention(q, k, v, slots, starts, q_lens, kv_lens, scale, causal, max_q_len, num_kv_splits,
                         tree_mask=tree_mask, page_table=page_table)
        return sa.slot_attention_reference(q, k, v, slots, starts, q_lens, kv_lens, scale, causal,
                                           tree_mask=tree_mask, page_table=page_table)

    def block_only(kwargs: dict) -> bool:
        return kwargs["CAUSAL"] is False and kwargs["TREE"] is False

    monkeypatch.setattr(sa, "_slot_attn_fwd_kernel", LaunchRecorder(seen, phase, "fwd", block_only))
    monkeypatch.setattr(sa, "_slot_attn_combine_kernel", LaunchRecorder(seen, phase, "combine"))
    monkeypatch.setattr(sa, "slot_attention_triton", record_then_reference)
    monkeypatch.setattr(sa, "pick_backend", lambda backend, q: "triton")
    engine.drafter.warm(6)
    phase[0] = "run"
    engine.generate([[7 + i, 40 + i, 90 + i] for i in range(5)],
                    [SamplingParams(max_new_tokens=2 + 3 * i, ignore_eos=True) for i in range(5)])
    assert sum(p == "warm" for p in seen.values()) >= 4  # the block at 1, 2 and 4 splits, and merges
    assert [k for k, p in seen.items() if p == "run"] == []
