"""The paged KV pool: the page table's bookkeeping, admission by free pages (a pool smaller than its slots'
sum runs more requests at once than it has whole slots, with the tokens of whole slots), and drafters whose
caches live in the target's pages."""

from __future__ import annotations

import pytest
import torch
from test_speculative import TEST_DEVICE, TEST_DTYPE, mixed_prompts, tiny  # noqa: F401  (module fixture)

from specpilot.config import SamplingParams
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.state.pages import PageTable

CPU = torch.device("cpu")


def test_page_table_gives_whole_pages_and_takes_them_back():
    pages = PageTable(3, 100, 300, CPU, page_size=16)
    assert (pages.max_len, pages.pages_per_slot, pages.num_pages, pages.scratch_page) == (112, 7, 19, 19)
    assert not pages.whole_slots and pages.can_hold(112)
    slot = pages.allocate(20)  # two pages
    assert pages.free_pages == 17 and pages.num_free == 2
    held = pages.table[slot, :2].tolist()
    assert len(set(held)) == 2 and pages.table[slot, 2:].eq(pages.scratch_page).all()
    rows = torch.tensor([0, 15, 16, 31]) + slot * pages.max_len
    assert pages.physical(rows).tolist() == [held[0] * 16, held[0] * 16 + 15, held[1] * 16, held[1] * 16 + 15]
    assert pages.table[pages.scratch_slot].eq(pages.scratch_page).all()
    others = [pages.allocate(), pages.allocate(16)]  # a whole slot (7 pages), then one page
    assert pages.free_pages == 9 and not pages.can_hold(1)  # pages left, but no slot
    with pytest.raises(RuntimeError, match="no free slot"):
        pages.allocate(1)
    pages.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        pages.free(slot)
    assert pages.free_pages == 11 and pages.table[slot].eq(pages.scratch_page).all()
    small = PageTable(2, 112, 112, CPU, page_size=16)
    small.allocate(100)
    with pytest.raises(RuntimeError, match="need 7 pages, 0 are free"):
        small.allocate(112)
    assert {p for o in others for p in pages._held[o]}.isdisjoint(pages._free_pages)


def _engine(ckpt, paths, **kv) -> Engine:
    return Engine(ckpt, EngineConfig(device=TEST_DEVICE, dtype=TEST_DTYPE, context_length=256,
                                     speculative_algorithm="dflash", speculative_draft_model_path=paths["dflash"],
                                     speculative_ngram_assist=1, speculative_eagle_topk=3, **kv))


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    """Output ids, and the most requests that ran at once."""
    reqs = [engine.add_request(p, params) for p in prompts]
    most = 0
    while engine.has_work:
        engine.step()
        most = max(most, len(engine.running))
    return [r.output_ids for r in reqs], most


def test_a_pool_smaller_than_its_slots_admits_by_pages(tiny):
    ckpt, paths = tiny
    prompts = mixed_prompts(ckpt.config.vocab_size, 8, seed=3)
    whole = _engine(ckpt, paths, max_running_requests=8)
    # 10 pages of 64: two whole requests of 256 + spill, but 8 short ones at once
    small = _engine(ckpt, paths, max_running_requests=8, max_total_tokens=640)
    assert small.pages.num_pages == 10 and whole.pages.whole_slots and not small.pages.whole_slots
    for new_tokens, most in ((12, 8), (90, 4)):  # a prompt + 90 + spill needs 2 or 3 pages
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        expected, _ = _run(whole, prompts, params)
        got, ran = _run(small, prompts, params)
        assert got == expected and 1 < ran <= most
        assert small.pages.free_pages == 10 and small.cache.num_free == 8


def test_drafters_keep_their_cache_in_the_target_s_pages(tiny):
    ckpt, paths = tiny
    engine = _engine(ckpt, paths, max_running_requests=4, max_total_tokens=640)
    drafter = engine.drafter.model  # under the n-gram assist
    assert drafter.cache.pages is engine.pages is engine.cache.pages
    assert drafter.cache.kv.shape[2:4] == (engine.pages.num_pages + 1, engine.pages.page_size)
    pard = Engine(ckpt, EngineConfig(device=TEST_DEVICE, dtype=TEST_DTYPE, context_length=256, max_total_tokens=640,
                                     max_running_requests=4, speculative_algorithm="pard",
                                     speculative_draft_model_path=paths["pard"], speculative_num_draft_tokens=5))
    assert pard.drafter.cache.pages is pard.pages


def test_a_block_past_the_slots_spill_room_is_refused(tiny):
    from specpilot.drafters.ngram import NgramDrafter

    ckpt, _ = tiny
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens"):
        Engine(ckpt, EngineConfig(device="cpu", context_length=256, max_running_requests=2),
               drafter_factory=lambda config, ctx: NgramDrafter(block_size=100))  # a tree's room is 64


def test_samples_of_one_prompt_share_its_whole_pages(tiny):
    from specpilot.server.protocol import sample_params

    ckpt, paths = tiny
    prompt = [3 + i % 200 for i in range(150)]  # two whole pages and a part
    sampled = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.95, seed=5)
    engine = _engine(ckpt, paths, max_running_requests=4, max_total_tokens=2560)
    first = engine.add_request(prompt, sample_params(sampled, 0))
    others = [engine.add_request(prompt, sample_params(sampled, j), prefill_from=first) for j in (1, 2, 3)]
    engine.step()  # admission and the prefill
    per_request = engine.pages.pages_for(len(prompt) + 20 + engine.spill)
    assert engine.pages.num_pages - engine.pages.free_pages == per_request + 3 * (per_request - 2)
    while engine.has_work:
        engine.step()
    assert engine.pages.free_pages == engine.pages.num_pages
    for j, req in enumerate([first, *others]):
        solo = _engine(ckpt, paths, max_running_requests=1).generate([prompt], sample_params(sampled, j))[0]
        assert req.output_ids == solo.output_ids
