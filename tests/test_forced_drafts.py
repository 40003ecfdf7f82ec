"""Drafts a grammar forces: put first in a chain, or on a path down a tree whose siblings stay distinct."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_structured_output import CONSTRAINTS, engine, prompts, spelled  # noqa: F401  (module fixture)
from test_two_level import _random_tree

from specpilot.engine.forced_drafts import _forced_path


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 12), st.integers(0, 10**6), st.data())
def test_forced_tokens_take_a_path_down_the_tree(n, k, seed, data):
    tree = _random_tree(n, k, seed)
    tree.tokens = torch.arange(k).repeat(n, 1) + 10  # distinct tokens
    m = data.draw(st.integers(1, k))
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, m), min_size=n, max_size=n)))
    # forced tokens: some the tree already holds, some new
    forced = torch.tensor(data.draw(st.lists(st.lists(st.sampled_from([10, 11, 12, 500, 501]), min_size=m,
                                                      max_size=m), min_size=n, max_size=n)))
    out, path = _forced_path(tree, lengths, forced)
    assert torch.equal(out.parents, tree.parents) and torch.equal(out.ancestors, tree.ancestors)
    for i in range(n):
        node, nodes = 0, path[i].tolist()
        for d in range(m):
            children = [j for j in range(k) if int(tree.parents[i, j]) == node]
            if d >= int(lengths[i]) or not children:
                assert all(x == 0 for x in nodes[d:])
                break
            chosen = nodes[d] - 1
            assert chosen in children and int(out.tokens[i, chosen]) == int(forced[i, d])
            holders = [j for j in children if int(tree.tokens[i, j]) == int(forced[i, d])]
            assert chosen == (holders[0] if holders else children[0])
            node = chosen + 1
        for parent in range(k + 1):  # siblings stay distinct
            siblings = [int(out.tokens[i, j]) for j in range(k) if int(tree.parents[i, j]) == parent]
            assert len(siblings) == len(set(siblings))
        changed = [j for j in range(k) if int(out.tokens[i, j]) != int(tree.tokens[i, j])]
        assert all(j + 1 in nodes for j in changed)


def test_constrained_trees_take_the_forced_path_and_equal_constrained_ar(spelled, monkeypatch):  # noqa: F811
    """A random tree drafter under a JSON schema: forced tokens go down its trees, and the output is constrained
    AR's."""
    from specpilot.config import SamplingParams
    from specpilot.engine import forced_drafts

    path, dflash = spelled
    params = SamplingParams(max_new_tokens=60, json_schema=CONSTRAINTS["json_schema"])
    ar_engine = engine(path)
    ar = [r.output_ids for r in ar_engine.generate(prompts(ar_engine), params)]
    paths, forced_path = [], forced_drafts._forced_path
    monkeypatch.setattr(forced_drafts, "_forced_path", lambda *a: paths.append(1) or forced_path(*a))
    spec = engine(path, speculative_algorithm="dflash", speculative_draft_model_path=str(dflash),
                  speculative_eagle_topk=3)
    assert [r.output_ids for r in spec.generate(prompts(spec), params)] == ar
    assert paths
