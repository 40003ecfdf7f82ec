"""KV sizing: the pool from the flags within the free memory, engines sharing one cache, admission by
pages, the CLI's per-command defaults, and the server reporting what it reserved."""

from __future__ import annotations

import json

import pytest
import torch

from specpilot.cli import build_parser, engine_config_from_args, main
from specpilot.config import SamplingParams
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.engine.memory import (
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_CPU_POOL_TOKENS,
    DEFAULT_MAX_RUNNING_REQUESTS,
    KV_MEMORY_FRACTION,
    kv_bytes_per_token,
    plan_kv,
)
from specpilot.engine.registry import open_defaults
from specpilot.forcing import run_forcing
from specpilot.models.checkpoint import load_checkpoint

CPU = torch.device("cpu")
PER_TOKEN = 1000
PLENTY = 1 << 40


def test_defaults_per_device_within_the_model():
    plan = plan_kv(CPU, PER_TOKEN, 8192, None, None, None, free_bytes=PLENTY)
    assert (plan.num_slots, plan.context_length) == (DEFAULT_MAX_RUNNING_REQUESTS["cpu"], DEFAULT_CONTEXT_LENGTH["cpu"])
    assert plan.limited_by == "the CPU default pool (--max-total-tokens)" and not plan.whole_slots
    assert plan.total_tokens == DEFAULT_CPU_POOL_TOKENS
    plan = plan_kv(CPU, PER_TOKEN, 8192, 4, None, None, free_bytes=PLENTY)
    assert plan.limited_by == "--max-running-requests" and plan.total_tokens == plan.num_slots * plan.context_length
    assert plan_kv(CPU, PER_TOKEN, 512, 2, None, None, free_bytes=PLENTY).context_length == 512  # the model's limit


def test_max_total_tokens_and_memory_cut_the_pool_not_the_slots():
    plan = plan_kv(CPU, PER_TOKEN, 8192, 16, 1000, 4500, free_bytes=PLENTY)
    assert (plan.num_slots, plan.total_tokens, plan.limited_by) == (16, 4500, "--max-total-tokens")
    assert not plan.whole_slots
    free = int(3.5 * 1000 * PER_TOKEN / KV_MEMORY_FRACTION["cpu"])  # room for 3.5 whole requests
    plan = plan_kv(CPU, PER_TOKEN, 8192, 16, 1000, None, free_bytes=free)
    assert (plan.num_slots, plan.limited_by) == (16, "memory") and plan.reserved_bytes <= plan.budget_bytes
    assert plan.total_tokens >= 3499


def test_mem_fraction_static_counts_what_the_weights_already_hold():
    total, free = 100 * 1000 * PER_TOKEN, 70 * 1000 * PER_TOKEN  # 30 "tokens' worth" x 1000 in use already
    plan = plan_kv(CPU, PER_TOKEN, 8192, 32, 1000, None, free_bytes=free, mem_fraction_static=0.5,
                   total_bytes=total)
    assert (plan.limited_by, plan.budget_bytes) == ("--mem-fraction-static", 20 * 1000 * PER_TOKEN)
    assert plan.total_tokens == 20 * 1000
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        plan_kv(CPU, PER_TOKEN, 8192, 16, 1000, None, free_bytes=free, mem_fraction_static=0.3, total_bytes=total)


@pytest.mark.parametrize("total,free,flag", [(999, PLENTY, "--max-total-tokens"), (None, 1000, "--context-length")])
def test_no_room_for_one_request_names_the_flag(total, free, flag):
    with pytest.raises(ValueError, match=flag):
        plan_kv(CPU, PER_TOKEN, 8192, 4, 1000, total, free_bytes=free)


def test_engine_reserves_the_plan_and_its_twin_shares_weights_and_cache(tiny_dir):
    ckpt = load_checkpoint(tiny_dir)
    cfg = ckpt.config
    candidate = Engine(ckpt, EngineConfig(device="cpu", max_running_requests=3, context_length=128,
                                          speculative_algorithm="ngram", speculative_num_draft_tokens=4))
    assert (candidate.config.max_running_requests, candidate.config.max_total_tokens) == (3, 3 * 128)
    # whole slots of 128 + a verify's spill (room for a tree: 64), in pages of 64, and a scratch page
    assert candidate.cache.kv.shape == (2, cfg.num_layers, 3 * 3 + 1, 64, cfg.num_kv_heads, cfg.head_dim)
    assert candidate.kv_plan.bytes_per_token == kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                                   torch.float32)
    stock = candidate.twin(speculative_algorithm=None)
    assert stock.cache is candidate.cache and stock.model is candidate.model and stock.drafter is None
    prompts = [[5, 6, 7, 5, 6, 7], [9, 10, 11, 12]]
    verdict = run_forcing(stock, candidate, prompts, SamplingParams(max_new_tokens=12, ignore_eos=True), "ngram")
    assert verdict.passed and verdict.positions_checked == 24
    assert candidate.cache.num_free == 3


def test_cli_defaults_per_command_and_device(tiny_dir):
    parser = build_parser()
    gen = parser.parse_args(["generate", "--model-path", str(tiny_dir), "--speculative-algorithm", "dflash"])
    config = engine_config_from_args(gen, max_running_requests=1)
    assert config.max_running_requests == 1 and config.context_length is None
    assert (config.speculative_eagle_topk, config.speculative_ngram_assist) == (1, 2)  # CPU: chains + assist
    assert open_defaults("cuda", "dflash") == {"speculative_eagle_topk": 4, "speculative_ngram_assist": 2}
    assert open_defaults("cuda", "pard") == {"speculative_eagle_topk": 1, "speculative_ngram_assist": 0}
    explicit = parser.parse_args(["serve", "--speculative-algorithm", "dflash", "--speculative-ngram-assist", "0",
                                  "--max-running-requests", "5"])
    config = engine_config_from_args(explicit, max_running_requests=1)
    assert (config.speculative_ngram_assist, config.max_running_requests) == (0, 5)


def test_bench_sizes_the_cache_to_its_batch(tiny_dir, tmp_path):
    assert main(["bench", "--model-path", str(tiny_dir), "--dataset", "math", "--num-prompts", "2",
                 "--max-new-tokens", "4", "--batch-size", "2", "--output-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_ar_cpu.json").read_text())
    assert report["config"]["max_running_requests"] == 2
    assert report["config"]["max_total_tokens"] == 2 * report["config"]["context_length"]
