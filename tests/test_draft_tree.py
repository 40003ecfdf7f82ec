"""Draft trees from per-slot top-k: the chosen paths are the likeliest, closed under prefixes, laid out
consistently; prompt lookup's proposal merges into the slots' lists."""

from __future__ import annotations

import itertools

import pytest
import torch

from specpilot.drafters.draft_tree import MAX_DEVIATIONS, TreeBuilder, merge_lookup, node_confidences
from specpilot.state.tree import chain_layout


def _paths(layout, ids, r):
    """Rank tuples of request r's nodes, rebuilt from parents, depths and tokens."""
    paths = {0: ()}
    for j in range(layout.tokens.shape[1]):
        d = int(layout.depths[r, j])
        rank = int((ids[r, d - 1] == layout.tokens[r, j]).nonzero()[0])
        paths[j + 1] = paths[int(layout.parents[r, j])] + (rank,)
        assert len(paths[j + 1]) == d and int(layout.parents[r, j]) < j + 1
    return paths


@pytest.mark.parametrize("depth,k,nodes", [(4, 2, 5), (6, 3, 9), (5, 4, 15)])
def test_tree_is_the_likeliest_paths(depth, k, nodes):
    g = torch.Generator().manual_seed(depth * k)
    n = 4
    probs = torch.rand(n, depth, k, generator=g).sort(-1, descending=True).values
    probs = probs / probs.sum(-1, keepdim=True)
    ids = torch.stack([torch.randperm(50, generator=g)[:k] for _ in range(n * depth)]).view(n, depth, k)
    layout = TreeBuilder(k, nodes, depth, torch.device("cpu")).build(probs, ids)
    for r in range(n):
        scored = []
        for d in range(1, depth + 1):
            for ranks in itertools.product(range(k), repeat=d):
                if sum(x > 0 for x in ranks) <= MAX_DEVIATIONS:
                    scored.append((float(torch.tensor([probs[r, i, x] for i, x in enumerate(ranks)]).prod()), ranks))
        best = {p for _, p in sorted(scored, reverse=True)[:nodes]}
        paths = _paths(layout, ids, r)
        assert set(list(paths.values())[1:]) == best
        for j in range(nodes + 1):  # ancestor bits: exactly the nodes on the path to j
            want, node = 1 << j, j
            while node:
                node = int(layout.parents[r, node - 1])
                want |= 1 << node
            assert int(layout.ancestors[r, j]) == want


def test_chain_layout():
    layout = chain_layout(torch.tensor([[5, 6, 7]]))
    assert layout.parents.tolist() == [[0, 1, 2]] and layout.depths.tolist() == [[1, 2, 3]]
    assert layout.ancestors.tolist() == [[1, 3, 7, 15]]


def test_merge_lookup_adds_the_lookup_token_once():
    probs = torch.tensor([[[0.5, 0.3, 0.1], [0.95, 0.03, 0.01]], [[0.6, 0.2, 0.1], [0.7, 0.2, 0.05]]])
    ids = torch.tensor([[[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]]])
    hint = torch.tensor([[1, 3, 9], [0, 3, 9]])  # row 0 uses lookup tokens 3, 9; row 1 does not
    p, t = merge_lookup(probs, ids, hint, 0.9)
    assert t[0].tolist() == [[3, 1, 2], [4, 9, 5]]  # 3 moves up (no duplicate); 9 enters below 0.95
    assert torch.allclose(p[0], torch.tensor([[0.9, 0.5, 0.3], [0.95, 0.9, 0.03]]))
    assert torch.equal(p[1], probs[1]) and torch.equal(t[1], ids[1])


def test_bad_tree_settings():
    with pytest.raises(ValueError, match="top-k >= 2"):
        TreeBuilder(1, 4, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="1..63"):
        TreeBuilder(2, 64, 15, torch.device("cpu"))
    with pytest.raises(ValueError, match="fewer than"):
        TreeBuilder(2, 10, 2, torch.device("cpu"))  # 6 paths over 2 slots


def test_a_tree_deeper_than_the_cuda_kernel_takes_is_refused_up_front(monkeypatch):
    """On CUDA the tree is built by one Triton kernel of bounded depth: a deeper block is refused at start,
    naming the flags, not at the first draft (CPU, whose torch build takes any depth, builds it)."""
    import specpilot.drafters.draft_tree as draft_tree

    monkeypatch.setattr(draft_tree, "HAS_TRITON", True)
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens <= 16"):
        TreeBuilder(4, 31, 31, torch.device("cuda"))
    assert TreeBuilder(4, 20, 20, torch.device("cpu")).depth == 20


def test_trees_stay_closed_under_prefixes_at_ties_and_extremes():
    """A chosen node's parent is always chosen (else the node would hang off the wrong ancestor and the
    target would score it out of context): probabilities of exactly 1, equal ones, and log scores far
    from 0 where float32 rounding is coarse."""
    g = torch.Generator().manual_seed(7)
    n, depth, k, nodes = 64, 15, 4, 15
    certain_after_unlikely = torch.full((n, depth, k), 1e-30)
    certain_after_unlikely[:, :, 0] = 1.0
    certain_after_unlikely[:, 0] = torch.rand(n, k, generator=g) * 1e-25  # children tie their parent but for the margin
    kinds = [torch.ones(n, depth, k), torch.rand(n, depth, k, generator=g) ** 8,
             torch.full((n, depth, k), 1e-25) + (torch.rand(n, depth, k, generator=g) < 0.3) * 1.0,
             certain_after_unlikely]
    builder = TreeBuilder(k, nodes, depth, torch.device("cpu"))
    for probs in kinds:
        probs = probs.sort(-1, descending=True).values
        layout = builder.build(probs, torch.arange(n * depth * k).view(n, depth, k))
        parent_depth = torch.cat([torch.zeros(n, 1, dtype=torch.long), layout.depths], 1).gather(1, layout.parents)
        assert torch.equal(parent_depth, layout.depths - 1)


@pytest.mark.parametrize("topk", [1, 3])
def test_device_greedy_acceptance_equals_the_walk(topk):
    """Verifier.greedy (tensor work, no host) accepts what the host walk accepts, on chains and trees
    whose argmax rows are steered into drafted children so that walks go deep."""
    from specpilot.config import SamplingParams
    from specpilot.engine.verify import Verifier
    from specpilot.state.request import Request

    g = torch.Generator().manual_seed(topk)
    n, depth, vocab = 64, 7, 12
    if topk == 1:
        tree, drafts = None, torch.randint(0, vocab, (n, depth), generator=g)
        parents = [list(range(depth))] * n
    else:
        probs = torch.rand(n, depth, topk, generator=g).sort(-1, descending=True).values
        ids = torch.stack([torch.randperm(vocab, generator=g)[:topk] for _ in range(n * depth)]).view(n, depth, topk)
        tree = TreeBuilder(topk, depth, depth, torch.device("cpu")).build(probs, ids)
        drafts, parents = tree.tokens, tree.parents.tolist()
    argmax = torch.randint(0, vocab, (n, depth + 1), generator=g)
    for r in range(n):  # each row's argmax is one of its children's tokens with probability 0.8
        for j in range(depth):
            if torch.rand(1, generator=g) < 0.8:
                argmax[r, parents[r][j]] = drafts[r, j]
    acc = Verifier().greedy(argmax, drafts, torch.zeros(n, dtype=torch.long), tree)
    req = Request([1], SamplingParams(max_new_tokens=8))
    deep = 0
    for r in range(n):
        tokens, path = Verifier().accept(req, None, drafts[r].tolist(), argmax[r].tolist(),
                                         None if tree is None else parents[r])
        count = int(acc.counts[r])
        assert count == len(tokens) and acc.tokens[r, :count].tolist() == tokens
        assert acc.nodes[r, :count].tolist() == [0, *path]
        deep += count > 2
    assert deep > n // 4


@pytest.mark.parametrize("with_hint", [False, True])
def test_node_confidences_are_each_node_s_probability_in_its_slot(with_hint):
    """What `two-level` reads of a tree: node j's token's probability at slot depth(j) - 1 of the lists the
    tree was built from (the lookup's merge included)."""
    g = torch.Generator().manual_seed(11)
    n, depth, k = 3, 5, 3
    probs = torch.rand(n, depth, k, generator=g).sort(-1, descending=True).values
    ids = torch.stack([torch.randperm(40, generator=g)[:k] for _ in range(n * depth)]).view(n, depth, k)
    hint = torch.cat([torch.tensor([[1], [0], [1]]), torch.randint(0, 40, (n, depth), generator=g)], 1) if with_hint else None
    builder = TreeBuilder(k, 7, depth, torch.device("cpu"))
    tree = builder.build_merged(probs, ids, hint, 0.9)
    merged_p, merged_ids = merge_lookup(probs, ids, hint, 0.9) if with_hint else (probs, ids)
    conf = node_confidences(probs, ids, hint, 0.9, tree)
    for r in range(n):
        for j in range(7):
            slot = int(tree.depths[r, j]) - 1
            where = (merged_ids[r, slot] == tree.tokens[r, j]).nonzero()[0]
            assert float(conf[r, j]) == pytest.approx(float(merged_p[r, slot, where]))
