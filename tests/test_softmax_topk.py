"""Softmax top-k: the torch reference against a plain softmax, the Triton kernels (interpreter) against the
reference.

The Triton cases run in one subprocess with TRITON_INTERPRET=1, which triton reads when a kernel is decorated,
so it must be set before anything imports the kernel module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from triton_interpret import interpreter_fixture, patch_bf16_cast

from specpilot.kernels.softmax_topk import row_argmax, softmax_topk, softmax_topk_reference, top_k_indices


@dataclass(frozen=True)
class Case:
    rows: int
    vocab: int
    k: int
    chunk: int
    dtype: str = "float32"
    ties: bool = False  # equal logits across chunks and within one, among the top-k
    seed: int = 0

    @property
    def name(self) -> str:
        return f"n{self.rows}-v{self.vocab}-k{self.k}-c{self.chunk}-{self.dtype}{'-ties' if self.ties else ''}"


def make_logits(case: Case) -> torch.Tensor:
    g = torch.Generator().manual_seed(case.seed)
    x = 3 * torch.randn(case.rows, case.vocab, generator=g)
    if case.ties:  # row 0: one value at ids in three chunks (and twice in the first), above everything else
        x[0, [case.vocab - 1, 1, case.chunk + 2, 0]] = 20.0
    return x.to(getattr(torch, case.dtype))


CASES = [
    Case(3, 1000, 4, 256),  # a partial last chunk
    Case(2, 300, 1, 128, seed=1),
    Case(5, 100, 4, 128, seed=2),  # one chunk, wider than the vocabulary
    Case(2, 2 * 64 + 2, 4, 64, seed=3),  # the last chunk holds fewer columns than k
    Case(4, 777, 6, 256, "bfloat16", seed=4),
    Case(3, 1000, 4, 256, ties=True, seed=5),
    Case(2, 1000, 1, 256, ties=True, seed=6),
    Case(0, 500, 3, 128, seed=7),
]


def check(case: Case, probs: torch.Tensor, ids: torch.Tensor) -> None:
    """Probabilities as the reference computes them; each id names a token of that probability (equal
    logits may come in another order); the Triton kernels also promise the lower id first among ties."""
    x = make_logits(case)
    want_p, _ = softmax_topk_reference(x, case.k)
    assert probs.dtype == torch.float32 and ids.dtype == torch.int64
    assert probs.shape == ids.shape == (case.rows, case.k)
    torch.testing.assert_close(probs, want_p, rtol=1e-5, atol=1e-7)
    full = torch.softmax(x.float(), dim=-1)
    torch.testing.assert_close(full.gather(1, ids), want_p, rtol=1e-5, atol=1e-7)
    assert all(len(set(r)) == case.k for r in ids.tolist())  # no token twice


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_is_the_softmax_top_k(case: Case) -> None:
    probs, ids = softmax_topk_reference(make_logits(case), case.k)
    check(case, probs, ids)


def test_reference_k1_takes_the_lower_id_of_a_tie() -> None:
    x = torch.zeros(1, 10)
    x[0, [7, 3]] = 1.0
    assert softmax_topk(x, 1)[1].tolist() == [[3]]


@pytest.mark.parametrize("k", [0, 11])
def test_k_outside_the_vocabulary_is_refused(k: int) -> None:
    with pytest.raises(ValueError, match="k must lie in 1..10"):
        softmax_topk(torch.zeros(2, 10), k)


def test_logits_must_be_a_float_matrix() -> None:
    with pytest.raises(ValueError, match=r"\[N, vocab\]"):
        softmax_topk(torch.zeros(10), 1)
    with pytest.raises(TypeError, match="floating point"):
        softmax_topk(torch.zeros(2, 10, dtype=torch.int64), 1)


def far_apart_scores() -> torch.Tensor:
    """Scores like a draft tree's: -inf (the root), and values so far below the maximum that their
    probabilities underflow to 0; a whole chunk (of 64) of -inf."""
    x = torch.full((2, 200), float("-inf"))
    x[0, 70:140] = -500.0 - torch.arange(70.0)
    x[0, [150, 3]] = torch.tensor([0.0, -200.0])
    x[1, 64:] = -torch.arange(136.0).flip(0) * 10
    return x


def test_top_k_indices_rank_values_not_probabilities() -> None:
    assert top_k_indices(far_apart_scores(), 4).tolist() == [[150, 3, 70, 71], [199, 198, 197, 196]]


# --------------------------------------------------------------------------------------------------------------------
# Triton (interpreter, subprocess)
# --------------------------------------------------------------------------------------------------------------------


def _triton_results() -> dict[str, list]:
    from specpilot.kernels.softmax_topk import softmax_topk_triton

    patch_bf16_cast()
    results = {case.name: [t.tolist() for t in softmax_topk_triton(make_logits(case), case.k, chunk=case.chunk)]
               for case in CASES}
    results["far-apart"] = softmax_topk_triton(far_apart_scores(), 4, chunk=64)[1].tolist()
    results["argmax"] = {case.name: row_argmax(make_logits(case), backend="triton").tolist() for case in CASES}
    return results


triton_results = interpreter_fixture(__file__)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_matches_the_reference(triton_results: dict[str, list], case: Case) -> None:
    probs, ids = triton_results[case.name]
    probs = torch.tensor(probs, dtype=torch.float32).view(case.rows, case.k)
    ids = torch.tensor(ids, dtype=torch.int64).view(case.rows, case.k)
    check(case, probs, ids)
    if case.ties:
        tied = sorted({case.vocab - 1, 1, case.chunk + 2, 0})[: case.k]
        assert ids[0].tolist()[: len(tied)] == tied


def test_triton_top_k_indices_rank_values(triton_results: dict[str, list]) -> None:
    assert triton_results["far-apart"] == [[150, 3, 70, 71], [199, 198, 197, 196]]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_argmax_is_torch_argmax(triton_results: dict[str, list], case: Case) -> None:
    """The first index among equal maxima, as greedy decoding has always chosen (ties cases included)."""
    assert triton_results["argmax"][case.name] == make_logits(case).argmax(-1).tolist()


if __name__ == "__main__":
    print(json.dumps(_triton_results()))
