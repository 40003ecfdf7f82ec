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


PAGE = 8


def paged(kv: torch.Tensor, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """kv's slot rows cut into pages of PAGE, shuffled into a pool with spare pages: (pool, flat table)."""
    pages = kv.shape[1] // PAGE
    table = torch.randperm(pages + 3, generator=torch.Generator().manual_seed(seed))[:pages].to(torch.int32)
    pool = torch.zeros(kv.shape[0], (pages + 3) * PAGE, kv.shape[2])
    pool.view(kv.shape[0], pages + 3, PAGE, -1)[:, table.long()] = kv.view(kv.shape[0], pages, PAGE, -1)
    return pool, table


def unpaged(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return pool.view(pool.shape[0], -1, PAGE, pool.shape[2])[:, table.long()].reshape(pool.shape[0], -1, pool.shape[2])


def test_reference_through_a_page_table_moves_the_same_rows() -> None:
    kv, base, counts, nodes = make_case(3, 6)
    pool, table = paged(kv)
    compact_accepted_reference(kv, base, counts, nodes)
    compact_accepted_reference(pool, base, counts, nodes, table, PAGE)
    assert torch.equal(unpaged(pool, table), kv)


CASES = [(0, 6), (1, 192), (2, 1500)]  # width: one block, a wide block, several blocks


def _triton_results() -> dict[str, list]:
    from specpilot.kernels.kv_compact import compact_accepted_triton

    out = {}
    for seed, width in CASES:
        kv, base, counts, nodes = make_case(seed, width)
        compact_accepted_triton(kv, base, counts, nodes)
        out[f"{seed}-{width}"] = kv.tolist()
    kv, base, counts, nodes = make_case(3, 6)
    pool, table = paged(kv)
    compact_accepted_triton(pool, base, counts, nodes, table, PAGE)
    out["paged"] = unpaged(pool, table).tolist()
    return out


triton_results = interpreter_fixture(__file__)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"width{c[1]}")
def test_triton_matches_the_reference(triton_results: dict[str, list], case: tuple[int, int]) -> None:
    kv, base, counts, nodes = make_case(*case)
    compact_accepted_reference(kv, base, counts, nodes)
    assert triton_results[f"{case[0]}-{case[1]}"] == kv.tolist()


def test_triton_through_a_page_table_matches_the_reference(triton_results: dict[str, list]) -> None:
    kv, base, counts, nodes = make_case(3, 6)
    compact_accepted_reference(kv, base, counts, nodes)
    assert triton_results["paged"] == kv.tolist()


if __name__ == "__main__":
    print(json.dumps(_triton_results()))
