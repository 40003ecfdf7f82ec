"""Cross-entropy rows over a vocabulary without fp32 logits: each row's loss against its target token, the
target's rank among the row's logits, and the loss's gradient with respect to the logits.

Why: a drafter's training loss runs over tens of thousands of rows of a 49,152-word vocabulary a step. torch's
path (an fp32 copy of the logits, log-softmax forward and backward, the rank comparison, the casts between)
passes over every logit many times in fp32 and took about a third of a training step on an H100
(docs/RESULTS.md, session 41). Here one program per row reads the row twice in its own dtype (the online
log-sum-exp and the rank, then the gradient) and writes the gradient once, over the logits themselves.

One contract, three entry points: ``cross_entropy_rows(logits, targets)`` returns ``(loss, rank)`` — loss
float32 [N] (log-sum-exp minus the target's logit, in fp32), rank int64 [N] (how many logits exceed the target's,
0 when it is the row's largest) — and overwrites ``logits`` with softmax(logits) minus the target's one-hot,
rounded to the logits' dtype (the loss's gradient; the caller scales it per row).

* ``cross_entropy_rows_reference`` - plain torch; the CPU path.
* ``cross_entropy_rows_triton`` - the Triton kernel, for CUDA tensors.
* ``cross_entropy_rows`` - Triton for CUDA tensors when triton imports, torch otherwise (``backend`` overrides).
"""

from __future__ import annotations

import torch

from specpilot.kernels.triton_support import pick_backend, require_triton, tl, triton

__all__ = ["cross_entropy_rows", "cross_entropy_rows_reference", "cross_entropy_rows_triton"]

BLOCK = 4096  # columns a program holds at once: 12 blocks for a 49,152-word vocabulary


def _check(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be floating point [N, vocab], got {logits.dtype} {tuple(logits.shape)}")
    if targets.shape != logits.shape[:1] or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be integer [{logits.shape[0]}], got {targets.dtype} {tuple(targets.shape)}")
    if targets.device != logits.device:
        raise ValueError(f"targets are on {targets.device}, logits on {logits.device}")
    if logits.stride(1) != 1:
        raise ValueError("logits must have a unit-stride last dimension")


def cross_entropy_rows_reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(logits, targets)
    x = logits.float()
    target_logit = x.gather(1, targets.long()[:, None])
    lse = torch.logsumexp(x, dim=1)
    rank = (x > target_logit).sum(1)
    grad = torch.exp(x - lse[:, None])
    grad.scatter_add_(1, targets.long()[:, None], torch.full_like(target_logit, -1.0))
    logits.copy_(grad)
    return lse - target_logit.squeeze(1), rank


if triton is not None:

    @triton.jit
    def _cross_entropy_rows_kernel(x_ptr, stride_row, n_cols, target_ptr, loss_ptr, rank_ptr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * stride_row
        target = tl.load(target_ptr + row).to(tl.int64)
        t = tl.load(base + target).to(tl.float32)
        offs = tl.arange(0, BLOCK)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        above = tl.zeros((), tl.int64)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
            above += tl.sum((x > t).to(tl.int64), 0)
        lse = m + tl.log(s)
        tl.store(loss_ptr + row, lse - t)
        tl.store(rank_ptr + row, above)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            inside = cols < n_cols
            x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
            tl.store(base + cols, grad.to(x_ptr.dtype.element_ty), mask=inside)


def cross_entropy_rows_triton(logits: torch.Tensor, targets: torch.Tensor,
                              block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    require_triton("cross_entropy_rows_triton")
    _check(logits, targets)
    if block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    n, vocab = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    rank = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        _cross_entropy_rows_kernel[(n,)](logits, logits.stride(0), vocab, targets, loss, rank,
                                         BLOCK=min(block, triton.next_power_of_2(vocab)), num_warps=8)
    return loss, rank


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor,
                       backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(loss float32 [N], target rank int64 [N]); `logits` [N, vocab] becomes softmax minus the target's one-hot."""
    if pick_backend(backend, logits) == "triton":
        return cross_entropy_rows_triton(logits, targets)
    return cross_entropy_rows_reference(logits, targets)
