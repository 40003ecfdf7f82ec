"""Static batch buffers: every field a kernel reads starts 16-byte aligned whatever the batch, since Triton compiles
a variant of a kernel per pointer alignment (an eager drafter sizes its inputs to the pass's request count, and
a batch's tail meets odd counts mid-run: a compile inside a timed step)."""

import pytest
import torch

from specpilot.state.static_batch import RaggedStaticBatch, StaticBatch


def _aligned(batch) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in (batch.input_ids, batch.positions, batch.write_index, batch.slot_ids,
                                                  batch.q_lens, batch.kv_lens, batch.q_starts))


@pytest.mark.parametrize("max_b", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("q", [1, 3, 16])
def test_a_static_batchs_fields_are_aligned_for_any_request_count(max_b, q):
    static = StaticBatch(max_b, q, torch.device("cpu"), scratch_slot=0, max_len=64)
    assert all(_aligned(static.batch(b, 1)) for b in range(1, max_b + 1))
    static.fill([0] * max_b, [0] * max_b, [[1] * q] * max_b, max_b)  # a host fill still fits the padded buffers
    assert static.batch(max_b, 1).q_lens.tolist() == [q] * max_b


@pytest.mark.parametrize("max_b, max_t", [(1, 5), (3, 7), (4, 9)])
def test_a_ragged_batchs_fields_are_aligned_for_any_size(max_b, max_t):
    ragged = RaggedStaticBatch(max_b, max_t, q=4, device=torch.device("cpu"), scratch_slot=0, max_len=64,
                               spare_len=16)
    assert _aligned(ragged.batch(max_b, max_t, 1))
