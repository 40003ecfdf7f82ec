"""The keyed draw (kernels/keyed_argmax.py): the Triton kernel picks the reference's token on every row (under
the interpreter on CPU, and on CUDA), with zero-probability tokens, ties, seeds past int64 and one-row batches."""

from __future__ import annotations

import json

import pytest
import torch
from triton_interpret import interpreter_fixture

from specpilot.kernels.keyed_argmax import as_int64, keyed_argmax, keyed_argmax_reference, keyed_scores


def make_case(n: int, v: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(n, v, generator=g) * 3, dim=-1)
    probs[probs < probs.max(-1, keepdim=True).values * 1e-3] = 0.0  # a top-p-like support
    probs[0] = 0.0
    probs[0, [3, 7]] = 0.5  # a two-token row
    if n > 2:
        probs[2] = 0.0  # no support at all: the lowest id, as torch.argmax of all -inf
    seeds = torch.tensor([as_int64(2**64 - 1 - 977 * i) if i % 2 else 31 * i for i in range(n)])
    positions = torch.randint(0, 5000, (n,), generator=g)
    return probs, seeds, positions


CASES = [(1, 50), (5, 3000), (9, 4097)]


def test_reference_scores_minus_inf_off_the_support():
    probs, seeds, positions = make_case(5, 300)
    scores = keyed_scores(probs, seeds, positions)
    assert torch.isinf(scores[probs == 0]).all() and torch.isfinite(scores[probs > 0]).all()
    chosen = keyed_argmax_reference(probs, seeds, positions)
    assert chosen[0] in (3, 7) and chosen[2] == 0
    assert (probs[torch.arange(5), chosen][[0, 1, 3, 4]] > 0).all()


def _triton_results() -> dict[str, bool]:
    out = {}
    for n, v in CASES:
        probs, seeds, positions = make_case(n, v, seed=n)
        got = keyed_argmax(probs, seeds, positions, backend="triton")
        out[f"{n}x{v}"] = torch.equal(got, keyed_argmax_reference(probs, seeds, positions))
        one = keyed_argmax(probs[-1:], int(seeds[-1]), positions[-1:], backend="triton")
        out[f"{n}x{v} last row alone, int seed"] = bool(one[0] == got[-1])
    return out


triton_results = interpreter_fixture(__file__)


@pytest.mark.parametrize("case", [f"{n}x{v}" for n, v in CASES] + [f"{n}x{v} last row alone, int seed" for n, v in CASES])
def test_triton_picks_the_reference_token(triton_results: dict[str, bool], case: str) -> None:
    assert triton_results[case]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_picks_the_reference_token_over_a_verify_batch():
    probs, seeds, positions = make_case(512, 49152, seed=4)
    probs, seeds, positions = probs.cuda(), seeds.cuda(), positions.cuda()
    got = keyed_argmax(probs, seeds, positions)
    assert torch.equal(got, keyed_argmax_reference(probs, seeds, positions))
    assert torch.equal(keyed_argmax(probs[100:101], seeds[100:101], positions[100:101]), got[100:101])


if __name__ == "__main__":
    print(json.dumps(_triton_results()))
