"""The plugin under SGLang's tensor parallelism, on CPU: two ranks of SGLang's own distributed layer over gloo.

Each rank holds half the vocabulary of SGLang's VocabParallelEmbedding and ParallelLMHead (padded as SGLang pads
it); the plugin's TargetHead must embed and project as the whole matrices do (the LM head's shards all-gathered),
and the drafter, replicated on every rank, must then draft the same tokens on each rank as on one GPU - the
verify pass's decisions are rank-independent already (keyed seeds from request ids, test_sglang_plugin.py).

The module reruns itself with SGLang's CPU test set on the path (test_sglang_plugin.py says why it lives apart).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SGLANG_DIR = Path(sys.prefix) / "sglang-cpu"
VOCAB, HIDDEN, REQUESTS = 49152, 576, 3  # the shipped drafter's target shapes
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": 1536,
          "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30, "vocab_size": VOCAB,
          "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}


def _weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """(embedding / LM head, the taps of each request's prompt, hidden rows to project, prompts): the same on
    every rank."""
    from specpilot.drafters import EMBEDDED_DRAFTER
    from specpilot.drafters.dflash_model import read_dflash_config

    g = torch.Generator().manual_seed(0)
    taps = len(read_dflash_config(EMBEDDED_DRAFTER).target_layer_ids)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 23, 40)]
    return (torch.randn(VOCAB, HIDDEN, generator=g) * 0.05, torch.randn(sum(map(len, prompts)), taps * HIDDEN,
                                                                        generator=g), torch.randn(4, HIDDEN, generator=g),
            prompts)


def _drafts(head: Any) -> list[list[int]]:
    """The shipped drafter's first drafts beside `head`, after a prefill of every request."""
    from specpilot.drafters import EMBEDDED_DRAFTER
    from specpilot.sglang_ext.session import DraftSession

    _, taps, _, prompts = _weights()
    session = DraftSession.load(EMBEDDED_DRAFTER, head, max_requests=REQUESTS, context_length=128,
                                device=torch.device("cpu"), dtype=torch.float32, block_size=8, topk=1, ngram_assist=0)
    rids = [f"r{i}" for i in range(REQUESTS)]
    outputs = [[7] for _ in prompts]
    reach = [len(p) + 16 for p in prompts]
    session.prefill(rids, prompts, outputs, [0] * REQUESTS, [len(p) for p in prompts], taps, reach)
    return session.propose(rids, prompts, outputs, reach).tokens.tolist()


def _rank(rank: int, world: int, port: int, model_dir: str, results: Any) -> None:
    global TORCHVISION_OPS
    TORCHVISION_OPS = _torchvision_ops()
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    from specpilot.sglang_ext.session import HeadShape, TargetHead
    from specpilot.sglang_ext.worker import _vocab_gather

    publish(prepare_server_args(["--model-path", model_dir, "--device", "cpu", "--skip-tokenizer-init",
                                 "--tp-size", str(world), "--disable-custom-all-reduce"]), role="test")
    init_distributed_environment(backend="gloo", world_size=world, rank=rank, local_rank=rank,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(world)
    weight, _, hidden, _ = _weights()
    embed, lm_head = VocabParallelEmbedding(VOCAB, HIDDEN), ParallelLMHead(VOCAB, HIDDEN)
    embed.weight_loader(embed.weight, weight)
    lm_head.weight_loader(lm_head.weight, weight)
    head = TargetHead(HeadShape(HIDDEN, VOCAB, CONFIG["num_hidden_layers"]), embed, lm_head.weight, _vocab_gather(world))
    ids = torch.tensor([0, 1, VOCAB // 2 - 1, VOCAB // 2, VOCAB - 1])
    results.put({"rank": rank, "shard_rows": lm_head.weight.shape[0],
                 "embed_error": (head.embed(ids) - weight[ids]).abs().max().item(),
                 "logits_error": (head.logits(hidden) - hidden @ weight.T).abs().max().item(),
                 "drafts": _drafts(head)})


def _result(results: Any, ranks: list[Any]) -> dict[str, Any]:
    """The next rank's report; a rank that died without one ends the wait."""
    import queue

    for _ in range(400):
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in ranks):
                raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in ranks]}") from None
    raise TimeoutError("the ranks did not report within 400 s")


def _under_sglang() -> dict[str, Any]:
    import torch.multiprocessing as mp
    from torch import nn

    from specpilot.optimizer.remote import free_port
    from specpilot.sglang_ext.session import HeadShape, TargetHead

    weight = _weights()[0]
    one = TargetHead(HeadShape(HIDDEN, VOCAB, CONFIG["num_hidden_layers"]), nn.Embedding.from_pretrained(weight), weight)
    with tempfile.TemporaryDirectory() as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(CONFIG))
        port = free_port()
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        ranks = [ctx.Process(target=_rank, args=(r, 2, port, model_dir, results)) for r in range(2)]
        for p in ranks:
            p.start()
        report = sorted((_result(results, ranks) for _ in ranks), key=lambda r: r["rank"])
        for p in ranks:
            p.join(timeout=60)
    return {"ranks": report, "one_rank_drafts": _drafts(one)}


@pytest.fixture(scope="module")
def tp() -> dict[str, Any]:
    if not SGLANG_DIR.is_dir():
        pytest.skip(f"SGLang's CPU test set is not installed at {SGLANG_DIR} (make install)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SGLANG_DIR), str(REPO_ROOT)])}
    proc = subprocess.run([sys.executable, __file__], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_each_rank_embeds_and_projects_as_the_whole_vocabulary(tp: dict[str, Any]) -> None:
    for rank in tp["ranks"]:
        assert rank["shard_rows"] == VOCAB // 2  # each rank holds half of SGLang's (here unpadded) vocabulary
        assert rank["embed_error"] == 0.0 and rank["logits_error"] < 1e-4


def test_every_rank_drafts_what_one_gpu_drafts(tp: dict[str, Any]) -> None:
    assert [r["drafts"] for r in tp["ranks"]] == [tp["one_rank_drafts"]] * 2


def _torchvision_ops() -> Any:
    """test_sglang_plugin's definitions SGLang's import needs, in this process (a spawned rank too)."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from test_sglang_plugin import _define_torchvision_ops

    return _define_torchvision_ops()


if __name__ == "__main__":
    TORCHVISION_OPS = _torchvision_ops()  # before SGLang's import; a global, so they stay defined
    print(json.dumps(_under_sglang()))
