"""--page-size: the KV pool's positions per page reach every cache the engine builds, never change a token (AR
and speculative, batched, through the graph paths), are reported by /get_server_info, and a bad value is refused
naming the flag. The kernels' side: tests/test_slot_attention.py and tests/invariance_cases.py over each size;
the GPU cost and the pool capacity: benchmarks/gpu_page_size.py."""

from __future__ import annotations

import pytest
from test_server_support import LiveServer
from test_speculative import GREEDY, TEST_DEVICE, TEST_DTYPE, mixed_prompts, tiny  # noqa: F401  (module fixture)

from specpilot.cli import build_parser, engine_config_from_args, main
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.state.graphs import GraphBackend, eager_capture
from specpilot.state.pages import PageTable


@pytest.mark.parametrize("speculative", [False, True], ids=["ar", "dflash-tree"])
def test_page_sizes_decode_the_same_ids(tiny, monkeypatch, speculative):  # noqa: F811
    monkeypatch.setattr(GraphBackend, "capture", staticmethod(eager_capture))  # the graph paths, scratch page too
    ckpt, paths = tiny
    spec = dict(speculative_algorithm="dflash", speculative_draft_model_path=str(paths["dflash"]),
                speculative_eagle_topk=3, speculative_ngram_assist=1) if speculative else {}
    prompts = mixed_prompts(ckpt.config.vocab_size, 6, seed=4)  # 6 requests in 4 slots: joins mid-run
    ids = {}
    for page_size in (16, 64):
        engine = Engine(ckpt, EngineConfig(device=TEST_DEVICE, dtype=TEST_DTYPE, max_running_requests=4,
                                           context_length=256, page_size=page_size, **spec))
        assert engine.config.page_size == engine.pages.page_size == page_size
        assert engine.cache.kv.shape[3] == page_size
        if speculative:
            assert engine.drafter.model.cache.pages is engine.pages  # under the n-gram assist
        ids[page_size] = [r.output_ids for r in engine.generate(prompts, GREEDY)]
    assert ids[16] == ids[64]


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "force"])
@pytest.mark.parametrize("value", ["48", "0", "-16"])
def test_a_bad_page_size_is_refused_naming_the_flag(capsys, command, value):
    with pytest.raises(SystemExit) as exc:
        main([command, "--page-size", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--page-size" in err and "power of two" in err


def test_the_flag_reaches_the_config_and_the_api_refuses_a_bad_size():
    args = build_parser().parse_args(["serve", "--page-size", "16"])
    assert engine_config_from_args(args).page_size == 16
    assert engine_config_from_args(build_parser().parse_args(["serve"])).page_size == EngineConfig.page_size
    with pytest.raises(ValueError, match="--page-size must be a positive power of two"):
        PageTable(2, 100, None, "cpu", page_size=24)


def test_server_info_reports_the_chosen_page_size(tiny_dir):
    with LiveServer(tiny_dir, max_running_requests=2, context_length=256, page_size=32) as server:
        info = server.info()
    assert info["page_size"] == info["kv_pool"]["page_size"] == 32
    assert info["kv_pool"]["pool_tokens"] == 32 * info["kv_pool"]["num_pages"]
