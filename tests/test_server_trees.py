"""The server as `make serve` runs it — DFlash draft trees with n-gram assistance, on the CUDA-graph
paths (eager stand-in) — under concurrent requests that join, finish and abort at different steps:
every completed output is the target's greedy one."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from spec_fixtures import write_random_dflash
from test_server_support import serve

from specpilot.config import SamplingParams
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.models.checkpoint import load_checkpoint
from specpilot.state.graphs import GraphBackend, eager_capture


@pytest.fixture(scope="module")
def tree_server(tiny_dir, tmp_path_factory):
    cfg = load_checkpoint(str(tiny_dir)).config
    drafter = write_random_dflash(tmp_path_factory.mktemp("dflash"), hidden=cfg.hidden_size,
                                  num_target_layers=cfg.num_layers, mask_token_id=cfg.vocab_size - 1, block_size=6)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GraphBackend, "capture", staticmethod(eager_capture))
        yield from serve(tiny_dir, max_running_requests=4, context_length=512, cuda_graphs=True,
                         speculative_algorithm="dflash", speculative_draft_model_path=str(drafter),
                         speculative_eagle_topk=3, speculative_ngram_assist=1)


def _generate(server, prompt: list[int], n: int, rid: str | None = None) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    if rid is not None:
        body["rid"] = rid
    response = httpx.post(server.url + "/generate", json=body, timeout=120, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()


def test_concurrent_tree_requests_match_greedy_ar(tree_server, tiny_dir):
    assert tree_server.ctx.engine.speculation.acceptance  # the graph paths are the ones served
    rng = random.Random(0)
    # repetitive prompts, so that prompt lookup's paths join the trees too
    jobs = [([rng.randrange(3, 300) for _ in range(rng.randrange(3, 9))] * rng.randrange(1, 4),
             rng.randrange(8, 48)) for _ in range(10)]
    with ThreadPoolExecutor(6) as pool:  # more requests than slots: they queue, join and finish apart
        futures = [pool.submit(_generate, tree_server, prompt, n) for prompt, n in jobs[:3]]
        # one long request is aborted while the others run
        long = pool.submit(_generate, tree_server, [7, 8, 9], 480, "to-abort")
        tree_server.wait_for(lambda info: "to-abort" in info["rids"])
        futures += [pool.submit(_generate, tree_server, prompt, n) for prompt, n in jobs[3:]]
        assert httpx.post(tree_server.url + "/abort_request", json={"rid": "to-abort"}, trust_env=False).json() == {
            "success": True}
        outputs = [f.result()["output_ids"] for f in futures]
        assert long.result()["meta_info"]["finish_reason"] == {"type": "abort"}
    stock = Engine.from_config(EngineConfig(model_path=str(tiny_dir), device="cpu", max_running_requests=4,
                                            context_length=512))
    for (prompt, n), got in zip(jobs, outputs):
        [req] = stock.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))
        assert got == req.output_ids
