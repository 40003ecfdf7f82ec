"""The CUDA-graph paths (static input buffers, bucket padding, in-place tree layout before replay) run
on CPU with an eager stand-in for the graphs, and decode exactly what the eager paths decode."""

from __future__ import annotations

import pytest
import torch
from test_engine import assert_rollback_reproduces
from test_speculative import GREEDY, mixed_prompts, tiny  # noqa: F401  (module fixture)

from specpilot.config import SamplingParams
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.forcing import run_forcing
from specpilot.state.batch import ForwardBatch
from specpilot.state.graphs import EagerReplay, GraphBackend, eager_capture


@pytest.fixture
def replays(monkeypatch):
    """Graphs captured as eager reruns; counts the replays."""
    monkeypatch.setattr(GraphBackend, "capture", staticmethod(eager_capture))
    count = {"n": 0}
    original = EagerReplay.replay

    def counted(self):
        count["n"] += 1
        original(self)

    monkeypatch.setattr(EagerReplay, "replay", counted)
    return count


def _engine(ckpt, graphs: bool, **spec) -> Engine:
    return Engine(ckpt, EngineConfig(device="cpu", max_running_requests=8, context_length=256, cuda_graphs=graphs,
                                     **spec))


@pytest.mark.parametrize("topk,assist", [(1, 0), (3, 0), (4, 2)])
def test_graph_paths_decode_like_eager(tiny, replays, topk, assist):  # noqa: F811
    ckpt, paths = tiny
    spec = dict(speculative_algorithm="dflash", speculative_draft_model_path=str(paths["dflash"]),
                speculative_num_draft_tokens=6, speculative_eagle_topk=topk, speculative_ngram_assist=assist)
    graphed = _engine(ckpt, True, **spec)
    assert (6, 8) in graphed.runner.graphs and graphed.drafter is not None
    prompts = mixed_prompts(ckpt.config.vocab_size, 6, seed=2)  # 6 requests: the bucket of 8 pads two rows
    verdict = run_forcing(_engine(ckpt, True), graphed, prompts, GREEDY, "dflash")
    assert verdict.passed, verdict.as_dict()
    assert replays["n"] > 0
    eager = [r.output_ids for r in _engine(ckpt, False, **spec).generate(prompts, GREEDY)]
    graphed = _engine(ckpt, True, **spec)
    drafter = graphed.drafter if assist == 0 else graphed.drafter.model
    launches = {"pending": 0, "early": 0}
    pending, launch_next = drafter._launch_pending, drafter.launch_next
    drafter._launch_pending = lambda reqs: (launches.__setitem__("pending", launches["pending"] + 1), pending(reqs))[1]

    def early(reqs, verify, accepted, taps):  # must take the graphs: verify batch and acceptance are theirs
        launches["early"] += 1
        assert graphed.speculation.acceptance[(6, verify.batch_size)].batch is verify
        launch_next(reqs, verify, accepted, taps)
        assert drafter._launched[1] is drafter.graphs[verify.batch_size]

    drafter.launch_next = early
    inputs = graphed.runner.static[6]
    fills, fill = [], inputs.fill
    inputs.fill = lambda *args: (fills.append(args[3]), fill(*args))
    placed = []
    for b, graph in graphed.speculation.placement.items():
        graph.replay = lambda replay=graph.replay: (placed.append(1), replay())[1]
    assert [r.output_ids for r in graphed.generate(prompts, GREEDY)] == eager
    # drafts launched early are used; a draft is made afresh only when requests join the batch
    assert launches["early"] > 3 * launches["pending"] > 0
    # the host fills a verify graph's inputs only when the batch changed; else the device laid them out
    assert 0 < len(fills) < launches["early"] / 2
    # a tree from the drafter's graphs is laid into the verify inputs by one placement replay
    assert graphed.mechanisms >= {"device-acceptance", "early-launch", "layout-ahead"}
    assert (sum(placed) > launches["early"] / 2) if topk > 1 else not graphed.speculation.placement
    assert ("device-lookup" in graphed.mechanisms) == (assist > 0 and topk > 1)


@pytest.mark.parametrize("assist", [0, 2])
def test_rollback_mid_speculation_reproduces(tiny, replays, assist):  # noqa: F811
    """A rollback between steps drops the draft launched early (with prompt lookup on the device, its
    tree laid into the verify inputs too) and the verify inputs the device laid out for the old length;
    decoding on reproduces the same tokens."""
    ckpt, paths = tiny
    eng = _engine(ckpt, True, speculative_algorithm="dflash", speculative_draft_model_path=str(paths["dflash"]),
                  speculative_num_draft_tokens=6, speculative_eagle_topk=3, speculative_ngram_assist=assist)
    [prompt] = mixed_prompts(ckpt.config.vocab_size, 1, seed=5)
    assert_rollback_reproduces(eng, prompt, 24, 9)


@pytest.mark.parametrize("algorithm,path", [("ngram", None), ("pard", "pard")])
def test_graph_paths_of_other_drafters_decode_like_eager(tiny, replays, algorithm, path):  # noqa: F811
    """Drafters that do not launch early still take the acceptance graphs and device-laid verify inputs."""
    ckpt, paths = tiny
    spec = dict(speculative_algorithm=algorithm, speculative_num_draft_tokens=5,
                speculative_draft_model_path=str(paths[path]) if path else None)
    prompts = mixed_prompts(ckpt.config.vocab_size, 5, seed=4)
    graphed = _engine(ckpt, True, **spec)
    assert graphed.speculation.acceptance
    verdict = run_forcing(_engine(ckpt, True), graphed, prompts, GREEDY, algorithm)
    assert verdict.passed, verdict.as_dict()
    eager = [r.output_ids for r in _engine(ckpt, False, **spec).generate(prompts, GREEDY)]
    assert [r.output_ids for r in _engine(ckpt, True, **spec).generate(prompts, GREEDY)] == eager


def test_prefills_replay_graphs_and_decode_like_eager(tiny, replays):  # noqa: F811
    """Prefills of up to 8 prompts and the graph's token cap replay a prefill graph (a bucket request past the
    real ones owns no rows; rows past the prompts aim at the scratch slot); a longer pass runs eagerly. The
    first tokens, the drafter's taps and so every token after them are those of eager prefills."""
    ckpt, paths = tiny
    spec = dict(speculative_algorithm="dflash", speculative_draft_model_path=str(paths["dflash"]),
                speculative_num_draft_tokens=6, speculative_eagle_topk=4, speculative_ngram_assist=2)
    prompts = mixed_prompts(ckpt.config.vocab_size, 7, seed=5) + [list(range(3, 143))]  # the last: 140 tokens
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (5, 9, 14, 20, 27, 33, 12, 8)]
    eager = [r.output_ids for r in _engine(ckpt, False, **spec).generate(prompts, params)]
    for algorithm in (spec, {}):
        graphed = Engine(ckpt, EngineConfig(device="cpu", max_running_requests=3, context_length=256,
                                            prefill_graph_tokens=128, **algorithm))
        assert sorted(graphed.runner.prefills) == [(b, t) for b in (1, 2, 3) for t in (64, 128)]  # 3 slots
        passes = {"graph": 0, "eager": 0}
        prefill = graphed.runner._graphed_prefill

        def counted(*args, prefill=prefill):
            out = prefill(*args)
            passes["graph" if out is not None else "eager"] += 1
            return out

        graphed.runner._graphed_prefill = counted
        outputs = [r.output_ids for r in graphed.generate(prompts, params)]
        if algorithm:
            assert outputs == eager
        else:
            assert outputs == [r.output_ids for r in _engine(ckpt, False).generate(prompts, params)]
        assert passes["graph"] >= 3 and passes["eager"] >= 1  # the 140-token prompt's pass runs eagerly


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_prefill_is_bitwise_the_eager_one_on_cuda(tiny):  # noqa: F811
    """On the batch-invariant kernels a prompt's last logits and taps do not depend on whether its prefill ran in
    a graph (its rows padded to the bucket's, max_q_len the bucket's) or eagerly beside other prompts."""
    ckpt, paths = tiny
    engine = Engine(ckpt, EngineConfig(device="cuda", dtype="bfloat16", max_running_requests=8, context_length=256,
                                       prefill_graph_tokens=256, speculative_algorithm="dflash",
                                       speculative_draft_model_path=str(paths["dflash"])))
    assert engine.exact and engine.runner.prefills
    prompts = mixed_prompts(ckpt.config.vocab_size, 8, seed=9)
    for group in (prompts[:1], prompts[1:4], prompts[4:8]):
        slots = [engine.cache.allocate(len(p)) for p in group]  # a paged cache maps only allocated slots apart
        with torch.inference_mode():  # as the engine's passes run
            graphed = engine.runner._graphed_prefill(slots, [0] * len(group), group)
            alone = [engine.runner.run(ForwardBatch.build([s], [0], [p], engine.cache.max_len, engine.device))
                     for s, p in zip(slots, group)]
        for s in slots:
            engine.cache.free(s)
        assert graphed is not None
        assert torch.equal(graphed.logits, torch.stack([a.logits[-1] for a in alone]))
        assert torch.equal(graphed.taps, torch.cat([a.taps for a in alone]))


def test_the_cost_table_times_chains_and_trees_through_graphs(tiny, replays):  # noqa: F811
    """`--profile-cost-table` where the engine runs graphs: chain passes replay the chain graphs, tree passes the
    tree-masked ones (a chain-shaped tree until a step lays its own), every (batch, rows) point of both grids."""
    from specpilot.costmodel.cost_table import profile_cost_table

    ckpt, _ = tiny
    engine = Engine(ckpt, EngineConfig(device="cpu", max_running_requests=4, context_length=256, cuda_graphs=True))
    before = replays["n"]
    table = profile_cost_table(engine, [1, 3], [1, 4], context=32, repeats=1)
    assert table.graphs and table.tree_ms is not None and all(ms > 0 for row in table.tree_ms for ms in row)
    assert replays["n"] - before >= 2 * 2 * 2 - 2  # both grids but the trees' one-row points, each at least once
    assert not engine.has_work and engine.cache.num_free == 4
