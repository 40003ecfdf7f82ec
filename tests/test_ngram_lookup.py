"""Prompt lookup on the device: the torch reference against the host lookup (NgramIndex), the Triton
kernel (interpreter, in a subprocess: TRITON_INTERPRET must be set before triton is imported) against
the reference."""

from __future__ import annotations

import json

import pytest
import torch
from triton_interpret import interpreter_fixture

from specpilot.drafters.ngram import NgramIndex
from specpilot.kernels.ngram_lookup import (
    append_and_lookup_reference,
    ngram_lookup,
    ngram_lookup_reference,
)

K, MAX_N = 15, 4


def make_history(seed: int, slots: int = 6, width: int = 300, vocab: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of few distinct tokens (so n-grams repeat often) with copied stretches, and per slot a known
    length from 1 (a single token) to the full width."""
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(0, vocab, (slots, width), generator=g)
    for s in range(slots):  # a copied stretch: long matches with continuations
        a, b = sorted(torch.randint(0, width - 40, (2,), generator=g).tolist())
        history[s, b : b + 30] = history[s, a : a + 30].clone()
    history[0, :] = 7  # one token repeated: every n matches, the continuation runs into the end
    lengths = torch.tensor([width, 1, 2, 5, width // 2, width - 1])[:slots]
    return history, lengths


def host_lookup(history: torch.Tensor, slot: int, length: int, min_n: int) -> list[int]:
    index = NgramIndex(min_n, MAX_N)
    index.extend(history[slot, :length].tolist())
    tokens, n = index.match(K)
    return [int(n >= min_n), *tokens]


@pytest.mark.parametrize("min_n", [1, 2, 4])
def test_reference_matches_the_host_lookup(min_n: int) -> None:
    for seed in range(3):
        history, lengths = make_history(seed)
        slots = torch.tensor([3, 0, 5, 1, 2, 4])  # rows in another order than slots, a slot read twice
        slots[-1] = 3
        got = ngram_lookup_reference(history, slots, lengths[slots], K, min_n, MAX_N)
        want = [host_lookup(history, s, int(lengths[s]), min_n) for s in slots.tolist()]
        assert got.tolist() == want
        assert got[:, 0].sum() >= 1  # the cases do exercise matches


def test_lengths_are_clamped_and_inputs_checked() -> None:
    history, _ = make_history(0)
    slots = torch.tensor([2, 2])
    got = ngram_lookup(history, slots, torch.tensor([0, 10**6]), K, 2, MAX_N)
    assert got.tolist() == ngram_lookup(history, slots, torch.tensor([1, history.shape[1]]), K, 2, MAX_N).tolist()
    with pytest.raises(ValueError, match="int64"):
        ngram_lookup(history.int(), slots, slots, K, 2, MAX_N)
    with pytest.raises(ValueError, match="min_n <= max_n"):
        ngram_lookup(history, slots, slots, K, 3, 2)


def append_case(seed: int, width: int = 300) -> tuple[torch.Tensor, ...]:
    """A history with a sink column, and per slot a committed length and up to 6 new tokens to append
    (one slot near the end: its tokens past the last real column must land nowhere)."""
    history, _ = make_history(seed, width=width + 1)
    g = torch.Generator().manual_seed(seed + 100)
    slots = torch.tensor([4, 1, 0, 3])
    starts = torch.tensor([20, 0, width - 3, 150])
    tokens = torch.randint(0, 5, (4, 6), generator=g)
    counts = torch.tensor([6, 1, 6, 3])
    return history, slots, starts, tokens, counts


def test_append_then_lookup_is_the_lookup_of_the_extended_context() -> None:
    history, slots, starts, tokens, counts = append_case(0)
    width = history.shape[1] - 1
    want_history = history.clone()
    for s, a, t, c in zip(slots.tolist(), starts.tolist(), tokens.tolist(), counts.tolist()):
        for j in range(c):
            if a + 1 + j < width:
                want_history[s, a + 1 + j] = t[j]
    got = append_and_lookup_reference(history, slots, starts, tokens, counts, K, 2, MAX_N)
    assert torch.equal(history[:, :width], want_history[:, :width])
    lengths = (starts + 1 + counts).clamp(max=width)
    assert got.tolist() == [host_lookup(want_history, s, int(n), 2) for s, n in zip(slots.tolist(), lengths.tolist())]


CASES = [(seed, min_n) for seed in range(3) for min_n in (1, 2)]


def _triton_results() -> dict[str, list]:
    from specpilot.kernels.ngram_lookup import (
        append_and_lookup_triton,
        ngram_lookup_triton,
    )

    out = {}
    for seed in range(2):
        history, slots, starts, tokens, counts = append_case(seed, width=1500)
        hint = append_and_lookup_triton(history, slots, starts, tokens.t().contiguous().t(), counts, K, 2, MAX_N)
        out[f"append-{seed}"] = [hint.tolist(), history[:, :-1].tolist()]
    for seed, min_n in CASES:
        history, lengths = make_history(seed, width=2100)  # more than one 1024-position block
        slots = torch.arange(history.shape[0]).flip(0)
        out[f"{seed}-{min_n}"] = ngram_lookup_triton(history, slots, lengths[slots], K, min_n, MAX_N).tolist()
    return out


triton_results = interpreter_fixture(__file__)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c[0]}-min{c[1]}")
def test_triton_matches_the_reference(triton_results: dict[str, list], case: tuple[int, int]) -> None:
    seed, min_n = case
    history, lengths = make_history(seed, width=2100)
    slots = torch.arange(history.shape[0]).flip(0)
    assert triton_results[f"{seed}-{min_n}"] == ngram_lookup_reference(history, slots, lengths[slots], K, min_n, MAX_N).tolist()


@pytest.mark.parametrize("seed", range(2))
def test_append_and_lookup_triton_matches_the_reference(triton_results: dict[str, list], seed: int) -> None:
    history, slots, starts, tokens, counts = append_case(seed, width=1500)
    hint = append_and_lookup_reference(history, slots, starts, tokens, counts, K, 2, MAX_N)
    assert triton_results[f"append-{seed}"] == [hint.tolist(), history[:, :-1].tolist()]


if __name__ == "__main__":
    print(json.dumps(_triton_results()))
