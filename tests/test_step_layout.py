"""The step layout kernels (interpreter, in a subprocess: TRITON_INTERPRET must be set before triton is
imported) against their torch references, which the engine tests cover end to end."""

from __future__ import annotations

import json

import pytest
import torch
from triton_interpret import interpreter_fixture

from specpilot.kernels.step_layout import (
    lay_out_draft_reference,
    lay_out_next_verify_reference,
)

MAX_LEN, SCRATCH = 300, 5


def draft_case(b: int, block: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(outputs as the drafter's static buffers hold them: prefix views, int32 and int64; inputs)."""
    g = torch.Generator().manual_seed(seed)
    n, m = (b + 2) * block, b + 2  # buffers longer than the batch: the kernels write prefixes only
    outs = [torch.randint(0, 9, (n,), generator=g) for _ in range(4)]
    outs += [torch.randint(0, 9, (m,), generator=g).int() for _ in range(2)]
    outs.append(torch.randint(0, 9, (n,), generator=g))
    views = [t[: b * block] if t.shape[0] == n else t[:b] for t in outs]
    starts = torch.randint(0, 200, (b,), generator=g)
    slots = torch.randint(0, SCRATCH + 1, (b,), generator=g)
    counts = torch.randint(0, block + 1, (b,), generator=g)
    first = torch.randint(0, 1000, (b,), generator=g)
    return views, [starts, slots, counts, first]


def verify_case(b: int, q: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    positions, write_index, input_ids = (torch.randint(0, 500, (b * q,), generator=g) for _ in range(3))
    kv_lens = torch.randint(0, 9, (b,), generator=g).int()
    slot_ids = torch.randint(0, SCRATCH + 1, (b,), generator=g).int()
    starts = torch.randint(0, 200, (b,), generator=g)
    counts = torch.randint(1, q + 1, (b,), generator=g)
    bonus = torch.randint(0, 1000, (b,), generator=g)
    return [positions, write_index, kv_lens, input_ids], [slot_ids, starts, counts, bonus]


DRAFT = [(1, 16, 0), (6, 16, 1), (3, 5, 2)]
VERIFY = [(1, 16, 0), (7, 16, 1), (4, 6, 2)]


def test_references_write_what_the_layout_says() -> None:
    (ctx_pos, ctx_rows, pos, writes, kv_lens, slot_ids, ids), (starts, slots, counts, first) = draft_case(2, 4, 3)
    ids_before = ids.clone()
    lay_out_draft_reference(ctx_pos, ctx_rows, pos, writes, kv_lens, slot_ids, ids, starts, slots, counts, first,
                            MAX_LEN, SCRATCH)
    for i in range(2):
        s, c, slot = int(starts[i]), int(counts[i]), int(slots[i])
        assert pos[i * 4 : i * 4 + 4].tolist() == list(range(s + c, s + c + 4))
        assert writes[i * 4].item() == slot * MAX_LEN + s + c and kv_lens[i].item() == s + c + 4
        assert [r // MAX_LEN for r in ctx_rows[i * 4 : i * 4 + 4].tolist()] == [slot] * c + [SCRATCH] * (4 - c)
        assert ids[i * 4].item() == first[i].item() and torch.equal(ids[i * 4 + 1 : i * 4 + 4], ids_before[i * 4 + 1 : i * 4 + 4])


def _run_draft(fn, case):
    outs, ins = draft_case(*case)
    fn(*outs, *ins, MAX_LEN, SCRATCH)
    return [t.tolist() for t in outs]


def _run_verify(fn, case):
    (pos, writes, kv_lens, ids), (slot_ids, starts, counts, bonus) = verify_case(*case)
    fn(pos, writes, kv_lens, ids, slot_ids, starts, counts, bonus, SCRATCH)
    return [t.tolist() for t in (pos, writes, kv_lens, ids)]


def _triton_results() -> dict[str, list]:
    from specpilot.kernels.step_layout import (
        lay_out_draft_triton,
        lay_out_next_verify_triton,
    )

    return {"draft": [_run_draft(lay_out_draft_triton, c) for c in DRAFT],
            "verify": [_run_verify(lay_out_next_verify_triton, c) for c in VERIFY]}


triton_results = interpreter_fixture(__file__)


@pytest.mark.parametrize("i", range(len(DRAFT)))
def test_draft_layout_triton_matches_the_reference(triton_results: dict[str, list], i: int) -> None:
    assert triton_results["draft"][i] == _run_draft(lay_out_draft_reference, DRAFT[i])


@pytest.mark.parametrize("i", range(len(VERIFY)))
def test_next_verify_layout_triton_matches_the_reference(triton_results: dict[str, list], i: int) -> None:
    assert triton_results["verify"][i] == _run_verify(lay_out_next_verify_reference, VERIFY[i])


if __name__ == "__main__":
    print(json.dumps(_triton_results()))
