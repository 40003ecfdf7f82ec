"""Our engine against Hugging Face transformers: same greedy tokens on the same weights."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from reference import assert_same_up_to_near_tie, hf_greedy
from tiny_models import tiny_hf_model

from specpilot.config import SamplingParams
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.models.checkpoint import load_checkpoint

NEW_TOKENS = 64
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


def random_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def tiny_engine(tmp_path, arch: str, tied: bool):
    hf = tiny_hf_model(arch, tied=tied).eval()
    hf.save_pretrained(tmp_path)
    engine = Engine(load_checkpoint(tmp_path), EngineConfig(device="cpu", max_running_requests=8, context_length=256))
    return hf, engine


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True), ("qwen3", False)])
def test_tiny_models_match_transformers(tmp_path, arch, tied):
    hf, engine = tiny_engine(tmp_path, arch, tied)
    prompts = random_prompts(hf.config.vocab_size, 8)
    ours = engine.generate(prompts, GREEDY)
    for prompt, req in zip(prompts, ours):
        ref, margins = hf_greedy(hf, prompt, NEW_TOKENS)
        assert_same_up_to_near_tie(req.output_ids, ref, margins)


def test_batched_equals_one_at_a_time(tmp_path):
    _, engine = tiny_engine(tmp_path, "qwen3", False)
    prompts = random_prompts(engine.checkpoint.config.vocab_size, 8, seed=1)
    together = [r.output_ids for r in engine.generate(prompts, GREEDY)]
    alone = [engine.generate([p], GREEDY)[0].output_ids for p in prompts]
    assert together == alone


def test_more_requests_than_slots_complete(tmp_path):
    _, engine = tiny_engine(tmp_path, "llama", False)
    prompts = random_prompts(engine.checkpoint.config.vocab_size, 20, seed=2)
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert all(len(r.output_ids) == 5 and r.finish_reason["type"] == "length" for r in reqs)
    assert engine.cache.num_free == engine.cache.num_slots


def assert_rollback_reproduces(engine, prompt: list[int], length: int, back_to: int) -> None:
    """Decode `length` tokens, roll back to `back_to`, decode on: the same tokens come again."""
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=length + 16, ignore_eos=True))
    while len(req.output_ids) < length:
        engine.step()
    first = list(req.output_ids[:length])
    engine.rollback(req, back_to)
    while len(req.output_ids) < length:
        engine.step()
    assert req.output_ids[:length] == first


def test_rollback_then_redecode_reproduces(tmp_path):
    _, engine = tiny_engine(tmp_path, "llama", False)
    [prompt] = random_prompts(engine.checkpoint.config.vocab_size, 1, seed=3)
    assert_rollback_reproduces(engine, prompt, 20, 7)


def test_sampling_is_seeded(tmp_path):
    _, engine = tiny_engine(tmp_path, "qwen2", False)
    [prompt] = random_prompts(engine.checkpoint.config.vocab_size, 1, seed=4)
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a = engine.generate([prompt], params)[0].output_ids
    b = engine.generate([prompt], params)[0].output_ids
    c = engine.generate([prompt], SamplingParams(max_new_tokens=20, temperature=0.8, seed=8, ignore_eos=True))[0].output_ids
    assert a == b and a != c


def test_stop_token_and_min_new_tokens(tmp_path):
    _, engine = tiny_engine(tmp_path, "llama", False)
    [prompt] = random_prompts(engine.checkpoint.config.vocab_size, 1, seed=5)
    free = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].output_ids
    stop_at = free[5]
    first = free.index(stop_at)
    req = engine.generate([prompt], SamplingParams(max_new_tokens=12, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert req.output_ids == free[: first + 1]
    assert req.finish_reason == {"type": "stop", "matched": stop_at}
    late = engine.generate([prompt], SamplingParams(max_new_tokens=12, min_new_tokens=first + 3,
                                                    stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert stop_at not in late.output_ids[: first + 3]
    assert len(late.output_ids) >= first + 3


@pytest.fixture(scope="module")
def smollm(hf_smollm, embedded_checkpoint):
    engine = Engine(embedded_checkpoint, EngineConfig(device="cpu", max_running_requests=8, context_length=512))
    return hf_smollm, engine


SMOL_PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain recursion to a child.",
    "def fibonacci(n):",
    "Why is the sky blue?",
]


def test_embedded_smollm_matches_transformers(smollm):
    hf, engine = smollm
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True,
                                       return_dict=False) for p in SMOL_PROMPTS]
    ours = engine.generate(prompts, GREEDY)
    diverged = []
    for prompt, req in zip(prompts, ours):
        ref, margins = hf_greedy(hf, prompt, NEW_TOKENS)
        at = assert_same_up_to_near_tie(req.output_ids, ref, margins)
        if at is not None:
            diverged.append((at, margins[at]))
    print(f"near-tie divergences (position, margin): {diverged}")
    assert len(diverged) <= 2


def _assert_untouched(cache, slot: int, before: torch.Tensor) -> None:
    """The slot's keys of layer 0 are still `before`, bit for bit: the CPU pool is uninitialised memory, which may
    hold NaN patterns, so NaNs count as equal."""
    torch.testing.assert_close(cache.read(0, slot, cache.max_len)[0], before, rtol=0, atol=0, equal_nan=True)


def _three_prefilled(tmp_path, seed: int):
    """A tiny Llama engine with three random prompts prefilled in slots of their own: (engine, slots, lengths)."""
    _, engine = tiny_engine(tmp_path, "llama", False)
    slots = [engine.cache.allocate() for _ in range(3)]
    prompts = random_prompts(engine.checkpoint.config.vocab_size, 3, seed=seed)
    engine.runner.forward(slots, [0] * 3, prompts)
    return engine, slots, [len(p) for p in prompts]


def test_graph_input_buffers_pad_into_scratch_slot(tmp_path):
    """The static inputs CUDA graphs replay from, run eagerly: a 3-request batch in a bucket of 4
    gives the same logits as the plain batch, and the padding row writes only the scratch slot."""
    from specpilot.state.static_batch import StaticBatch

    engine, slots, starts = _three_prefilled(tmp_path, seed=6)
    runner, cache = engine.runner, engine.cache
    verify = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    plain = runner.forward(slots, starts, verify).logits
    inputs = StaticBatch(4, 4, engine.device, cache.scratch_slot, cache.max_len)
    other_slot = cache.allocate()
    before = cache.read(0, other_slot, cache.max_len)[0].clone()
    inputs.fill(slots, starts, verify, 4)
    with torch.inference_mode():
        padded = runner.run(inputs.batch(4, num_kv_splits=1)).logits
    torch.testing.assert_close(padded[:12], plain)
    _assert_untouched(cache, other_slot, before)


def test_ragged_graph_inputs_pack_requests_and_pad_into_scratch_slot(tmp_path):
    """A ragged verify's static inputs (`ragged`), run eagerly: 3 requests of 2, 4 and 1 rows packed in a bucket
    of 4 requests x 12 rows give the plain batch's logits in their rows, the spare rows and the request that
    owns none write only the scratch slot, and a fill too large for the bucket is refused."""
    from specpilot.state.static_batch import RaggedStaticBatch

    engine, slots, starts = _three_prefilled(tmp_path, seed=7)
    runner, cache = engine.runner, engine.cache
    verify = [[5, 6], [9, 10, 11, 12], [13]]
    plain = runner.forward(slots, starts, verify).logits
    inputs = RaggedStaticBatch(4, 16, 4, engine.device, cache.scratch_slot, cache.max_len, cache.max_len)
    other_slot = cache.allocate()
    before = cache.read(0, other_slot, cache.max_len)[0].clone()
    inputs.fill(slots, starts, verify, 4, 12)
    batch = inputs.batch(4, 12, num_kv_splits=1)
    assert batch.q_lens.tolist() == [2, 4, 1, 0] and batch.q_starts.tolist()[:3] == [0, 2, 6]
    with torch.inference_mode():
        packed = runner.run(batch).logits
    torch.testing.assert_close(packed[:7], plain)
    _assert_untouched(cache, other_slot, before)
    with pytest.raises(ValueError, match="cannot take 3 requests of 7 rows"):
        inputs.fill(slots, starts, verify, 4, 6)
    with pytest.raises(ValueError, match="1..4 each"):
        inputs.fill(slots, starts, [[1] * 5, [2], [3]], 4, 12)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_a_ragged_layout_made_on_the_device_is_the_host_s_fill(data):
    """RaggedStaticBatch.lay_out (device tensors in, nothing read back) writes what `fill` writes from the host."""
    from specpilot.state.static_batch import RaggedStaticBatch

    k, max_len, scratch = 5, 64, 9
    n = data.draw(st.integers(1, 4))
    b = data.draw(st.integers(n, 6))
    lengths = data.draw(st.lists(st.integers(0, k), min_size=n, max_size=n))
    t = data.draw(st.integers(n + sum(lengths), 40))
    slots = data.draw(st.lists(st.integers(0, 8), min_size=n, max_size=n, unique=True))
    starts = data.draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    drafts = data.draw(st.lists(st.lists(st.integers(3, 99), min_size=k, max_size=k), min_size=n, max_size=n))
    firsts = data.draw(st.lists(st.integers(3, 99), min_size=n, max_size=n))
    host, dev = (RaggedStaticBatch(6, 40, k + 1, torch.device("cpu"), scratch, max_len, max_len) for _ in range(2))
    host.fill(slots, starts, [[f, *d[:m]] for f, d, m in zip(firsts, drafts, lengths)], b, t)
    dev.lay_out(*(torch.tensor(v) for v in (slots, starts, firsts, drafts, lengths)), b, t)
    for name in ("input_ids", "positions", "write_index"):
        assert torch.equal(getattr(dev, name)[:t], getattr(host, name)[:t]), name
    for name in ("slot_ids", "q_starts", "q_lens", "kv_lens"):
        assert torch.equal(getattr(dev, name)[:b], getattr(host, name)[:b]), name


def test_prefill_waves_keep_outputs_and_cut_prefill_passes(tmp_path):
    """min_prefill_batch: fewer prefill passes, the same greedy outputs, every request served."""
    tiny_hf_model("qwen3").save_pretrained(tmp_path)
    ckpt = load_checkpoint(tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(4, 20))] for _ in range(40)]
    params = [SamplingParams(max_new_tokens=rng.randint(2, 24), ignore_eos=True) for _ in prompts]
    outputs, passes = {}, {}
    for wave in (1, 4):
        eng = Engine(ckpt, EngineConfig(device="cpu", max_running_requests=8, context_length=128,
                                        min_prefill_batch=wave))
        prefill, passes[wave] = eng._prefill, 0

        def counted(reqs, prefill=prefill, wave=wave):
            passes[wave] += 1
            return prefill(reqs)

        eng._prefill = counted
        outputs[wave] = [r.output_ids for r in eng.generate(prompts, params)]
    assert outputs[4] == outputs[1] and all(len(o) == p.max_new_tokens for o, p in zip(outputs[4], params))
    assert passes[4] * 2 <= passes[1], passes
