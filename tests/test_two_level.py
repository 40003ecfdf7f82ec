"""`two-level` verification: level 1 keeps the drafts that maximise expected tokens per millisecond (the
drafter's confidences, the cost table), level 2 verifies them in one pass; output never depends on it."""

from __future__ import annotations

import itertools
from dataclasses import replace

import httpx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_graph_paths import replays  # noqa: F401  (fixture)
from test_server_support import LiveServer
from test_speculative import GREEDY, TEST_DEVICE, TEST_DTYPE, mixed_prompts, tiny  # noqa: F401  (module fixture)

from specpilot.config import SamplingParams
from specpilot.engine.config import resolve_device, resolve_dtype
from specpilot.engine.cost_table import CostTable, key_for, save_cost_table
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.engine.two_level import VerifyLengths, verify_widths
from specpilot.forcing import run_forcing
from specpilot.state.tree import TreeLayout

# a pass costs 1 ms plus 0.25 ms a row per request: deep drafts pay only when likely
SLOPED = CostTable("t", (1, 8), (1, 16), ((1.0, 4.75), (1.0, 4.75)), context=0, graphs=False)
FLAT = CostTable("t", (1, 8), (1, 16), ((1.0, 1.0), (1.0, 1.0)), context=0, graphs=False)


def _chooser(table: CostTable, other_ms: float) -> VerifyLengths:
    lengths = VerifyLengths(table)
    lengths.other_ms = other_ms
    return lengths


def _rate(confidences: np.ndarray, lengths: list[int], table: CostTable, other_ms: float) -> float:
    survival = np.cumprod(confidences, axis=1)
    tokens = len(lengths) + sum(survival[i, :n].sum() for i, n in enumerate(lengths))
    return tokens / (other_ms + table.at(len(lengths), 1 + sum(lengths) / len(lengths)))


def test_the_first_step_verifies_everything():
    assert VerifyLengths(SLOPED).choose(np.full((3, 5), 0.01)) == [5, 5, 5]


def test_free_rows_keep_every_draft_and_dear_rows_keep_the_likely():
    confident = np.array([[0.99, 0.98, 0.97, 0.9], [0.2, 0.1, 0.1, 0.1]])
    assert _chooser(FLAT, 1.0).choose(confident) == [4, 4]
    assert _chooser(SLOPED, 0.5).choose(confident) == [4, 0]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.data())
def test_ragged_lengths_are_the_best_of_every_choice(n, k, data):
    """Against brute force over every per-request length vector (the expected rate it maximises)."""
    conf = np.array(data.draw(st.lists(st.lists(st.floats(0.0, 1.0), min_size=k, max_size=k), min_size=n, max_size=n)))
    other = data.draw(st.floats(0.0, 5.0))
    chosen = _chooser(SLOPED, other).choose(conf)
    best = max(_rate(conf, list(ls), SLOPED, other) for ls in itertools.product(range(k + 1), repeat=n))
    assert _rate(conf, chosen, SLOPED, other) >= best * (1 - 1e-9)


def test_uniform_lengths_are_one_of_the_widths_graphs_offer():
    conf = np.array([[0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9], [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]])
    lengths = _chooser(SLOPED, 0.5).choose(conf, widths=[2, 4, 8])
    assert len(set(lengths)) == 1 and lengths[0] + 1 in (2, 4, 8)
    best = max((2, 4, 8), key=lambda w: _rate(conf, [w - 1] * 2, SLOPED, 0.5))
    assert lengths == [best - 1] * 2
    with pytest.raises(ValueError, match="no verify width"):
        _chooser(SLOPED, 0.5).choose(conf, widths=[9, 16])


def test_widths_captured_for_graphs():
    assert verify_widths(16, frozenset()) == (16,)
    assert verify_widths(16, frozenset({"two-level"})) == (2, 4, 8, 16)
    assert verify_widths(6, frozenset({"two-level"})) == (2, 4, 6)


def test_confidences_are_calibrated_by_what_was_accepted():
    """A drafter sure of drafts the target refuses: level 1 learns it and stops verifying them."""
    lengths = _chooser(SLOPED, 0.5)
    sure = np.full((4, 6), 0.95)
    assert lengths.choose(sure) == [6] * 4
    for _ in range(30):
        lengths.choose(sure)
        lengths.learn([[0]] * 4)  # every first draft refused
    assert lengths.choose(sure) == [0] * 4
    assert lengths.as_dict()["acceptance_by_confidence"][9] < 0.2
    for _ in range(200):  # now they are accepted: level 1 comes back to them
        lengths.choose(sure)
        lengths.learn([list(range(7))] * 4)
    assert lengths.choose(sure) == [6] * 4


def _random_tree(n: int, k: int, seed: int) -> TreeLayout:
    gen = torch.Generator().manual_seed(seed)
    parents = torch.stack([torch.tensor([int(torch.randint(0, j + 1, (), generator=gen)) for j in range(k)])
                           for _ in range(n)])
    depths, ancestors = torch.zeros(n, k, dtype=torch.long), torch.ones(n, k + 1, dtype=torch.long)
    for j in range(k):
        p = parents[:, j]
        depths[:, j] = torch.where(p > 0, depths.gather(1, (p - 1).clamp(min=0)[:, None])[:, 0] + 1, 1)
        ancestors[:, j + 1] = ancestors.gather(1, p[:, None])[:, 0] | (1 << (j + 1))
    return TreeLayout(torch.randint(3, 300, (n, k), generator=gen), parents, depths, ancestors)


def test_a_narrowed_tree_is_the_subtree_of_the_kept_nodes():
    tree = _random_tree(3, 9, seed=0)
    keep = []
    for i in range(3):  # a random parent-closed set of 4 nodes: grow from the root
        chosen: set[int] = set()
        while len(chosen) < 4:
            options = [j for j in range(9) if j not in chosen and (tree.parents[i, j] == 0 or int(tree.parents[i, j]) - 1 in chosen)]
            chosen.add(options[(7 * i + len(chosen)) % len(options)])
        keep.append(sorted(chosen))
    narrow = tree.narrow(torch.tensor(keep))
    for i, nodes in enumerate(keep):
        number = {old + 1: new + 1 for new, old in enumerate(nodes)} | {0: 0}
        assert narrow.tokens[i].tolist() == [int(tree.tokens[i, j]) for j in nodes]
        assert narrow.depths[i].tolist() == [int(tree.depths[i, j]) for j in nodes]
        assert narrow.parents[i].tolist() == [number[int(tree.parents[i, j])] for j in nodes]
        for new, old in enumerate([-1, *nodes]):  # the root's row, then each kept node's ancestor set renumbered
            bits = int(tree.ancestors[i, old + 1])
            expect = sum(1 << number[b] for b in range(10) if bits >> b & 1)
            assert int(narrow.ancestors[i, new]) == expect


def test_trees_keep_the_likeliest_subtree_of_the_best_width():
    tree = _random_tree(2, 6, seed=1)
    conf = np.array([[0.9, 0.5, 0.8, 0.3, 0.7, 0.2], [0.2, 0.9, 0.1, 0.9, 0.4, 0.6]])
    parents = tree.parents.numpy()
    lengths = _chooser(SLOPED, 0.5)
    survival = conf.copy()
    for j in range(6):
        survival[:, j] *= np.where(parents[:, j] > 0, survival[np.arange(2), np.maximum(parents[:, j] - 1, 0)], 1)
    keep = lengths.choose_tree(conf, parents, widths=[2, 4, 7])
    best = max((2, 4, 7), key=lambda w: (2 + np.sort(survival, 1)[:, ::-1][:, : w - 1].sum()) / (0.5 + SLOPED.at(2, w)))
    if best == 7:
        assert keep is None
    else:
        assert keep.shape == (2, best - 1)
        for i in range(2):
            assert set(keep[i]) == set(np.argsort(-survival[i], kind="stable")[: best - 1])
    # calibration reads the tree's path: the root's children were reached, node 1 (and so its children) refused
    lengths.learn([[0], [0, 2]])
    assert lengths.tried.sum() > 0


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(2, 12), st.integers(2, 13), st.integers(0, 10**6),
       st.sampled_from([0.0, 0.5, 1.0]))
def test_the_device_keeps_a_subtree_of_the_likeliest_nodes(n, k, width, seed, tie):
    """`select`: width - 1 nodes per request, ascending, every kept node's parent kept (confidences of 1 and
    repeats tie children with their parents); with distinct survivals, the likeliest ones."""
    width = min(width, k)
    tree = _random_tree(n, k, seed)
    gen = torch.Generator().manual_seed(seed)
    conf = torch.rand(n, k, generator=gen)
    if tie:  # some confidences of exactly 1 or repeated: ties between a parent and its child
        conf = torch.where(torch.rand(n, k, generator=gen) < 0.3, torch.full_like(conf, tie or 1.0), conf)
    lengths = VerifyLengths(SLOPED)
    keep = lengths.select(conf, tree, width)
    assert keep.shape == (n, width - 1)
    for i in range(n):
        kept = keep[i].tolist()
        assert kept == sorted(set(kept))
        assert all(int(tree.parents[i, j]) == 0 or int(tree.parents[i, j]) - 1 in kept for j in kept)
    if not tie:
        survival = _tree_survival_of(lengths, conf.double().numpy(), tree.parents.numpy())
        for i in range(n):
            assert set(keep[i].tolist()) == set(np.argsort(-survival[i], kind="stable")[: width - 1].tolist())


def _tree_survival_of(lengths: VerifyLengths, conf: np.ndarray, parents: np.ndarray) -> np.ndarray:
    survival = lengths._calibrated(conf)[1]
    for j in range(conf.shape[1]):
        survival[:, j] *= np.where(parents[:, j] > 0, survival[np.arange(len(conf)), np.maximum(parents[:, j] - 1, 0)], 1)
    return survival


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 8), st.integers(0, 10**6), st.data())
def test_the_device_verifies_the_likeliest_drafts_as_prefixes(n, k, seed, data):
    """`select_chains`: `drafts` drafts in all, the likeliest to survive (the host's order: calibrated survivals,
    shallower first among equals), so each chain a prefix."""
    gen = torch.Generator().manual_seed(seed)
    conf = torch.rand(n, k, generator=gen)
    conf = torch.where(torch.rand(n, k, generator=gen) < 0.3, 1.0, conf)  # ties along chains
    drafts = data.draw(st.integers(0, n * k))
    lengths = VerifyLengths(SLOPED)
    chosen = lengths.select_chains(conf, drafts)
    assert chosen.sum() == drafts and chosen.max() <= k
    survival = np.cumprod(lengths._calibrated(conf.double().numpy())[1], axis=1)
    cut = np.sort(survival.ravel())[::-1][drafts - 1] if drafts else np.inf
    for i in range(n):  # every draft above the cut is verified, none below it
        m = int(chosen[i])
        assert all(survival[i, j] >= cut * (1 - 1e-5) for j in range(m))
        assert all(survival[i, j] <= cut * (1 + 1e-5) for j in range(m, k))


def test_rows_ahead_follow_the_previous_step_s_drafts():
    lengths = VerifyLengths(SLOPED)
    sure, unsure = torch.full((2, 6), 0.99), torch.full((2, 6), 0.01)
    chosen, rows = lengths.choose_rows_ahead(unsure, [3, 4, 6, 8, 12, 14])
    assert rows == 14 and chosen.tolist() == [6, 6]  # nothing measured yet: every draft
    lengths.learn([[0], [0]])
    lengths.observe(5.0, 2, 14)
    chosen, rows = lengths.choose_rows_ahead(sure, [3, 4, 6, 8, 12, 14])
    assert rows < 14 and int(chosen.sum()) == rows - 2  # the unsure step before decides
    lengths.learn([[0, 1], [0]])
    assert (lengths.kept, lengths.offered) == (12 + rows - 2, 24)


def test_widths_ahead_follow_the_previous_step_s_drafts():
    """Under graphs the host never waits for this step's draft: the first step verifies everything, later ones the
    best width for the previous step's drafts; what each step verified reaches the calibration."""
    lengths = VerifyLengths(SLOPED)
    sure, unsure = torch.full((2, 6), 0.99), torch.full((2, 6), 0.01)
    assert lengths.choose_ahead(unsure, None, [2, 4, 7]) == (7, None)  # nothing measured yet
    lengths.learn([[0], [0]])
    lengths.observe(5.0, 2, 14)
    assert lengths.choose_ahead(sure, None, [2, 4, 7])[0] == 2  # the unsure step before decides
    lengths.learn([[0, 1], [0, 1]])
    assert lengths.choose_ahead(unsure, None, [2, 4, 7])[0] == 7  # and now the sure one
    lengths.learn([[0], [0]])
    assert lengths.tried.sum() > 0
    assert (lengths.kept, lengths.offered) == (2 * 6 + 2 * 1 + 2 * 6, 3 * 2 * 6)
    tree = _random_tree(2, 6, seed=3)
    width, keep = lengths.choose_ahead(sure, tree, [2, 4, 7])
    assert width < 7 and keep.shape == (2, width - 1)  # unsure drafts before: a narrower tree
    lengths.learn([[0], [0]])  # the narrowed tree's rows map back to the nodes kept
    assert lengths.kept == 2 * 6 + 2 * 1 + 2 * 6 + 2 * (width - 1)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 16), st.integers(0, 2**31 - 1))
def test_a_node_survives_with_the_product_of_its_path(n, k, seed):
    from specpilot.engine.two_level import _tree_survival

    rng = np.random.default_rng(seed)
    parents = np.array([[0] + [int(rng.integers(0, j + 1)) for j in range(1, k)] for _ in range(n)])
    calibrated = rng.random((n, k)) * (rng.random((n, k)) > 0.1)
    expected = np.ones((n, k))
    for i, j in itertools.product(range(n), range(k)):
        node = j + 1
        while node > 0:  # up the path to the root
            expected[i, j] *= calibrated[i, node - 1]
            node = parents[i, node - 1]
    np.testing.assert_allclose(_tree_survival(calibrated, parents), expected, rtol=1e-12)


def test_level_one_sits_out_where_no_width_is_cheaper():
    """A pass that costs the same at every width (a small batch's) leaves nothing to trim: level 1 keeps the whole
    block, sends nothing to the host and learns nothing, while its counts still report every draft verified."""
    sure = torch.full((2, 6), 0.99)
    flat = VerifyLengths(FLAT)
    flat.choose_ahead(sure, None, [2, 4, 7])  # the first step: nothing measured yet, so it takes part
    flat.learn([[0, 1], [0, 1]])
    flat.observe(5.0, 2, 14)
    tried = flat.tried.copy()
    assert flat.choose_ahead(torch.full((2, 6), 0.01), _random_tree(2, 6, seed=1), [2, 4, 7]) == (7, None)
    assert flat._pending is None
    flat.learn([[0], [0]])
    assert (flat.tried == tried).all() and (flat.kept, flat.offered) == (24, 24)
    lengths, rows = flat.choose_rows_ahead(torch.full((2, 6), 0.01), [3, 8, 14])
    assert lengths.tolist() == [6, 6] and rows == 14
    sloped = _chooser(SLOPED, 0.5)
    sloped.choose_ahead(sure, None, [2, 4, 7])
    assert sloped._pending is not None  # where rows cost, it takes part


def test_trees_are_priced_by_the_table_s_tree_grid():
    """Chains cost nothing more per row here, trees' nodes do (the invariant kernel's tail tiles): a chain keeps
    every draft, a tree of the same confidences narrows, and the step's time beside a tree's pass subtracts the
    tree's; a table without a tree grid prices trees as chains."""
    both = CostTable("t", (1, 8), (1, 16), FLAT.ms, context=0, graphs=False, tree_ms=SLOPED.ms)
    conf = np.array([[0.9, 0.8, 0.5, 0.2, 0.1, 0.05]] * 2)
    parents = np.broadcast_to(np.arange(6), (2, 6))  # a chain-shaped tree
    assert _chooser(both, 0.5).choose(conf, widths=[2, 4, 7]) == [6, 6]
    narrowed = _chooser(both, 0.5).choose_tree(conf, parents, widths=[2, 4, 7])
    assert narrowed is not None and narrowed.shape[1] < 6
    assert _chooser(FLAT, 0.5).choose_tree(conf, parents, widths=[2, 4, 7]) is None
    lengths = VerifyLengths(both)
    lengths.choose_tree(conf, parents, widths=[2, 4, 7])  # the first step: everything, as a tree
    lengths.observe(5.0, 2, 2 * 5)
    assert lengths.other_ms == pytest.approx(5.0 - SLOPED.at(2, 5))


def test_the_step_beside_the_pass_is_a_moving_average():
    lengths = VerifyLengths(SLOPED)
    lengths.observe(5.0, 2, 2 * 5)  # the pass of 5 rows per request costs 2 ms: 3 ms beside it
    assert lengths.other_ms == pytest.approx(3.0)
    lengths.observe(1.0, 2, 2)  # shorter than the table's pass: nothing beside it
    assert lengths.other_ms == pytest.approx(3.0 * 0.8)
    lengths.observe(1000.0, 2, 2)  # a step that compiled a kernel counts as 4 times the average at most
    assert lengths.other_ms == pytest.approx(2.4 + 0.2 * (4 * 2.4 - 2.4))


# ---- in the engine -------------------------------------------------------------------------------------
@pytest.fixture
def cost_tables(tmp_path, monkeypatch):
    """Writes a cost table for an engine's key into a cache of its own."""
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path))

    def write(ckpt, table: CostTable = SLOPED, device: str = TEST_DEVICE) -> None:
        dev = resolve_device(device)
        exact = dev.type == "cuda"  # the batch-invariant kernels run there (the engine's default)
        save_cost_table(replace(table, key=key_for(dev, ckpt.source, resolve_dtype(_dtype(device), dev), exact)))

    return write


def _dtype(device: str) -> str:
    """The suite's dtype on the suite's device; float32 where a test pins the CPU (the graph paths' stand-ins)
    while the suite runs on CUDA in bf16: CPU torch kernels decode AR's tokens exactly only in float32."""
    return TEST_DTYPE if device == TEST_DEVICE else "float32"


def _engine(ckpt, paths, algorithm="dflash", **changes) -> Engine:
    device = changes.pop("device", TEST_DEVICE)
    config = EngineConfig(device=device, dtype=_dtype(device), max_running_requests=4, context_length=256,
                          speculative_algorithm=algorithm,
                          speculative_draft_model_path=None if algorithm is None else str(paths[algorithm]))
    return Engine(ckpt, replace(config, **changes))


def _any_confidences(engine: Engine, seed: int = 0) -> None:
    """The drafter's confidences replaced by random ones (a random drafter's are all alike), so level 1 trims
    requests differently: whatever it keeps, the output must stay AR's. The step's time beside the pass is pinned
    (1 ms), so what level 1 keeps does not follow this machine's timing."""
    engine.verify_lengths.other_ms = 1.0
    engine.verify_lengths.observe = lambda *args: None
    gen, propose = torch.Generator().manual_seed(seed), engine.drafter.propose

    def varied(reqs):
        draft = propose(reqs)
        shape = draft.confidences.shape
        draft.confidences = (torch.rand(shape, generator=gen) ** 0.3).to(draft.confidences.device)
        return draft

    engine.drafter.propose = varied


@pytest.mark.parametrize("algorithm,assist", [("dflash", 0), ("dflash", 2), ("pard", 0)])
def test_output_is_ar_s_with_trimmed_ragged_drafts(tiny, cost_tables, algorithm, assist):  # noqa: F811
    ckpt, paths = tiny
    cost_tables(ckpt)
    prompts = mixed_prompts(ckpt.config.vocab_size, 6, seed=4)  # 6 requests in 4 slots: joins mid-run
    params = [GREEDY, SamplingParams(max_new_tokens=40, temperature=0.8, seed=3, ignore_eos=True)] * 3
    ar = [r.output_ids for r in _engine(ckpt, paths, None).generate(prompts, params)]
    engine = _engine(ckpt, paths, algorithm, speculative_ngram_assist=assist, mechanisms=frozenset({"two-level"}),
                     cuda_graphs=False)  # ragged passes (graphs verify one width: the test below)
    _any_confidences(engine)
    widths = []
    plan = engine.speculation._plan
    engine.speculation._plan = lambda reqs, draft: widths.append(draft.widths()) or plan(reqs, draft)
    assert [r.output_ids for r in engine.generate(prompts, params)] == ar
    stats = engine.verify_lengths.as_dict()
    assert 0 < stats["drafts_verified"] < stats["drafts_offered"]  # level 1 trimmed, and kept some
    assert any(len(set(w)) > 1 for w in widths)  # ragged passes ran


@pytest.mark.parametrize("topk,assist", [(3, 0), (4, 2)])
def test_output_is_ar_s_with_narrowed_trees(tiny, cost_tables, topk, assist):  # noqa: F811
    ckpt, paths = tiny
    cost_tables(ckpt)
    prompts = mixed_prompts(ckpt.config.vocab_size, 6, seed=8)
    params = [GREEDY, SamplingParams(max_new_tokens=40, temperature=0.8, seed=5, ignore_eos=True)] * 3
    ar = [r.output_ids for r in _engine(ckpt, paths, None).generate(prompts, params)]
    engine = _engine(ckpt, paths, speculative_eagle_topk=topk, speculative_ngram_assist=assist,
                     mechanisms=frozenset({"two-level"}), cuda_graphs=False)
    _any_confidences(engine)
    widths = []
    plan = engine.speculation._plan
    engine.speculation._plan = lambda reqs, draft: widths.append(draft.widths()[0]) or plan(reqs, draft)
    assert [r.output_ids for r in engine.generate(prompts, params)] == ar
    assert len(set(widths)) > 1 and max(widths) <= engine.drafter.block_size


def test_graphs_verify_one_captured_width(tiny, cost_tables, replays):  # noqa: F811
    """With (stand-in) graphs a step's requests verify one of the captured widths, through the graph of that
    width and its acceptance graph; the drafter's early launch follows any width through its prep graph."""
    ckpt, paths = tiny
    cost_tables(ckpt, FLAT, device="cpu")
    prompts = mixed_prompts(ckpt.config.vocab_size, 5, seed=6)
    ar = [r.output_ids for r in _engine(ckpt, paths, None, device="cpu").generate(prompts, GREEDY)]
    engine = _engine(ckpt, paths, device="cpu", cuda_graphs=True, speculative_num_draft_tokens=6,
                     mechanisms=frozenset({"two-level", "device-acceptance", "early-launch", "layout-ahead"}))
    assert {(q, b) for q, b in engine.speculation.acceptance} >= {(2, 4), (4, 4), (6, 4)}
    engine.verify_lengths.table = SLOPED  # graphs were captured; now narrow widths pay
    _any_confidences(engine, seed=1)
    widths = []
    plan = engine.speculation._plan
    engine.speculation._plan = lambda reqs, draft: widths.append(draft.widths()) or plan(reqs, draft)
    launches, launch_next = [], engine.drafter.launch_next

    def launched(reqs, verify, accepted, taps):  # the width verified, and whether a prep graph follows it
        graph = engine.drafter.graphs.get(verify.batch_size)
        launches.append((verify.max_q_len, graph is not None and graph.prep_for(verify, accepted, taps) is not None))
        launch_next(reqs, verify, accepted, taps)

    engine.drafter.launch_next = launched
    assert [r.output_ids for r in engine.generate(prompts, GREEDY)] == ar
    assert all(len(set(w)) == 1 and w[0] in (2, 4, 6) for w in widths)
    assert len({w[0] for w in widths}) > 1
    assert launches and all(graphed for _, graphed in launches)
    assert any(q < 6 for q, _ in launches)


def test_graphs_verify_narrowed_trees(tiny, cost_tables, replays):  # noqa: F811
    """Trees with the device lookup and every mechanism a tree takes: the narrower widths' graphs take tree masks."""
    ckpt, paths = tiny
    cost_tables(ckpt, FLAT, device="cpu")
    prompts = mixed_prompts(ckpt.config.vocab_size, 5, seed=9)
    ar = [r.output_ids for r in _engine(ckpt, paths, None, device="cpu").generate(prompts, GREEDY)]
    engine = _engine(ckpt, paths, device="cpu", cuda_graphs=True, speculative_num_draft_tokens=6,
                     speculative_eagle_topk=3, speculative_ngram_assist=2,
                     mechanisms=frozenset({"two-level", "device-acceptance", "early-launch", "layout-ahead",
                                           "device-lookup"}))
    assert all(engine.runner.static[q].tree_mask is not None for q in (2, 4, 6))
    engine.verify_lengths.table = SLOPED
    _any_confidences(engine, seed=3)
    widths = []
    plan = engine.speculation._plan
    engine.speculation._plan = lambda reqs, draft: widths.append(draft.widths()[0]) or plan(reqs, draft)
    assert [r.output_ids for r in engine.generate(prompts, GREEDY)] == ar
    assert len(set(widths)) > 1


@pytest.mark.parametrize("early", [False, True])
def test_ragged_graphs_verify_trimmed_chains_of_any_width(tiny, cost_tables, replays, early):  # noqa: F811
    """`ragged`: level 1 picks the step's rows bucket from the last step and each chain's length on the device; the
    step runs as the graph of its (batch, rows) bucket, packed (padding requests own no rows), accepts on the device,
    and the host learns the widths with the acceptance; under `early-launch` the drafter's bucket graphs start the
    next draft from the gathered taps first. The output stays AR's."""
    ckpt, paths = tiny
    cost_tables(ckpt, FLAT, device="cpu")
    prompts = mixed_prompts(ckpt.config.vocab_size, 5, seed=6)  # 5 requests in buckets of 4: then fewer
    params = [replace(GREEDY, max_new_tokens=m) for m in (16, 40, 24, 32, 40)]  # finishing apart: padded buckets
    ar = [r.output_ids for r in _engine(ckpt, paths, None, device="cpu").generate(prompts, params)]
    mechanisms = {"two-level", "ragged", "device-acceptance"} | ({"early-launch"} if early else set())
    engine = _engine(ckpt, paths, device="cpu", cuda_graphs=True, speculative_num_draft_tokens=6,
                     speculative_ngram_assist=2, mechanisms=frozenset(mechanisms))
    launches, launch_next = [], engine.drafter.launch_next

    def launched(reqs, verify, accepted, taps):
        launches.append(any(verify is g.batch for g in engine.runner.ragged.values()))
        launch_next(reqs, verify, accepted, taps)
        assert engine.drafter.model._launched[1] is engine.drafter.model.graphs[verify.batch_size]  # graphs, not eager

    engine.drafter.launch_next = launched
    assert (4, 24) in engine.runner.ragged and (4, 5) not in engine.runner.ragged  # buckets above 4 requests
    engine.verify_lengths.table = SLOPED
    _any_confidences(engine, seed=1)
    passes = []
    plan = engine.speculation._plan

    def recorded(reqs, draft):
        passes.append(plan(reqs, draft))
        return passes[-1]

    engine.speculation._plan = recorded
    walks = []
    engine.speculation._walk = lambda plan, logits: walks.append(plan)  # greedy: the device accepts every step
    assert [r.output_ids for r in engine.generate(prompts, params)] == ar
    assert not walks
    assert any(p.draft.device_lengths is not None for p in passes)  # level 1 chose on the device, the host waited not
    assert any(launches) == early  # early launches after ragged verifies
    stats = engine.verify_lengths.as_dict()
    assert 0 < stats["drafts_verified"] < stats["drafts_offered"]
    # the widths level 1 chose on the device, as the host learnt them after each verify
    passes = [(p.widths, p.graph is not None and p.graph in engine.runner.ragged.values(), p.batch.batch_size,
               p.batch.num_tokens) for p in passes]
    mixed = [(w, ragged, b, rows) for w, ragged, b, rows in passes if len(set(w)) > 1]
    assert mixed and all(ragged and sum(w) <= rows for w, ragged, _, rows in mixed)
    assert any(len(w) < b for w, _, b, _ in mixed)  # padding requests (no rows) ran beside real ones


def test_ragged_needs_two_level_and_graphs(tiny, cost_tables, replays):  # noqa: F811
    ckpt, paths = tiny
    cost_tables(ckpt, device="cpu")
    with pytest.raises(ValueError, match="--mechanisms: ragged needs two-level too"):
        _engine(ckpt, paths, device="cpu", mechanisms=frozenset({"ragged"}))
    with pytest.raises(ValueError, match="--mechanisms: ragged needs CUDA graphs"):
        _engine(ckpt, paths, device="cpu", cuda_graphs=False, mechanisms=frozenset({"two-level", "ragged"}))


def test_ragged_lengths_are_chosen_at_their_bucket_s_cost():
    """Under ragged graphs a pass costs its rows' bucket: drafts that fill a bucket's spare rows come free."""
    conf = np.array([[0.9, 0.5, 0.5, 0.5], [0.9, 0.5, 0.5, 0.5]])
    eager = _chooser(SLOPED, 1.0).choose(conf)
    bucketed = _chooser(SLOPED, 1.0).choose(conf, row_buckets=[3, 4, 6, 8, 10])
    assert sum(eager) + 2 <= sum(bucketed) + 2 <= 10
    assert (sum(bucketed) + 2) in (3, 4, 6, 8, 10)  # it fills the bucket it pays for


def test_forcing_passes_with_two_level_and_the_budget(tiny, cost_tables):  # noqa: F811
    ckpt, paths = tiny
    cost_tables(ckpt)
    stock = _engine(ckpt, paths, None)
    cand = _engine(ckpt, paths, speculative_ngram_assist=2, mechanisms=frozenset({"two-level", "budget"}))
    _any_confidences(cand, seed=2)
    modes = itertools.cycle((True, True, False))
    cand.budget.speculate = lambda batch_size: next(modes)
    verdict = run_forcing(stock, cand, mixed_prompts(ckpt.config.vocab_size, 4, seed=3), GREEDY, "two-level")
    assert verdict.passed, verdict.as_dict()
    assert cand.verify_lengths.kept < cand.verify_lengths.offered


def test_two_level_needs_confidences_and_a_cost_table(tiny, cost_tables):  # noqa: F811
    ckpt, paths = tiny
    with pytest.raises(ValueError, match="two-level needs this device and model's cost table.*--profile-cost-table"):
        _engine(ckpt, paths, mechanisms=frozenset({"two-level"}))
    cost_tables(ckpt)
    with pytest.raises(ValueError, match="two-level needs a drafter whose drafts carry confidences"):
        _engine(ckpt, paths, speculative_algorithm="ngram", speculative_draft_model_path=None,
                mechanisms=frozenset({"two-level"}))


def test_server_info_reports_level_one(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path))
    from specpilot.models.checkpoint import load_checkpoint
    from spec_fixtures import write_random_pard

    ckpt = load_checkpoint(tiny_dir)
    save_cost_table(replace(SLOPED, key=key_for(torch.device("cpu"), ckpt.source, resolve_dtype("auto", torch.device("cpu")),
                                                False)))
    pard = write_random_pard(tmp_path / "pard", pard_token=ckpt.config.vocab_size - 1)
    with LiveServer(tiny_dir, speculative_algorithm="pard", speculative_draft_model_path=str(pard),
                    mechanisms=frozenset({"two-level"}), max_running_requests=2, context_length=256) as server:
        reply = httpx.post(f"{server.url}/generate", json={"input_ids": [5, 6, 7, 5, 6, 7, 5, 6],
                                                             "sampling_params": {"max_new_tokens": 24}}, timeout=60)
        assert reply.status_code == 200
        level_one = server.info()["internal_states"][0]["spec_stats"]["two_level"]
    assert level_one["drafts_offered"] > 0 and level_one["table"].endswith("-fastest")
