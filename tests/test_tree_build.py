"""Draft trees in one launch: the Triton kernel (interpreter) against the torch path (merge_lookup, then
TreeBuilder.build), which test_draft_tree checks against brute force.

The Triton cases run in one subprocess with TRITON_INTERPRET=1, which triton reads when a kernel is decorated,
so it must be set before anything imports the kernel module.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import pytest
import torch
from triton_interpret import interpreter_fixture, share

from specpilot.drafters import draft_tree
from specpilot.drafters.draft_tree import TreeBuilder

LOOKUP_PROB = 0.9
VOCAB = 50  # the drafter's tokens; prompt lookup's own lie above


@dataclass(frozen=True)
class Case:
    rows: int
    depth: int
    topk: int
    nodes: int
    hint: str  # "none", "mixed" (random use flags) or "all" (every row uses it)
    # exact ties among path scores: "all" (every probability equal) or "slots" (each slot 1/2, 1/4, ...:
    # distinct within a slot, so that the merge's order is defined; powers of two, whose logarithms the
    # interpreter's numpy and torch agree on, as they do on the lookup's 0.9)
    ties: str = ""
    seed: int = 0

    @property
    def name(self) -> str:
        return (f"n{self.rows}-D{self.depth}-top{self.topk}-nodes{self.nodes}-hint_{self.hint}"
                f"{'-ties_' + self.ties if self.ties else ''}")


def make_inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-slot top-k (descending, distinct tokens) as strided views of a batch, as the drafter passes
    them; each lookup token is one of its slot's own tokens 40% of the time, else a new one."""
    g = torch.Generator().manual_seed(case.seed)
    n, d, k = case.rows, case.depth, case.topk
    probs = torch.rand(n, d + 1, k, generator=g).sort(-1, descending=True).values
    if case.ties == "all":
        probs = torch.full_like(probs, 1 / k)
    elif case.ties == "slots":
        probs = (0.5 ** torch.arange(1, k + 1.0)).expand_as(probs)
    ids = torch.rand(n * (d + 1), VOCAB, generator=g).argsort(-1)[:, :k].view(n, d + 1, k)
    probs, ids = probs[:, 1:], ids[:, 1:]
    if case.hint == "none":
        return probs, ids, None
    own = ids.gather(2, torch.randint(0, k, (n, d, 1), generator=g)).squeeze(2)
    look = torch.where(torch.rand(n, d, generator=g) < 0.4, own, torch.randint(VOCAB, 2 * VOCAB, (n, d), generator=g))
    use = torch.randint(0, 2, (n, 1), generator=g) if case.hint == "mixed" else torch.ones(n, 1, dtype=torch.long)
    wide = torch.cat([use, look, look[:, :2]], 1)  # strided rows
    return probs, ids, wide[:, : d + 1]


CASES = [
    Case(6, 15, 4, 15, "mixed"),  # the shipped drafter's shape
    Case(1, 15, 4, 15, "none", seed=1),
    Case(0, 15, 4, 15, "mixed", seed=2),
    Case(4, 6, 2, 15, "all", seed=3),
    Case(3, 5, 6, 15, "mixed", seed=4),
    Case(3, 8, 3, 63, "mixed", seed=5),
    Case(2, 15, 6, 63, "all", seed=6),
    Case(2, 4, 2, 24, "mixed", seed=7),  # every candidate path is a node
    Case(3, 6, 3, 15, "none", ties="all", seed=8),
    Case(3, 6, 3, 63, "mixed", ties="slots", seed=9),
]


@cache
def builder(case: Case) -> TreeBuilder:
    return TreeBuilder(case.topk, case.nodes, case.depth, torch.device("cpu"))


def reference(case: Case) -> list:
    if not case.rows:  # the torch path does not take empty batches
        return [[]] * 4
    layout = builder(case).build_merged(*make_inputs(case), LOOKUP_PROB)  # CPU tensors: the torch path
    return [t.tolist() for t in vars(layout).values()]


def lower_id_first(x: torch.Tensor, k: int) -> torch.Tensor:
    """top_k_indices with the Triton top-k's rule among equal values (torch's CPU topk has none)."""
    return x.sort(dim=-1, descending=True, stable=True).indices[:, :k]


def check_tree(tokens: list, parents: list, depths: list, ancestors: list) -> None:
    """Each row a tree laid out parents first: depth and ancestors follow from the parent."""
    for par, dep, anc in zip(parents, depths, ancestors):
        assert anc[0] == 1
        for j, (p, d) in enumerate(zip(par, dep), start=1):
            assert 0 <= p < j and d == (dep[p - 1] if p else 0) + 1
            assert anc[j] % 2**64 == (anc[p] | 1 << j) % 2**64  # node 63's bit is the sign bit


def test_cases_exercise_the_merge() -> None:
    """The hinted cases have rows that use the hint, rows that do not, and lookup tokens that are one of
    their slot's own (the merge drops that entry)."""
    used = unused = dups = 0
    for case in CASES:
        _, ids, hint = make_inputs(case)
        if hint is not None:
            use = hint[:, 0].bool()
            used, unused = used + int(use.sum()), unused + int((~use).sum())
            dups += int((ids == hint[:, 1:, None]).any(-1)[use].sum())
    assert used > 5 and unused > 3 and dups > 10


@pytest.mark.parametrize("case", [c for c in CASES if c.ties], ids=lambda c: c.name)
def test_tie_cases_cut_through_ties(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Which of the equal paths the tree takes decides the layout: the higher ids give another."""
    monkeypatch.setattr(draft_tree, "top_k_indices", lower_id_first)
    lower = reference(case)
    monkeypatch.setattr(draft_tree, "top_k_indices", lambda x, k: x.size(-1) - 1 - lower_id_first(x.flip(-1), k))
    assert reference(case) != lower


def test_build_merged_checks_shapes() -> None:
    probs, ids, hint = make_inputs(CASES[3])
    with pytest.raises(ValueError, match="expected top-2 over 6 slots"):
        builder(CASES[3]).build_merged(probs[:, 1:], ids[:, 1:], hint, LOOKUP_PROB)


# --------------------------------------------------------------------------------------------------------------------
# Triton (interpreter, subprocess)
# --------------------------------------------------------------------------------------------------------------------


def _triton_results(cases: Sequence[Case]) -> dict[str, list]:
    return {case.name: [t.tolist() for t in vars(builder(case).build_merged(
        *make_inputs(case), LOOKUP_PROB, backend="triton")).values()] for case in cases}


triton_results = interpreter_fixture(__file__, parts=2)


@pytest.mark.parametrize("case", [c for c in CASES if not c.ties], ids=lambda c: c.name)
def test_triton_matches_the_reference(triton_results: dict[str, list], case: Case) -> None:
    got = triton_results[case.name]
    assert got == reference(case)
    check_tree(*got)


@pytest.mark.parametrize("case", [c for c in CASES if c.ties], ids=lambda c: c.name)
def test_triton_takes_lower_ids_among_ties(triton_results: dict[str, list], case: Case,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    got = triton_results[case.name]
    check_tree(*got)
    monkeypatch.setattr(draft_tree, "top_k_indices", lower_id_first)
    assert got == reference(case)


if __name__ == "__main__":
    print(json.dumps(_triton_results(share(CASES))))
