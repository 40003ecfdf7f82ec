"""Greedy tree acceptance: the Triton kernel (interpreter) against the torch reference, which
test_draft_tree checks against the host walk.

The Triton cases run in one subprocess with TRITON_INTERPRET=1, which triton reads when a kernel is decorated,
so it must be set before anything imports the kernel module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from triton_interpret import interpreter_fixture

from specpilot.drafters.draft_tree import TreeBuilder
from specpilot.kernels.tree_accept import tree_accept, tree_accept_reference
from specpilot.state.tree import chain_layout


@dataclass(frozen=True)
class Case:
    rows: int
    nodes: int  # draft nodes (q - 1)
    topk: int  # 1: a chain
    seed: int = 0

    @property
    def name(self) -> str:
        return f"n{self.rows}-nodes{self.nodes}-top{self.topk}"


def make_inputs(case: Case) -> tuple[torch.Tensor, ...]:
    """A tree (or chain) per row whose argmax is steered into drafted children, so walks go deep; the
    drafts and parents are strided views, as the engine passes them."""
    g = torch.Generator().manual_seed(case.seed)
    n, k, vocab = case.rows, case.nodes, 40
    if case.topk == 1:
        tree = chain_layout(torch.randint(0, vocab, (n, k), generator=g))
    else:
        depth = min(k, 15)
        probs = torch.rand(n, depth, case.topk, generator=g).sort(-1, descending=True).values
        ids = torch.rand(n * depth, vocab, generator=g).argsort(-1)[:, : case.topk]  # distinct per slot
        tree = TreeBuilder(case.topk, k, depth, torch.device("cpu")).build(probs, ids.view(n, depth, case.topk))
    argmax = torch.randint(0, vocab, (n, k + 1), generator=g)
    steer = torch.rand(n, k, generator=g) < 0.85
    for r in range(n):
        for j in range(k):
            if steer[r, j]:
                argmax[r, tree.parents[r, j]] = tree.tokens[r, j]
    wide = torch.zeros(n, k + 1, 2, dtype=torch.int64)  # strided rows: every other element
    wide[:, 1:, 0], wide[:, 1:, 1] = tree.tokens, tree.parents
    return argmax, wide[:, 1:, 0], wide[:, 1:, 1], tree.depths.contiguous(), tree.ancestors.contiguous()


CASES = [Case(16, 15, 4), Case(8, 15, 1, seed=1), Case(5, 63, 3, seed=2), Case(3, 7, 2, seed=3), Case(0, 15, 1, seed=4)]


def test_reference_goes_deep_and_pads_with_the_root() -> None:
    counts, nodes, tokens = tree_accept_reference(*make_inputs(CASES[0]))
    assert (counts > 2).sum() > 4
    for r, c in enumerate(counts.tolist()):
        assert nodes[r, c:].eq(0).all() and tokens[r, c:].eq(tokens[r, 0]).all()


def test_inputs_are_checked() -> None:
    argmax, drafts, parents, depths, ancestors = make_inputs(CASES[3])
    with pytest.raises(ValueError, match="drafts must be"):
        tree_accept(argmax, drafts[:, :-1], parents, depths, ancestors)
    with pytest.raises(TypeError, match="int64 bit sets"):
        tree_accept(argmax, drafts, parents, depths, ancestors.int())
    with pytest.raises(ValueError, match="2 <= q <= 64"):
        tree_accept(torch.zeros(2, 66, dtype=torch.long), *(torch.zeros(2, 65, dtype=torch.long),) * 3,
                    torch.zeros(2, 66, dtype=torch.long))


# --------------------------------------------------------------------------------------------------------------------
# Triton (interpreter, subprocess)
# --------------------------------------------------------------------------------------------------------------------


def _triton_results() -> dict[str, list]:
    from specpilot.kernels.tree_accept import tree_accept_triton

    return {case.name: [t.tolist() for t in tree_accept_triton(*make_inputs(case))] for case in CASES}


triton_results = interpreter_fixture(__file__)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_matches_the_reference(triton_results: dict[str, list], case: Case) -> None:
    want = tree_accept_reference(*make_inputs(case))
    assert triton_results[case.name] == [t.tolist() for t in want]


if __name__ == "__main__":
    print(json.dumps(_triton_results()))
