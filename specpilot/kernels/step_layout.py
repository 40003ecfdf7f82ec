"""The device-side index work between a speculative step's passes, one launch each.

Why: after a greedy verify the device lays out, without the host, the drafter's next pass (where the
committed rows' context K/V go, where the new block sits) and the target's next verify (its block starts
after the tokens just committed). As torch ops these are about twenty kernels of a microsecond or two
each inside the step's graphs; here each is one program per request over the block's positions.

* ``lay_out_draft``: request i committed ``counts[i]`` tokens after its ``starts[i]`` cached ones in
  slot ``slots[i]``; its context rows j < counts[i] go to positions starts + j (rows past the count to
  the scratch slot, where they harm nothing), and its new block [first[i], masks...] sits at
  starts + counts + j. Writes ctx_positions, ctx_rows, positions, write_index [b * B]; kv_lens,
  slot_ids [b]; input_ids[i * B] (the block's first token; the masks stay).
* ``lay_out_next_verify``: a verify batch of b requests x q becomes the same requests' next verify:
  live rows (not the scratch slot) move on by their count; the block's first token becomes the bonus
  token. Updates positions, write_index [b * q] and kv_lens, input_ids[i * q] in place.

Each has a plain-torch reference (``*_reference``; CPU) and a Triton kernel (``*_triton``; CUDA), and a
dispatcher. No host sync, grid fixed by shapes: graph-capturable.
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_support import pick_backend, require_triton, tl, triton

__all__ = ["lay_out_draft", "lay_out_draft_reference", "lay_out_draft_triton", "lay_out_next_verify",
           "lay_out_next_verify_reference", "lay_out_next_verify_triton"]


def lay_out_draft_reference(ctx_positions: torch.Tensor, ctx_rows: torch.Tensor, positions: torch.Tensor,
                            write_index: torch.Tensor, kv_lens: torch.Tensor, slot_ids: torch.Tensor,
                            input_ids: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                            first: torch.Tensor, max_len: int, scratch_slot: int) -> None:
    b = starts.shape[0]
    B = positions.shape[0] // b if b else 0
    j = torch.arange(B, device=starts.device)
    use = j < counts[:, None]
    base = slots.long() * max_len + starts
    ctx_positions.view(b, B).copy_(torch.where(use, starts[:, None] + j, j))
    ctx_rows.view(b, B).copy_(torch.where(use, base[:, None] + j, scratch_slot * max_len + j))
    nxt = starts + counts
    positions.view(b, B).copy_(nxt[:, None] + j)
    write_index.view(b, B).copy_((base + counts)[:, None] + j)
    kv_lens.copy_(nxt + B)
    slot_ids.copy_(slots)
    input_ids.view(b, B)[:, 0].copy_(first)


def lay_out_next_verify_reference(positions: torch.Tensor, write_index: torch.Tensor, kv_lens: torch.Tensor,
                                  input_ids: torch.Tensor, slot_ids: torch.Tensor, starts: torch.Tensor,
                                  counts: torch.Tensor, bonus: torch.Tensor, scratch_slot: int) -> None:
    b = slot_ids.shape[0]
    q = positions.shape[0] // b if b else 0
    live = slot_ids != scratch_slot
    shift = torch.where(live, counts, 0)
    j = torch.arange(q, device=shift.device)
    positions.view(b, q).copy_((starts + shift)[:, None] + j)
    write_index.view(b, q).copy_((write_index.view(b, q)[:, 0] + shift)[:, None] + j)
    kv_lens.copy_(starts + shift + q)
    head = input_ids.view(b, q)[:, 0]
    head.copy_(torch.where(live, bonus, head))


if triton is not None:

    @triton.jit
    def _lay_out_draft_kernel(ctx_pos_ptr, ctx_rows_ptr, pos_ptr, write_ptr, kv_lens_ptr, slot_ids_ptr, ids_ptr,
                              starts_ptr, slots_ptr, counts_ptr, first_ptr, max_len, scratch_slot,
                              B: tl.constexpr, BP: tl.constexpr):
        i = tl.program_id(0)
        j = tl.arange(0, BP).to(tl.int64)
        lane = j < B
        start = tl.load(starts_ptr + i).to(tl.int64)
        slot = tl.load(slots_ptr + i).to(tl.int64)
        count = tl.load(counts_ptr + i).to(tl.int64)
        base = slot * max_len + start
        use = j < count
        row = i * B + j
        tl.store(ctx_pos_ptr + row, tl.where(use, start + j, j), mask=lane)
        tl.store(ctx_rows_ptr + row, tl.where(use, base + j, scratch_slot * max_len + j), mask=lane)
        tl.store(pos_ptr + row, start + count + j, mask=lane)
        tl.store(write_ptr + row, base + count + j, mask=lane)
        tl.store(kv_lens_ptr + i, (start + count + B).to(kv_lens_ptr.dtype.element_ty))
        tl.store(slot_ids_ptr + i, slot.to(slot_ids_ptr.dtype.element_ty))
        tl.store(ids_ptr + i * B, tl.load(first_ptr + i).to(ids_ptr.dtype.element_ty))

    @triton.jit
    def _lay_out_next_verify_kernel(pos_ptr, write_ptr, kv_lens_ptr, ids_ptr, slot_ids_ptr, starts_ptr, counts_ptr,
                                    bonus_ptr, scratch_slot, Q: tl.constexpr, QP: tl.constexpr):
        i = tl.program_id(0)
        j = tl.arange(0, QP).to(tl.int64)
        lane = j < Q
        live = tl.load(slot_ids_ptr + i) != scratch_slot
        shift = tl.where(live, tl.load(counts_ptr + i).to(tl.int64), 0)
        start = tl.load(starts_ptr + i).to(tl.int64) + shift
        write0 = tl.load(write_ptr + i * Q).to(tl.int64) + shift
        tl.store(pos_ptr + i * Q + j, start + j, mask=lane)
        tl.store(write_ptr + i * Q + j, write0 + j, mask=lane)
        tl.store(kv_lens_ptr + i, (start + Q).to(kv_lens_ptr.dtype.element_ty))
        head = tl.load(ids_ptr + i * Q)
        tl.store(ids_ptr + i * Q, tl.where(live, tl.load(bonus_ptr + i).to(head.dtype), head))


def _contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("the layout kernels write contiguous buffers (prefix views of static inputs)")


def lay_out_draft_triton(ctx_positions: torch.Tensor, ctx_rows: torch.Tensor, positions: torch.Tensor,
                         write_index: torch.Tensor, kv_lens: torch.Tensor, slot_ids: torch.Tensor,
                         input_ids: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                         first: torch.Tensor, max_len: int, scratch_slot: int) -> None:
    require_triton("lay_out_draft_triton")
    outs = (ctx_positions, ctx_rows, positions, write_index, kv_lens, slot_ids, input_ids)
    _contiguous(*outs)
    starts, slots, counts, first = (t.contiguous() for t in (starts, slots, counts, first))
    b = starts.shape[0]
    if b:
        B = positions.shape[0] // b
        _lay_out_draft_kernel[(b,)](*outs, starts, slots, counts, first, max_len, scratch_slot,
                                    B=B, BP=triton.next_power_of_2(B), num_warps=1)


def lay_out_next_verify_triton(positions: torch.Tensor, write_index: torch.Tensor, kv_lens: torch.Tensor,
                               input_ids: torch.Tensor, slot_ids: torch.Tensor, starts: torch.Tensor,
                               counts: torch.Tensor, bonus: torch.Tensor, scratch_slot: int) -> None:
    require_triton("lay_out_next_verify_triton")
    _contiguous(positions, write_index, kv_lens, input_ids)
    slot_ids, starts, counts, bonus = (t.contiguous() for t in (slot_ids, starts, counts, bonus))
    b = slot_ids.shape[0]
    if b:
        q = positions.shape[0] // b
        _lay_out_next_verify_kernel[(b,)](positions, write_index, kv_lens, input_ids, slot_ids, starts, counts,
                                          bonus, scratch_slot, Q=q, QP=triton.next_power_of_2(q), num_warps=1)


def lay_out_draft(ctx_positions: torch.Tensor, ctx_rows: torch.Tensor, positions: torch.Tensor,
                  write_index: torch.Tensor, kv_lens: torch.Tensor, slot_ids: torch.Tensor, input_ids: torch.Tensor,
                  starts: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, first: torch.Tensor, max_len: int,
                  scratch_slot: int, backend: str = "auto") -> None:
    """In place: a drafter pass's layout for b requests (see the module's docstring)."""
    fn = lay_out_draft_triton if pick_backend(backend, positions) == "triton" else lay_out_draft_reference
    fn(ctx_positions, ctx_rows, positions, write_index, kv_lens, slot_ids, input_ids, starts, slots, counts, first,
       max_len, scratch_slot)


def lay_out_next_verify(positions: torch.Tensor, write_index: torch.Tensor, kv_lens: torch.Tensor,
                        input_ids: torch.Tensor, slot_ids: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                        bonus: torch.Tensor, scratch_slot: int, backend: str = "auto") -> None:
    """In place: a verify batch becomes its requests' next verify (see the module's docstring)."""
    fn = lay_out_next_verify_triton if pick_backend(backend, positions) == "triton" else lay_out_next_verify_reference
    fn(positions, write_index, kv_lens, input_ids, slot_ids, starts, counts, bonus, scratch_slot)
