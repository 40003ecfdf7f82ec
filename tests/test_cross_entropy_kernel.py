"""Cross-entropy rows: the torch reference against torch's own cross-entropy and its autograd gradient, the
Triton kernel (interpreter, a subprocess: see triton_interpret.py) against the reference."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from triton_interpret import interpreter_fixture, patch_bf16_cast

from specpilot.kernels.cross_entropy import cross_entropy_rows, cross_entropy_rows_reference


@dataclass(frozen=True)
class Case:
    rows: int
    vocab: int
    block: int
    dtype: str = "float32"
    ties: bool = False  # row 0: its target's logit shared by two other columns, one logit above them
    seed: int = 0

    @property
    def name(self) -> str:
        return f"n{self.rows}-v{self.vocab}-b{self.block}-{self.dtype}{'-ties' if self.ties else ''}"


def make(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed)
    x = 4 * torch.randn(case.rows, case.vocab, generator=g)
    targets = torch.randint(0, case.vocab, (case.rows,), generator=g)
    if case.ties:
        targets[0] = 5
        x[0].clamp_(max=6.0)
        x[0, [5, 9, case.vocab - 1]] = 7.0
        x[0, 2] = 8.0
    return x.to(getattr(torch, case.dtype)), targets


CASES = [
    Case(3, 1000, 256),  # a partial last block
    Case(4, 300, 512, seed=1),  # one block, wider than the vocabulary
    Case(5, 777, 128, "bfloat16", seed=2),
    Case(2, 1000, 256, ties=True, seed=3),
    Case(0, 500, 128, seed=4),
]


def expected(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's cross-entropy, its gradient by autograd (fp32), and the rank counted plainly."""
    logits, targets = make(case)
    x = logits.float().requires_grad_(True)
    loss = F.cross_entropy(x, targets, reduction="none")
    loss.sum().backward()
    rank = torch.tensor([int((row > row[t]).sum()) for row, t in zip(x.detach(), targets)], dtype=torch.int64)
    return loss.detach(), rank, x.grad


def check(case: Case, loss: torch.Tensor, rank: torch.Tensor, grad: torch.Tensor) -> None:
    want_loss, want_rank, want_grad = expected(case)
    assert loss.dtype == torch.float32 and rank.dtype == torch.int64 and grad.dtype == getattr(torch, case.dtype)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    assert rank.tolist() == want_rank.tolist()
    # the gradient rounded to the logits' dtype
    tol = {"float32": (1e-5, 1e-7), "bfloat16": (1e-2, 1e-5)}[case.dtype]
    torch.testing.assert_close(grad.float(), want_grad, rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_is_torch_s_cross_entropy_and_its_gradient(case: Case) -> None:
    logits, targets = make(case)
    loss, rank = cross_entropy_rows_reference(logits, targets)
    check(case, loss, rank, logits)


def test_ties_count_only_logits_above_the_target() -> None:
    logits, targets = make(CASES[3])
    assert cross_entropy_rows(logits, targets)[1][0].item() == 1  # 8.0 above; the other 7.0s tie


@pytest.mark.parametrize(("logits", "targets", "match"), [
    (torch.zeros(4), torch.zeros(4, dtype=torch.int64), r"\[N, vocab\]"),
    (torch.zeros(2, 5), torch.zeros(3, dtype=torch.int64), r"integer \[2\]"),
    (torch.zeros(2, 5), torch.zeros(2), r"integer \[2\]"),
    (torch.zeros(5, 2).t(), torch.zeros(2, dtype=torch.int64), "unit-stride"),
])
def test_bad_inputs_are_refused(logits: torch.Tensor, targets: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cross_entropy_rows(logits, targets)


def _triton_results() -> dict[str, list]:
    from specpilot.kernels.cross_entropy import cross_entropy_rows_triton

    patch_bf16_cast()
    results = {}
    for case in CASES:
        logits, targets = make(case)
        loss, rank = cross_entropy_rows_triton(logits, targets, block=case.block)
        results[case.name] = [loss.tolist(), rank.tolist(), logits.float().tolist()]
    return results


triton_results = interpreter_fixture(__file__)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_matches_the_reference(triton_results: dict[str, list], case: Case) -> None:
    loss, rank, grad = triton_results[case.name]
    grad = torch.tensor(grad, dtype=torch.float32).view(case.rows, case.vocab).to(getattr(torch, case.dtype))
    check(case, torch.tensor(loss, dtype=torch.float32), torch.tensor(rank, dtype=torch.int64), grad)


if __name__ == "__main__":
    print(json.dumps(_triton_results()))
