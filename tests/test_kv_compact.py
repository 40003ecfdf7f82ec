"""Compacting accepted tree nodes' K/V: the torch reference against a row-by-row model of the move, the
Triton kernel (interpreter, in a subprocess: TRITON_INTERPRET must be set before triton is imported)
against the reference."""

from __future__ import annotations

import json

import pytest
import torch
from triton_interpret import interpreter_fixture

from specpilot.kernels.kv_compact import compact_accepted_reference

Q = 8


def make_case(seed: int, width: int) -> tuple[torch.Tensor, ...]:
    """K/V planes of 3 slots x 40 positions; per request an accepted path of increasing nodes (one per
    depth), some touching rows a later depth reads (node d' == an earlier depth's destination)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(4, 3 * 40, width, generator=g)
    rows = torch.tensor([[5, 6], [40 + 20, 0], [80 + 0, 1]])
    base = rows[:, 0]  # strided, as the engine passes it (each request's first verify row)
    counts = torch.tensor([4, 1, Q])
    nodes = torch.zeros(3, Q, dtype=torch.long)
    nodes[0, 1:4] = torch.tensor([2, 3, 6])  # depth 2 reads row base+3, which depth 3 then overwrites
    nodes[2, 1:] = torch.arange(1, Q)  # the chain prefix: every row onto itself
    return kv, base, counts, nodes


def test_reference_moves_accepted_rows_to_their_depths() -> None:
    kv, base, counts, nodes = make_case(0, 6)
    before = kv.clone()
    compact_accepted_reference(kv, base, counts, nodes)
    for i in range(3):
        for d in range(1, Q):
            src = base[i] + (nodes[i, d] if d < counts[i] else d)
            assert torch.equal(kv[:, base[i] + d], before[:, src])


CASES = [(0, 6), (1, 192), (2, 1500)]  # width: one block, a wide block, several blocks


def _triton_results() -> dict[str, list]:
    from specpilot.kernels.kv_compact import compact_accepted_triton

    out = {}
    for seed, width in CASES:
        kv, base, counts, nodes = make_case(seed, width)
        compact_accepted_triton(kv, base, counts, nodes)
        out[f"{seed}-{width}"] = kv.tolist()
    return out


triton_results = interpreter_fixture(__file__)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"width{c[1]}")
def test_triton_matches_the_reference(triton_results: dict[str, list], case: tuple[int, int]) -> None:
    kv, base, counts, nodes = make_case(*case)
    compact_accepted_reference(kv, base, counts, nodes)
    assert triton_results[f"{case[0]}-{case[1]}"] == kv.tolist()


if __name__ == "__main__":
    print(json.dumps(_triton_results()))
