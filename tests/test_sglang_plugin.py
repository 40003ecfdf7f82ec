"""SpecPilot as an SGLang plugin (specpilot/sglang_ext/).

In this process: the conversions to SGLang's verify inputs and back, round-tripped against our engine's
verifier (its host walk, greedy and keyed sampling).

Under SGLang: the module runs itself in a child process with SGLang 0.5.17 and what its import needs on
the path (<venv>/sglang-cpu from `make install`, sglang-cpu.txt: apart from this virtualenv, whose
transformers they clash with) and TRITON_INTERPRET=1, so SGLang's tree kernels run in Triton's CPU
interpreter. It reports one JSON object: SGLang's own load_plugins() finding our entry point and
registering SPECPILOT, its server-argument parsing running our checks, its worker base class and data
classes, and its tree-build and greedy-verify kernels on our layouts. Nothing of SGLang is faked; the tests
skip when that directory is missing.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specpilot.config import SamplingParams
from specpilot.drafters import EMBEDDED_DRAFTER
from specpilot.drafters.draft_tree import TreeBuilder
from specpilot.engine.verify import Verifier
from specpilot.sglang_ext.accept import keyed_seed, row_decisions, to_sglang
from specpilot.sglang_ext.layout import VerifyTensors, tree_links, verify_tensors
from specpilot.state.request import Request
from specpilot.state.tree import TreeLayout

REPO_ROOT = Path(__file__).resolve().parents[1]
SGLANG_DIR = Path(sys.prefix) / "sglang-cpu"
VOCAB = 40


@dataclass(frozen=True)
class Case:
    name: str
    rows: int
    nodes: int  # draft nodes K; the block is K + 1
    topk: int  # 1: a chain


CASES = [Case("chain", 3, 7, 1), Case("tree-top4", 4, 15, 4), Case("tree-top2", 2, 7, 2), Case("one-draft", 1, 1, 1)]


def make_case(case: Case) -> tuple[torch.Tensor, torch.Tensor, TreeLayout | None, torch.Tensor, torch.Tensor]:
    """(newest [bs], drafts [bs, K], tree or None, seq_lens [bs], decisions [bs, K + 1]) with the target's
    decisions mostly steered into drafted children, so walks go deep."""
    g = torch.Generator().manual_seed(len(case.name) * 31 + case.nodes)
    n, k = case.rows, case.nodes
    if case.topk == 1:
        tree, drafts = None, torch.randint(0, VOCAB, (n, k), generator=g)
        parents = torch.arange(k).expand(n, k)
    else:
        probs = torch.rand(n, k, case.topk, generator=g).sort(-1, descending=True).values
        ids = torch.rand(n * k, VOCAB, generator=g).argsort(-1)[:, : case.topk].reshape(n, k, case.topk)
        tree = TreeBuilder(case.topk, k, k, torch.device("cpu")).build(probs, ids)
        drafts, parents = tree.tokens, tree.parents
    decisions = torch.randint(0, VOCAB, (n, k + 1), generator=g)
    steer = torch.rand(n, k, generator=g) < 0.8
    for r in range(n):
        for j in range(k):
            if steer[r, j]:
                decisions[r, parents[r, j]] = drafts[r, j]
    newest = torch.randint(0, VOCAB, (n,), generator=g)
    seq_lens = torch.randint(1, 30, (n,), generator=g)
    return newest, drafts, tree, seq_lens, decisions


def layout_of(case: Case, full: bool) -> VerifyTensors:
    newest, drafts, tree, seq_lens, _ = make_case(case)
    return verify_tensors(newest, drafts, tree, seq_lens, int(seq_lens.sum()) if full else None)


def ours_accepted(case: Case) -> list[list]:
    """(predict, accept_index, accept_lens) of our verifier in SGLang's layout."""
    _, drafts, tree, seq_lens, decisions = make_case(case)
    return [t.tolist() for t in to_sglang(Verifier().greedy(decisions, drafts, seq_lens, tree))]


# --------------------------------------------------------------------------------------------------------------------
# This process: the conversions against our own verifier
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_links_enumerate_each_nodes_children_in_order(case: Case) -> None:
    _, drafts, tree, _, _ = make_case(case)
    parents = torch.arange(case.nodes).expand_as(drafts) if tree is None else tree.parents
    next_token, next_sibling = tree_links(parents)
    for r in range(case.rows):
        for p in range(case.nodes + 1):
            children, j = [], int(next_token[r, p])
            while j != -1:
                children.append(j)
                j = int(next_sibling[r, j])
            assert children == [j for j in range(1, case.nodes + 1) if parents[r, j - 1] == p]
        assert next_sibling[r, 0] == -1


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_acceptance_round_trips_the_engines_verifier(case: Case, greedy: bool) -> None:
    """Logits of SGLang's verify pass -> row decisions -> the verifier's walk -> SGLang's predict /
    accept_index / accept_lens; the tokens they commit are those of the engine's host walk (Verifier.accept)
    over the same rows, and the accepted rows its path."""
    newest, drafts, tree, seq_lens, steered = make_case(case)
    bs, d = steered.shape
    g = torch.Generator().manual_seed(d)
    logits = torch.randn(bs * d, VOCAB, generator=g)
    logits[torch.arange(bs * d), steered.flatten()] += 6.0  # peaked, so sampled walks go deep as well
    params = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=0.8, top_p=0.95)
    reqs = [Request(prompt_ids=[1] * 4, params=params, output_ids=[2] * (r + 1), rid=f"r{r}") for r in range(bs)]
    for req in reqs:
        req.sampling_seed = keyed_seed(req.rid, None)
    layout = verify_tensors(newest, drafts, tree, seq_lens)
    depths = layout.positions.view(bs, d) - seq_lens[:, None]
    decisions = row_decisions(logits, [r.params for r in reqs], [r.sampling_seed for r in reqs],
                              torch.tensor([len(r.output_ids) for r in reqs]), depths)
    predict, accept_index, accept_lens = to_sglang(Verifier().greedy(decisions, drafts, seq_lens, tree))
    deep = 0
    for b, req in enumerate(reqs):
        rows = logits[b * d : (b + 1) * d]
        parents = None if tree is None else tree.parents[b].tolist()
        want, path = Verifier().accept(req, rows, drafts[b].tolist(), rows.argmax(-1).tolist(), parents)
        n = int(accept_lens[b])
        assert predict[accept_index[b, :n].long()].tolist() == want
        assert (accept_index[b, :n] - b * d).tolist() == [0, *path]
        assert accept_index[b, n:].eq(-1).all()
        deep += n > 2
    assert deep or case.nodes == 1


def test_keyed_seed_is_the_requests_or_its_ids() -> None:
    assert keyed_seed("a", 7) == 7
    assert keyed_seed("a", None) == keyed_seed("a", None) != keyed_seed("b", None)


# --------------------------------------------------------------------------------------------------------------------
# Under SGLang (child process)
# --------------------------------------------------------------------------------------------------------------------

TARGET = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
          "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30, "vocab_size": 49152,
          "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}  # SmolLM2-135M's shapes: the shipped drafter's target
# argument cases: extra flags after --model-path, --device cpu and the algorithm (DRAFT: the shipped drafter;
# TARGET / SMALL / SHORT: the target's, a too-small model's and a too-shallow one's directories), and the
# environment's n-gram assist
TRITON = ["--speculative-draft-model-path", "DRAFT", "--attention-backend", "triton"]
ARG_CASES: dict[str, tuple[list[str], str | None]] = {
    "chain": (TRITON, None),
    "tree": ([*TRITON, "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"], None),
    "deterministic-triton": ([*TRITON, "--enable-deterministic-inference"], None),
    "deterministic-flashinfer": ([*TRITON[:-1], "flashinfer", "--enable-deterministic-inference"], None),
    "no-draft": ([], None),
    "not-dflash": (["--speculative-draft-model-path", "TARGET"], None),
    "other-target": ([*TRITON, "--model-path", "SMALL"], None),
    "last-layer": ([*TRITON, "--model-path", "SHORT"], None),
    "block-too-long": ([*TRITON, "--speculative-num-draft-tokens", "17"], None),
    "block-flags-differ": ([*TRITON, "--speculative-num-draft-tokens", "8", "--speculative-dflash-block-size", "4"],
                           None),
    "num-steps": ([*TRITON, "--speculative-num-steps", "3"], None),
    "topk": ([*TRITON, "--speculative-eagle-topk", "0"], None),
    "cpu-backend": (["--speculative-draft-model-path", "DRAFT"], None),
    "paged-tree": ([*TRITON, "--speculative-eagle-topk", "4", "--page-size", "16"], None),
    "ngram-assist": (TRITON, "9"),
}
# draft paths SGLang's own parsing fails on before ours runs (it reads the draft's config first): our check
# then runs on the valid case's ServerArgs with only the path changed (NO_WEIGHTS: a config.json alone)
PATH_CASES = {"not-a-directory": "/nonexistent/drafter", "no-weights": "NO_WEIGHTS"}


def _define_torchvision_ops() -> torch.library.Library:
    """torchvision's PyPI wheel is built against CUDA torch: on our CPU torch its native ops do not load, and
    its import then fails registering fake kernels for nms and qnms, never defined. SGLang imports torchvision
    (decode_jpeg) at its top, so those two schemas are defined first; torchvision's ops stay unusable, and
    nothing here calls them. The definitions last as long as the returned library object."""
    lib = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return lib


def _eagle_encoding(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Our tree in the form SGLang's EAGLE tree builder reads (parent_list, top_scores_index, topk): node j
    is candidate parent(j) * topk + its rank among its siblings; candidate group p's parent is node p."""
    bs, k = parents.shape
    topk = k + 1  # more than any node's children
    selected = torch.zeros(bs, k, dtype=torch.int64)
    parent_list = torch.full((bs, k + 1), -1, dtype=torch.int64)
    for b in range(bs):
        seen: dict[int, int] = {}
        for j, p in enumerate(parents[b].tolist(), start=1):
            selected[b, j - 1] = p * topk + seen.get(p, 0)
            seen[p] = seen.get(p, 0) + 1
            parent_list[b, j] = selected[b, j - 1]
    return parent_list, selected, topk


def _kernel_results(case: Case) -> dict[str, Any]:
    from sglang.srt.speculative.eagle_utils import TreeMaskMode, sgl_build_tree_kernel_triton, verify_tree_greedy_triton
    from sglang.srt.speculative.spec_utils import GrammarTree

    newest, drafts, tree, seq_lens, decisions = make_case(case)
    bs, k = drafts.shape
    d = k + 1
    parents = torch.arange(k).expand(bs, k) if tree is None else tree.parents
    parent_list, selected, topk = _eagle_encoding(parents)
    built = {}
    for mode, size in ((TreeMaskMode.FULL_MASK, int(seq_lens.sum()) * d + bs * d * d),
                       (TreeMaskMode.QLEN_ONLY, bs * d * d)):
        mask, positions = torch.ones(size, dtype=torch.bool), torch.empty(bs * d, dtype=torch.int64)
        retrieve = torch.full((3, bs, d), -1, dtype=torch.int64)
        sgl_build_tree_kernel_triton(parent_list, selected, seq_lens, mask, positions, *retrieve, topk, k, d, mode)
        built[mode.name] = [mask.tolist(), positions.tolist(), *(t.tolist() for t in retrieve)]
    ours = verify_tensors(newest, drafts, tree, seq_lens)
    predict = torch.zeros(bs * d, dtype=torch.int32)
    accept_index = torch.full((bs, d), -1, dtype=torch.int32)
    accepted_drafts = torch.empty(bs, dtype=torch.int32)
    verify_tree_greedy_triton(predict, accept_index, accepted_drafts, ours.draft_token.view(bs, d), ours.retrieve_index,
                              ours.retrieve_next_token, ours.retrieve_next_sibling, decisions)
    result = {"built": built, "verified": [predict.tolist(), accept_index.tolist(), (accepted_drafts + 1).tolist()]}
    if tree is None:
        chain = GrammarTree.from_linear_chain(ours.draft_token.view(bs, d)).resolve()
        result["grammar_chain"] = [t.tolist() for t in chain]
    return result


def _drafter_graph_results(worker: type) -> dict[str, Any]:
    """What the worker's init_cuda_graphs asks of its drafter: per target (verify graphs for 1, 2, 4 and 8
    requests, or none) and tensor-parallel size, ("capture", batch sizes) or ("warm", up to how many requests)."""
    asked = {}
    for name, graph_runner, tp_size in (("graphs", SimpleNamespace(capture_bs=[1, 2, 4, 8]), 1), ("none", None, 1),
                                        ("graphs, tp 2", SimpleNamespace(capture_bs=[1, 2, 4, 8]), 2)):
        seen: list = []
        drafter = SimpleNamespace(capture=lambda sizes, sources: seen.append(["capture", list(sizes), sources]),
                                  warm=lambda most: seen.append(["warm", most]))
        ours = SimpleNamespace(server_args=SimpleNamespace(tp_size=tp_size), session=SimpleNamespace(drafter=drafter),
                               model_runner=SimpleNamespace(decode_cuda_graph_runner=graph_runner,
                                                            max_running_requests=12))
        worker.init_cuda_graphs(ours)
        asked[name] = seen
    return asked


def _argument_results(model_dirs: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(per case the error or the resolved fields, the ServerArgs of the cases SGLang accepted)."""
    from sglang.srt.server_args import prepare_server_args

    from specpilot.sglang_ext import args

    out: dict[str, Any] = {}
    accepted: dict[str, Any] = {}
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(args.__name__).addHandler(handler)
    for name, (flags, assist) in ARG_CASES.items():
        warnings.clear()
        argv = ["--model-path", model_dirs["TARGET"], "--device", "cpu", "--skip-tokenizer-init",
                "--speculative-algorithm", "specpilot", *(model_dirs.get(f, f) for f in flags)]
        if assist is not None:
            os.environ["SPECPILOT_NGRAM_ASSIST"] = assist
        try:
            sa = prepare_server_args(argv)
        except ValueError as err:
            out[name] = {"error": str(err)}
            continue
        finally:
            os.environ.pop("SPECPILOT_NGRAM_ASSIST", None)
        out[name] = {f: getattr(sa, f) for f in ("speculative_algorithm", "speculative_num_draft_tokens",
                                                  "speculative_eagle_topk", "speculative_num_steps",
                                                  "disable_overlap_schedule", "enable_mixed_chunk",
                                                  "disable_radix_cache", "max_running_requests")}
        if name.startswith("deterministic"):
            out[name] = {"warned_not_exact": any("bit for bit" in w for w in warnings)}
        accepted[name] = sa
    for name, path in PATH_CASES.items():
        sa = copy.deepcopy(accepted["chain"])
        sa.override("test", speculative_draft_model_path=model_dirs.get(path, path))  # resolved args are read-only
        try:
            args.validate(sa)
        except ValueError as err:
            out[name] = {"error": str(err)}
    logging.getLogger(args.__name__).removeHandler(handler)
    return out, accepted


def _graph_capture_results(runner_class: type, unhooked: Any, algo: Any) -> dict[str, Any]:
    """SGLang's graph runner's get_spec_info, as load_plugins() left it, on a target runner of ours and of no
    speculation: the verify input each captures its TARGET_VERIFY graphs with (the runner stands in for the GPU
    object with the four attributes the method reads)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    mask = torch.ones(64, dtype=torch.bool)
    out: dict[str, Any] = {"hooked": runner_class.get_spec_info is not unhooked}
    for name, spec_algorithm in (("specpilot", algo), ("none", SpeculativeAlgorithm.from_string(None))):
        runner = SimpleNamespace(model_runner=SimpleNamespace(spec_algorithm=spec_algorithm, is_draft_worker=False),
                                 buffers=SimpleNamespace(custom_mask=mask), captured_req_width=16)
        spec_info = runner_class.get_spec_info(runner, 32)
        if name == "specpilot":
            out["unhooked"] = unhooked(runner, 32)  # what SGLang alone captures ours with
        out[name] = None if spec_info is None else {
            "type": type(spec_info).__name__, "mask_is_the_buffer": spec_info.custom_mask is mask,
            "draft_token_num": spec_info.draft_token_num, "capture_hidden_mode": spec_info.capture_hidden_mode.name}
    return out


def _draft_kv_pool_results(algo: Any) -> dict[str, Any]:
    """SGLang's kv_cache_builder.get_draft_kv_pool, which its scheduler calls at start for every speculative
    worker, on a worker of ours (no SGLang draft worker inside) and on an EAGLE-like one (a draft runner's pool)."""
    from sglang.srt.mem_cache import kv_cache_builder
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    server_args = SimpleNamespace(enable_multi_layer_eagle=False)
    eagle = SimpleNamespace(draft_worker=SimpleNamespace(draft_runner=SimpleNamespace(token_to_kv_pool="eagle pool")))
    return {"specpilot": kv_cache_builder.get_draft_kv_pool(draft_worker=SimpleNamespace(draft_worker=None),
                                                            spec_algorithm=algo, server_args=server_args),
            "eagle": kv_cache_builder.get_draft_kv_pool(draft_worker=eagle, server_args=server_args,
                                                        spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE"))}


def _algorithm_results(algo: Any) -> dict[str, Any]:
    """Every method of SGLang's algorithm enum (which its scheduler calls on any algorithm) on ours, and what the
    three that SGLang's CustomSpecAlgo lacks answer."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    methods = [name for name, value in vars(SpeculativeAlgorithm).items()
               if callable(value) and not name.startswith("_") and name not in ("from_string", "register")]
    pool = SimpleNamespace(req_to_token=torch.zeros(4, 8, dtype=torch.int32))
    future_map = algo.create_future_map(torch.device("cpu"), pool, needs_cpu_seq_lens=False)
    return {"missing": [name for name in methods if not hasattr(algo, name)],
            "carries_draft_hidden_states": algo.carries_draft_hidden_states(), "need_topk": algo.need_topk(),
            "future_map": [type(future_map).__name__, future_map.spec_algo is algo, future_map.needs_cpu_seq_lens]}


def _admission_results(algo: Any) -> dict[str, Any]:
    """SGLang's Scheduler._add_request_to_queue as load_plugins() left it, on SGLang's own Req for each request
    feature our worker does not serve, for a SPECPILOT scheduler and one without speculation (stand-ins with the
    two attributes the method reads before queueing; their priority check stops it there)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    features = {"plain": ({}, {}), "sampled": ({"temperature": 0.7, "top_p": 0.9, "sampling_seed": 3}, {}),
                "logprobs": ({}, {"return_logprob": True}), "hidden states": ({}, {"return_hidden_states": True}),
                "json schema": ({"json_schema": '{"type": "object"}'}, {}), "logit bias": ({"logit_bias": {"5": 1.0}}, {}),
                "custom processor": ({}, {"custom_logit_processor": "serialized"}),
                "repetition penalty": ({"repetition_penalty": 1.2}, {}), "min new tokens": ({"min_new_tokens": 4}, {})}
    out: dict[str, Any] = {"hooked": hasattr(Scheduler._add_request_to_queue, "__wrapped__")}
    for server, spec_algorithm in (("specpilot", algo), ("none", SpeculativeAlgorithm.from_string(None))):
        scheduler = SimpleNamespace(spec_algorithm=spec_algorithm, _set_or_validate_priority=lambda req: False)
        for name, (params, kwargs) in features.items():
            req = Req(f"r-{name}", "text", [1, 2, 3], SGLangSamplingParams(**params), vocab_size=50, **kwargs)
            with get_parallel().override(tp_rank=0):  # an abort logs on rank 0: a scheduler's, no process group here
                Scheduler._add_request_to_queue(scheduler, req)
            out[f"{server} {name}"] = None if req.to_finish is None else [req.to_finish.message,
                                                                          int(req.to_finish.status_code)]
    return out


def _seeded_sampling_results() -> dict[str, Any]:
    """Deterministic inference: a decode batch's SamplingBatchInfo (SGLang's own dataclass) as its verify pass's
    rows, and SGLang's seeded draws (its sampler's functions, after its temperature and softmax) on those rows
    against each row drawn alone, as that request's decode at the row's position draws it."""
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    from specpilot.sglang_ext.accept import ROW_FIELDS, rows_sampling_info

    vocab, rows = 50, 3
    info = SamplingBatchInfo(
        temperatures=torch.tensor([[0.7], [1.0]]), top_ps=torch.tensor([0.9, 1.0]), top_ks=torch.tensor([20, 1 << 30]),
        min_ps=torch.zeros(2), is_all_greedy=False, is_any_greedy=False, need_top_p_sampling=True,
        need_top_k_sampling=True, need_min_p_sampling=False, vocab_size=vocab, sampling_seed=torch.tensor([7, 42]),
        device="cpu")
    expanded = rows_sampling_info(info, rows)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2 * rows, vocab, generator=g) * 3
    positions = torch.tensor([40, 41, 41, 17, 18, 19])  # the rows' input positions (a tree repeats a depth)

    def draw(row_info: Any, row_logits: torch.Tensor, row_positions: torch.Tensor) -> list[int]:
        probs = torch.softmax(row_logits / row_info.temperatures, dim=-1)  # the sampler's scaling and softmax
        with torch.compiler.set_stance("force_eager"):  # its seeded draw is compiled on a GPU
            return top_k_top_p_min_p_sampling_from_probs_torch(
                probs, row_info.top_ks, row_info.top_ps, row_info.min_ps, row_info.need_min_p_sampling,
                row_info.sampling_seed, row_positions).tolist()

    alone = []
    for r in range(2 * rows):
        one = dataclasses.replace(expanded, **{name: getattr(expanded, name)[r : r + 1] for name in ROW_FIELDS})
        alone += draw(one, logits[r : r + 1], positions[r : r + 1])
    return {"temperatures": expanded.temperatures.flatten().tolist(), "seeds": expanded.sampling_seed.tolist(),
            "top_ks": expanded.top_ks.tolist(), "flags": [expanded.is_all_greedy, expanded.need_top_p_sampling,
                                                          expanded.need_top_k_sampling, expanded.need_min_p_sampling],
            "verify_rows": draw(expanded, logits, positions), "each_alone": alone,
            "other_positions": draw(expanded, logits, positions + 1)}


def _under_sglang() -> dict[str, Any]:
    from importlib.metadata import entry_points

    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from specpilot.sglang_ext.accept import sampling_params
    from specpilot.sglang_ext.worker import to_verify_input

    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    report: dict[str, Any] = {"entry_points": {ep.name: ep.value for ep in entry_points(group=GENERAL_PLUGINS_GROUP)}}
    unhooked = DecodeCudaGraphRunner.get_spec_info
    load_plugins()  # SGLANG_PLUGINS=specpilot: ours is selected by its entry point's name
    algo = SpeculativeAlgorithm.from_string("specpilot")
    report["graph_capture"] = _graph_capture_results(DecodeCudaGraphRunner, unhooked, algo)
    report["draft_kv_pool"] = _draft_kv_pool_results(algo)
    report["algorithm_methods"] = _algorithm_results(algo)
    report["admission"] = _admission_results(algo)
    report["algorithm"] = {"repr": repr(algo), "class": type(algo).__name__, "has_draft_kv": algo.has_draft_kv(),
                           "supports_overlap": algo.supports_overlap,
                           "validator": f"{algo.validate_server_args.__module__}.{algo.validate_server_args.__name__}"}

    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"DRAFT": str(EMBEDDED_DRAFTER), "TARGET": f"{tmp}/target", "SMALL": f"{tmp}/small",
                "SHORT": f"{tmp}/short", "NO_WEIGHTS": f"{tmp}/no-weights"}
        small = TARGET | {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
        drafter = json.loads((EMBEDDED_DRAFTER / "config.json").read_text())
        short = TARGET | {"num_hidden_layers": 28}  # the drafter's last tap (27) is its last layer
        for name, config in (("TARGET", TARGET), ("SMALL", small), ("SHORT", short), ("NO_WEIGHTS", drafter)):
            Path(dirs[name]).mkdir()
            Path(dirs[name], "config.json").write_text(json.dumps(config))
        report["arguments"], accepted = _argument_results(dirs)
        valid = accepted["chain"]
        worker = algo.create_worker(valid)
        target = SimpleNamespace(update_weights_from_tensor=lambda recv_req: (True, f"target took {recv_req}"))
        ours = SimpleNamespace(_target_worker=target)  # the one attribute the weight updates read
        report["worker"] = {"class": f"{worker.__module__}.{worker.__name__}",
                            "is_base_spec_worker": issubclass(worker, BaseSpecWorker),
                            "overrides": sorted(name for name in ("forward_batch_generation", "alloc_memory_pool",
                                                                  "init_cuda_graphs", "note_request_finished",
                                                                  "clear_cache_pool")
                                                if name in vars(worker)),
                            "drafter_graphs": _drafter_graph_results(worker),
                            "weight_updates": {kind: getattr(worker, f"update_weights_from_{kind}")(ours, "update")
                                               for kind in ("disk", "ipc", "tensor")}}

    report["kernels"] = {case.name: _kernel_results(case) for case in CASES}
    verify = to_verify_input(layout_of(CASES[1], full=True))
    report["verify_input"] = {
        "type": verify.spec_input_type.name, "is_verify_input": verify.is_verify_input(),
        "num_tokens_per_req": verify.num_tokens_per_req, "max_tree_depth": verify.max_tree_depth,
        "tensors": [t.tolist() for t in (verify.draft_token, verify.custom_mask, verify.positions,
                                         verify.retrieve_index, verify.retrieve_next_token,
                                         verify.retrieve_next_sibling)],
    }
    report["seeded_sampling"] = _seeded_sampling_results()
    report["sampling"] = {}
    for name, kwargs in {"greedy": {"temperature": 0.0}, "default": {},
                         "sampled": {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "sampling_seed": 7}
                         }.items():
        ours = sampling_params(SGLangSamplingParams(**kwargs))
        report["sampling"][name] = [ours.greedy, ours.temperature, ours.top_p, ours.top_k, ours.min_p, ours.seed]
    return report


def report_under_sglang(module: str) -> dict[str, Any]:
    """The JSON report `module` prints when it reruns itself under SGLang's CPU test set (skips without it)."""
    if not SGLANG_DIR.is_dir():
        pytest.skip(f"SGLang's CPU test set is not installed at {SGLANG_DIR} (make install)")
    env = {**os.environ, "PYTHONPATH": str(SGLANG_DIR), "TRITON_INTERPRET": "1", "SGLANG_PLUGINS": "specpilot"}
    proc = subprocess.run([sys.executable, module], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sglang() -> dict[str, Any]:
    return report_under_sglang(__file__)


def test_load_plugins_finds_our_entry_point_and_registers_specpilot(sglang: dict[str, Any]) -> None:
    assert sglang["entry_points"]["specpilot"] == "specpilot.sglang_ext.plugin:register"
    assert sglang["algorithm"] == {"repr": "CustomSpecAlgo('SPECPILOT')", "class": "SpecPilotAlgorithm",
                                   "has_draft_kv": False, "supports_overlap": False,
                                   "validator": "specpilot.sglang_ext.args.validate"}


def test_the_targets_verify_graphs_are_captured_with_our_verify_input(sglang: dict[str, Any]) -> None:
    """Without the hook SGLang captures a plugin's verify graphs with no verify input: no tree mask, no hidden
    states. With it, ours get the tree-verify input on the runner's mask buffer, capturing hidden states; a
    server without speculation is untouched."""
    assert sglang["graph_capture"] == {
        "hooked": True, "unhooked": None, "none": None,
        "specpilot": {"type": "NgramVerifyInput", "mask_is_the_buffer": True, "draft_token_num": 16,
                      "capture_hidden_mode": "FULL"}}


def test_the_scheduler_finds_no_sglang_draft_kv_pool_for_ours(sglang: dict[str, Any]) -> None:
    """SGLang's scheduler reaches into any speculative worker but NGRAM's for an SGLang draft runner's K/V pool as it
    starts (it failed the first GPU launch); ours has none, and another algorithm's lookup is untouched."""
    assert sglang["draft_kv_pool"] == {"specpilot": None, "eagle": "eagle pool"}


def test_deterministic_inference_off_triton_warns_that_rows_can_differ_from_ar(sglang: dict[str, Any]) -> None:
    """Only the Triton backend verifies with decode rows (decode_rows.py); elsewhere the server says so."""
    assert sglang["arguments"]["deterministic-triton"] == {"warned_not_exact": False}
    assert sglang["arguments"]["deterministic-flashinfer"] == {"warned_not_exact": True}


def test_valid_arguments_are_resolved_for_sglang(sglang: dict[str, Any]) -> None:
    common = {"speculative_algorithm": "SPECPILOT", "speculative_num_steps": 1, "disable_overlap_schedule": True,
              "enable_mixed_chunk": False, "disable_radix_cache": True, "max_running_requests": 48}
    arguments = sglang["arguments"]
    assert arguments["chain"] == common | {"speculative_num_draft_tokens": 16, "speculative_eagle_topk": 1}
    assert arguments["tree"] == common | {"speculative_num_draft_tokens": 8, "speculative_eagle_topk": 4}


@pytest.mark.parametrize("name,says", [
    ("no-draft", "SPECPILOT needs --speculative-draft-model-path: a SpecPilot DFlash checkpoint directory"),
    ("not-a-directory", "--speculative-draft-model-path /nonexistent/drafter is not a directory"),
    ("no-weights", "no-weights has no model.safetensors; SPECPILOT needs a SpecPilot DFlash checkpoint directory"),
    ("not-dflash", "do not include DFlashDraftModel"),
    ("other-target", "does not fit --model-path"),
    ("last-layer", "must be below the target's last layer (27)"),
    ("block-too-long", "--speculative-num-draft-tokens (the block size) must be 2..16, the drafter's trained block, "
                       "got 17"),
    ("block-flags-differ", "--speculative-num-draft-tokens (8) and --speculative-dflash-block-size (4)"),
    ("num-steps", "leave --speculative-num-steps unset, got 3"),
    ("topk", "--speculative-eagle-topk (SPECPILOT's tree top-k) must be an integer >= 1"),
    ("cpu-backend", "set --attention-backend to one of flashinfer, triton (the verify pass's backend is "
                    "'torch_native')"),
    ("paged-tree", "with --page-size 16 need the flashinfer attention backend"),
    ("ngram-assist", "SPECPILOT_NGRAM_ASSIST must be 0 (off) or the n-gram length 1..4"),
])
def test_unsupported_arguments_are_refused_naming_the_flag(sglang: dict[str, Any], name: str, says: str) -> None:
    assert says in sglang["arguments"][name]["error"]


def test_the_worker_is_sglangs_and_takes_the_steps_the_scheduler_hands_it(sglang: dict[str, Any]) -> None:
    """Its module imports SGLang's scheduler-side pieces (KV bookkeeping, verify input, batch result) under
    SGLang; running it needs SGLang's model runner, which this CPU cannot build (its rotary embedding wants
    sgl-kernel or vLLM), so its drafting is tested apart (test_sglang_session.py)."""
    worker = sglang["worker"]
    assert worker["class"] == "specpilot.sglang_ext.worker.SpecPilotWorker" and worker["is_base_spec_worker"]
    assert worker["overrides"] == ["alloc_memory_pool", "forward_batch_generation", "init_cuda_graphs",
                                   "note_request_finished"]


def test_the_drafters_graphs_follow_the_targets_verify_graphs(sglang: dict[str, Any]) -> None:
    """Captured for the batch sizes of the target's verify graphs; eager but compiled up to the running requests
    where the target has no graphs, or across tensor-parallel ranks."""
    assert sglang["worker"]["drafter_graphs"] == {"graphs": [["capture", [1, 2, 4, 8], {}]],
                                                  "none": [["warm", 12]], "graphs, tp 2": [["warm", 12]]}


def test_weight_updates_reach_the_target_and_leave_the_drafter(sglang: dict[str, Any]) -> None:
    """SGLang updates the target itself from disk or IPC, then asks the draft worker (BaseSpecWorker's walk of
    SGLang draft runners would fail on ours); a tensor update goes to the draft worker instead of the target."""
    kept = [True, "updated the target's weights; the SPECPILOT drafter keeps its own"]
    assert sglang["worker"]["weight_updates"] == {"disk": kept, "ipc": kept, "tensor": [True, "target took update"]}


def test_ours_answers_every_method_sglangs_scheduler_asks_of_an_algorithm(sglang: dict[str, Any]) -> None:
    """SGLang 0.5.17's CustomSpecAlgo lacks carries_draft_hidden_states, create_future_map and need_topk, which its
    scheduler calls at start on any algorithm; ours has them all, and keeps the host's sequence lengths relayed
    (the worker sizes its tree mask from them)."""
    assert sglang["algorithm_methods"] == {"missing": [], "carries_draft_hidden_states": False, "need_topk": False,
                                           "future_map": ["FutureMap", True, True]}


REFUSED = {"logprobs": "logprobs", "hidden states": "hidden states", "json schema": "a grammar (json_schema, regex",
           "logit bias": "logit_bias", "custom processor": "a custom logit processor",
           "repetition penalty": "frequency, presence or repetition penalties", "min new tokens": "min_new_tokens"}


def test_requests_ours_cannot_serve_are_refused_at_admission_with_400(sglang: dict[str, Any]) -> None:
    """Aborted as they arrive (the worker raising inside SGLang's event loop would stop the server); plain and
    sampled requests pass, and a server without SPECPILOT is untouched."""
    admission = sglang["admission"]
    assert admission["hooked"]
    assert admission["specpilot plain"] is None and admission["specpilot sampled"] is None
    for name, says in REFUSED.items():
        message, status = admission[f"specpilot {name}"]
        assert status == 400 and says in message and "SPECPILOT" in message, (name, message)
    assert all(value is None for key, value in admission.items() if key.startswith("none "))


@pytest.mark.parametrize("full", [True, False], ids=["FULL_MASK", "QLEN_ONLY"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_layout_is_what_sglangs_tree_builder_builds(sglang: dict[str, Any], case: Case, full: bool) -> None:
    mask, positions, retrieve_index, next_token, next_sibling = sglang["kernels"][case.name]["built"][
        "FULL_MASK" if full else "QLEN_ONLY"]
    ours = layout_of(case, full)
    assert ours.custom_mask.tolist() == mask
    assert ours.positions.tolist() == positions
    assert ours.retrieve_index.tolist() == retrieve_index
    assert ours.retrieve_next_token.tolist() == next_token
    assert ours.retrieve_next_sibling.tolist() == next_sibling


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sglangs_greedy_verify_on_our_layout_accepts_what_our_verifier_accepts(sglang: dict[str, Any],
                                                                                case: Case) -> None:
    assert sglang["kernels"][case.name]["verified"] == ours_accepted(case)


def test_chain_links_are_sglangs_linear_chain(sglang: dict[str, Any]) -> None:
    ours = layout_of(CASES[0], full=False)
    next_token, next_sibling, draft_token = sglang["kernels"]["chain"]["grammar_chain"]
    assert [ours.retrieve_next_token.tolist(), ours.retrieve_next_sibling.tolist()] == [next_token, next_sibling]
    assert ours.draft_token.view(CASES[0].rows, -1).tolist() == draft_token


def test_verify_input_is_sglangs_tree_verify_input(sglang: dict[str, Any]) -> None:
    verify, ours = sglang["verify_input"], layout_of(CASES[1], full=True)
    assert (verify["type"], verify["is_verify_input"], verify["num_tokens_per_req"], verify["max_tree_depth"]) == (
        "NGRAM_VERIFY", True, 16, 16)
    assert verify["tensors"] == [t.tolist() for t in (ours.draft_token, ours.custom_mask, ours.positions,
                                                      ours.retrieve_index, ours.retrieve_next_token,
                                                      ours.retrieve_next_sibling)]


def test_deterministic_inference_samples_each_verify_row_as_sglangs_decode_would(sglang: dict[str, Any]) -> None:
    """The verify rows' sampling info repeats each request's parameters and seed for its rows and keeps the batch's
    flags; SGLang's seeded draw of a row is the row's own (whatever the other rows) and moves with its position."""
    seeded = sglang["seeded_sampling"]
    assert seeded["temperatures"] == pytest.approx([0.7] * 3 + [1.0] * 3)
    assert seeded["seeds"] == [7] * 3 + [42] * 3 and seeded["top_ks"] == [20] * 3 + [1 << 30] * 3
    assert seeded["flags"] == [False, True, True, False]
    assert seeded["verify_rows"] == seeded["each_alone"]
    assert seeded["other_positions"] != seeded["verify_rows"]


def test_sglangs_sampling_params_become_ours(sglang: dict[str, Any]) -> None:
    assert sglang["sampling"] == {"greedy": [True, 1.0, 1.0, 1, 0.0, None],
                                  "default": [False, 1.0, 1.0, 1 << 30, 0.0, None],
                                  "sampled": [False, 0.7, 0.9, 20, 0.05, 7]}


if __name__ == "__main__":
    TORCHVISION_OPS = _define_torchvision_ops()  # before SGLang's import; a global, so they stay defined
    print(json.dumps(_under_sglang()))
