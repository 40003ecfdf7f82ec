"""Skinny GEMM: torch reference vs float64 matmul, Triton (interpreter) vs float64.

The Triton cases run in one subprocess with TRITON_INTERPRET=1, which triton reads when a kernel is decorated,
so it must be set before anything imports the kernel module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from triton_interpret import interpreter_fixture, patch_dot

from specpilot.kernels.skinny_gemm import (
    CANDIDATE_CONFIGS,
    SkinnyConfig,
    default_config,
    skinny_gemm,
    skinny_gemm_reference,
    tune,
)


@dataclass(frozen=True)
class Case:
    m: int
    n: int
    k: int
    dtype: str = "float32"
    bias: bool = False
    config: SkinnyConfig | None = None  # None: skinny_gemm's default_config
    seed: int = 0

    @property
    def name(self) -> str:
        c = self.config
        tiles = f"bn{c.block_n}-bk{c.block_k}-split{c.split_k}" if c else "default"
        return f"m{self.m}-n{self.n}-k{self.k}-{self.dtype}-{'bias' if self.bias else 'nobias'}-{tiles}"


def make_inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random x, w (and bias) with no zeros, so an unread tile or dropped term changes the result."""
    g = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, case.dtype)

    def rand(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=g)
        return (t + t.sign() * 0.1).to(dtype)  # nudged away from 0

    x, w = rand(case.m, case.k), rand(case.n, case.k)
    return x, w, rand(case.n) if case.bias else None


def exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y + bias.double() if bias is not None else y


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||; NaN anywhere (a poisoned element never written) gives inf."""
    err = ((got.double() - want).norm() / want.norm()).item()
    return err if err == err else float("inf")


# Output rounding dominates: fp32 ~1e-7, bf16 ~2e-3 (8 mantissa bits), fp16 ~3e-4.
TOL = {"float32": 1e-5, "bfloat16": 8e-3, "float16": 2e-3}


# --------------------------------------------------------------------------------------------------------------------
# Reference vs float64
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m, n, k", [(1, 40, 72), (3, 64, 256), (64, 33, 100)])
def test_reference_matches_float64(m: int, n: int, k: int, dtype: str, bias: bool) -> None:
    x, w, b = make_inputs(Case(m, n, k, dtype, bias))
    got = skinny_gemm_reference(x, w, b)
    assert got.dtype == x.dtype and got.shape == (m, n)
    assert rel_err(got, exact(x, w, b)) <= TOL[dtype]


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((torch.ones(2, 8), torch.ones(4, 9)), ValueError, "K mismatch"),
        ((torch.ones(65, 8), torch.ones(4, 8)), ValueError, "at most 64 rows"),
        ((torch.ones(2, 8), torch.ones(4, 8, dtype=torch.float16)), TypeError, "one dtype"),
        ((torch.ones(2, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32)), TypeError, "one dtype"),
        ((torch.ones(8, 2).T, torch.ones(4, 8)), ValueError, "unit-stride"),
        ((torch.ones(2, 8), torch.ones(4, 8), torch.ones(3)), ValueError, "bias must be"),
        ((torch.ones(8), torch.ones(4, 8)), ValueError, r"\[M, K\]"),
    ],
)
def test_skinny_gemm_validates_inputs(args: tuple, error: type[Exception], match: str) -> None:
    pytest.importorskip("triton")
    with pytest.raises(error, match=match):
        skinny_gemm(*args)


def test_default_config_is_a_candidate() -> None:
    pytest.importorskip("triton")
    for n, k in ((4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096), (128256, 4096), (40, 72)):
        assert default_config(1, n, k) in CANDIDATE_CONFIGS


def test_tune_needs_cuda() -> None:
    with pytest.raises(RuntimeError, match="CUDA"):
        tune(1, torch.ones(4, 8))


# --------------------------------------------------------------------------------------------------------------------
# Triton (interpreter, subprocess) vs float64
# --------------------------------------------------------------------------------------------------------------------


def _triton_cases() -> list[Case]:
    cases = []
    # (40, 72): a partial second column block and a partial last K tile; (64, 256): whole blocks and tiles.
    for (n, k), m, split, bias, dtype in (
        (nk, m, split, bias, dtype)
        for nk in ((40, 72), (64, 256))
        for m in (1, 3, 16)
        for split in (1, 2)
        for bias in (False, True)
        for dtype in ("float32", "bfloat16")
    ):
        config = SkinnyConfig(block_n=32, block_k=32 if k == 72 else 64, split_k=split, num_warps=4, num_stages=2)
        cases.append(Case(m, n, k, dtype, bias, config, seed=len(cases)))
    cases += [
        # 7 K tiles over 4 splits -> spans of 2 tiles, the last one partial; BLOCK_M 64; N below one block.
        Case(33, 24, 200, "bfloat16", True, SkinnyConfig(64, 32, 4, 4, 3), seed=100),
        Case(64, 48, 96, "float16", True, SkinnyConfig(16, 32, 2, 4, 2), seed=101),
        # More splits than K tiles; a candidate-sized tile.
        Case(5, 70, 40, "float32", False, SkinnyConfig(32, 32, 8, 4, 2), seed=102),
        Case(2, 64, 512, "bfloat16", True, SkinnyConfig(64, 256, 2, 4, 4), seed=103),
        Case(7, 200, 300, "bfloat16", True, None, seed=104),
    ]
    return cases


TRITON_CASES = _triton_cases()


def _poison_allocations() -> None:
    """torch.empty returns NaN-filled floats, so an output or workspace element never written shows up."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = poisoned


def _triton_errors() -> dict[str, float]:
    """Runs in the interpreter subprocess: relative error of each case against float64."""
    patch_dot()
    _poison_allocations()
    errors = {}
    for case in TRITON_CASES:
        x, w, b = make_inputs(case)
        got = skinny_gemm(x, w, b, config=case.config)
        assert got.dtype == x.dtype and got.shape == (case.m, case.n), case.name
        errors[case.name] = rel_err(got, exact(x, w, b))
    return errors


triton_errors = interpreter_fixture(__file__)


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: c.name)
def test_triton_matches_float64(triton_errors: dict[str, float], case: Case) -> None:
    err = triton_errors[case.name]
    assert err <= TOL[case.dtype], f"{case.name}: relative error {err}"


if __name__ == "__main__":
    print(json.dumps(_triton_errors()))
