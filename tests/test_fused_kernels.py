"""Fused kernels: torch references vs the unfused module code, Triton (interpreter) vs the references.

The Triton cases run in one subprocess with TRITON_INTERPRET=1 (triton reads it when a kernel is decorated). There,
outputs the kernels allocate are poisoned with NaN and caches hold random data, so an unwritten output element, an
unwritten cache row or a stray write into a row not listed all show up.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from triton_interpret import interpreter_fixture, patch_bf16_cast

from specpilot.kernels.fused import (
    rms_norm,
    rms_norm_reference,
    rope_and_cache_write,
    rope_and_cache_write_reference,
    silu_and_mul,
    silu_and_mul_reference,
)
from specpilot.models.rope import RotaryTable
from specpilot.models.transformer import RMSNorm

EPS = 1e-5
MAX_POS = 64
CPU = torch.device("cpu")


# --------------------------------------------------------------------------------------------------------------------
# Cases and inputs
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NormCase:
    tokens: int
    hidden: int
    dtype: str
    residual: bool
    row_pad: int = 0  # > 0: x and residual are column slices of wider buffers (row stride != H)
    weight_dtype: str | None = None  # None: the activation dtype

    @property
    def name(self) -> str:
        pad = f"-pad{self.row_pad}" if self.row_pad else ""
        weight = f"-w{self.weight_dtype}" if self.weight_dtype else ""
        return f"norm-T{self.tokens}-H{self.hidden}-{self.dtype}-{'res' if self.residual else 'nores'}{pad}{weight}"


@dataclass(frozen=True)
class RopeCase:
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    qk_norm: bool
    layout: str  # "qkv": views of one fused projection output; "strided": heads padded (head stride != D)

    @property
    def name(self) -> str:
        norm = "-qknorm" if self.qk_norm else ""
        return f"rope-T{self.tokens}-{self.heads}x{self.kv_heads}-D{self.head_dim}-{self.dtype}-{self.layout}{norm}"


@dataclass(frozen=True)
class SiluCase:
    tokens: int
    inter: int
    dtype: str
    row_pad: int = 0

    @property
    def name(self) -> str:
        return f"silu-T{self.tokens}-I{self.inter}-{self.dtype}" + (f"-pad{self.row_pad}" if self.row_pad else "")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def _cols(buf: torch.Tensor, n: int) -> torch.Tensor:
    """The first n columns of a [T, >= n] buffer: a view with row stride buf.shape[1]."""
    return buf[:, :n]


def norm_inputs(case: NormCase, seed: int = 0) -> dict:
    g = _gen(seed)
    dtype = getattr(torch, case.dtype)
    width = case.hidden + case.row_pad
    inp = dict(
        x=_cols(_randn(g, case.tokens, width, dtype=dtype), case.hidden),
        weight=(1 + 0.5 * torch.randn(case.hidden, generator=g)).to(getattr(torch, case.weight_dtype or case.dtype)),
        eps=EPS,
    )
    if case.residual:
        inp["residual"] = _cols(_randn(g, case.tokens, width, dtype=dtype), case.hidden)
    return inp


def rope_inputs(case: RopeCase, seed: int = 0, slots: int = 3, max_len: int = 8) -> dict:
    """Random q/k/v, positions, distinct cache rows in random order (scratch slot included), random caches."""
    g = _gen(seed)
    dtype = getattr(torch, case.dtype)
    T, Hq, Hkv, D = case.tokens, case.heads, case.kv_heads, case.head_dim
    if case.layout == "qkv":  # as Attention.forward splits its fused projection
        qkv = _randn(g, T, (Hq + 2 * Hkv) * D, dtype=dtype)
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
    else:
        q, k, v = (_randn(g, T, h, D + 8, dtype=dtype)[..., :D] for h in (Hq, Hkv, Hkv))
    rope = RotaryTable(D, 10000.0, None, MAX_POS, CPU)
    k_cache, v_cache = (torch.randn(slots + 1, max_len, Hkv, D, generator=g).to(dtype) for _ in range(2))
    inp = dict(
        q=q,
        k=k,
        v=v,
        cos=rope.cos,
        sin=rope.sin,
        positions=torch.randint(0, MAX_POS, (T,), generator=g),
        rows=torch.randperm((slots + 1) * max_len, generator=g)[:T],
        k_cache=k_cache,
        v_cache=v_cache,
    )
    if case.qk_norm:
        inp.update(
            q_norm_weight=(1 + 0.5 * torch.randn(D, generator=g)).to(dtype),
            k_norm_weight=(1 + 0.5 * torch.randn(D, generator=g)).to(dtype),
            eps=EPS,
        )
    return inp


def silu_inputs(case: SiluCase, seed: int = 0) -> torch.Tensor:
    width = 2 * case.inter + case.row_pad
    return _cols(_randn(_gen(seed), case.tokens, width, dtype=getattr(torch, case.dtype)), 2 * case.inter)


def _clone_caches(inp: dict) -> dict:
    return {**inp, "k_cache": inp["k_cache"].clone(), "v_cache": inp["v_cache"].clone()}


# --------------------------------------------------------------------------------------------------------------------
# References vs the unfused module code
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_reference_matches_module(dtype: str, residual: bool) -> None:
    inp = norm_inputs(NormCase(tokens=5, hidden=96, dtype=dtype, residual=residual))
    module = RMSNorm(96, EPS).to(getattr(torch, dtype))
    module.weight.copy_(inp["weight"])
    # The unfused decoder layer: x = x + attn_out, then post_attention_layernorm(x).
    summed = inp["x"] + inp["residual"] if residual else inp["x"]
    out, new_residual = rms_norm_reference(**inp)
    assert torch.equal(out, module(summed))
    assert torch.equal(new_residual, summed)
    if not residual:
        assert new_residual is inp["x"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_reference_matches_unfused(dtype: str, qk_norm: bool) -> None:
    """Against RMSNorm modules + RotaryTable.apply + a row write, on a two-layer cache (layer 0 untouched)."""
    case = RopeCase(tokens=5, heads=4, kv_heads=2, head_dim=32, dtype=dtype, qk_norm=qk_norm, layout="qkv")
    inp = rope_inputs(case)
    torch_dtype = getattr(torch, dtype)
    rope = RotaryTable(32, 10000.0, None, MAX_POS, CPU)
    k_layers = [torch.randn(4, 8, 2, 32, generator=_gen(1)).to(torch_dtype) for _ in range(2)]
    v_layers = [torch.randn(4, 8, 2, 32, generator=_gen(1)).to(torch_dtype) for _ in range(2)]
    fused_cache = [t.clone() for t in (*k_layers, *v_layers)]

    q, k, v = inp["q"], inp["k"], inp["v"]
    if qk_norm:
        q_norm, k_norm = RMSNorm(32, EPS).to(torch_dtype), RMSNorm(32, EPS).to(torch_dtype)
        q_norm.weight.copy_(inp["q_norm_weight"])
        k_norm.weight.copy_(inp["k_norm_weight"])
        q, k = q_norm(q), k_norm(k)
    q, k = rope.apply(q, inp["positions"]), rope.apply(k, inp["positions"])
    k_layers[1].view(-1, 2, 32).index_copy_(0, inp["rows"], k)
    v_layers[1].view(-1, 2, 32).index_copy_(0, inp["rows"], v)

    fused_q = rope_and_cache_write_reference(**{**inp, "k_cache": fused_cache[1], "v_cache": fused_cache[3]})
    assert fused_q.is_contiguous()
    assert torch.equal(fused_q, q)
    for expected, got in zip((*k_layers, *v_layers), fused_cache):
        assert torch.equal(expected, got)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_silu_and_mul_reference_matches_mlp(dtype: str) -> None:
    gate_up = silu_inputs(SiluCase(tokens=5, inter=96, dtype=dtype))
    gate, up = gate_up.split(96, dim=-1)  # as MLP.forward
    assert torch.equal(silu_and_mul_reference(gate_up), F.silu(gate) * up)


def test_dispatch_on_cpu_uses_torch() -> None:
    norm = norm_inputs(NormCase(tokens=3, hidden=64, dtype="float32", residual=True))
    for got, expected in zip(rms_norm(**norm), rms_norm_reference(**norm)):
        assert torch.equal(got, expected)
    gate_up = silu_inputs(SiluCase(tokens=3, inter=64, dtype="float32"))
    assert torch.equal(silu_and_mul(gate_up), silu_and_mul_reference(gate_up))
    rope = rope_inputs(RopeCase(3, 4, 2, 16, "float32", qk_norm=True, layout="qkv"))
    expected_inp = _clone_caches(rope)
    assert torch.equal(rope_and_cache_write(**rope), rope_and_cache_write_reference(**expected_inp))
    for name in ("k_cache", "v_cache"):
        assert torch.equal(rope[name], expected_inp[name])
    with pytest.raises(ValueError, match="backend"):
        silu_and_mul(gate_up, backend="cuda")


NORM_ERRORS = [
    (lambda d: d.update(x=d["x"][0]), ValueError, "x must be"),
    (lambda d: d.update(weight=d["weight"][:-1]), ValueError, "weight must be"),
    (lambda d: d.update(residual=d["residual"][:-1]), ValueError, "residual shape"),
    (lambda d: d.update(residual=d["residual"].double()), TypeError, "residual dtype"),
    (lambda d: d.update(x=d["x"].int()), TypeError, "x dtype"),
    (lambda d: d.update(weight=d["weight"].to("meta")), ValueError, "weight is on meta"),
]
ROPE_ERRORS = [
    (lambda d: d.update(k=d["k"][:, :, :-2], v=d["v"][:, :, :-2]), ValueError, "q must be"),
    (lambda d: d.update(v=d["v"][:-1]), ValueError, "v shape"),
    (lambda d: d.update(q=d["q"][:, :, :15], k=d["k"][:, :, :15], v=d["v"][:, :, :15]), ValueError, "even head_dim"),
    (lambda d: d.update(k_cache=d["k_cache"].half()), TypeError, "k_cache dtype"),
    (lambda d: d.update(sin=d["sin"][:, :8]), ValueError, "cos and sin"),
    (lambda d: d.update(rows=d["rows"][:-1]), ValueError, "rows must be"),
    (lambda d: d.update(positions=d["positions"].float()), TypeError, "positions must be int"),
    (lambda d: d.update(v_cache=d["v_cache"][:, :, :1]), ValueError, "v_cache must be"),
    (lambda d: d.update(k_cache=d["k_cache"].transpose(0, 1)), ValueError, "contiguous"),
    (lambda d: d.pop("k_norm_weight"), ValueError, "both"),
    (lambda d: d.update(q_norm_weight=d["q_norm_weight"].double()), TypeError, "q_norm_weight dtype"),
]


@pytest.mark.parametrize("mutate, error, match", NORM_ERRORS)
def test_rms_norm_validates(mutate: Callable[[dict], None], error: type[Exception], match: str) -> None:
    inp = norm_inputs(NormCase(tokens=3, hidden=64, dtype="float32", residual=True))
    mutate(inp)
    with pytest.raises(error, match=match):
        rms_norm(**inp)


@pytest.mark.parametrize("mutate, error, match", ROPE_ERRORS)
def test_rope_validates(mutate: Callable[[dict], None], error: type[Exception], match: str) -> None:
    inp = rope_inputs(RopeCase(3, 4, 2, 16, "float32", qk_norm=True, layout="qkv"))
    mutate(inp)
    with pytest.raises(error, match=match):
        rope_and_cache_write(**inp)


def test_silu_and_mul_validates() -> None:
    with pytest.raises(ValueError, match="gate_up must be"):
        silu_and_mul(torch.randn(3, 5))


def test_triton_entry_points_validate_before_launch() -> None:
    """Layout limits of the kernels raise on CPU tensors before any launch."""
    pytest.importorskip("triton")
    from specpilot.kernels.fused import (
        MAX_NORM_DIM,
        rms_norm_triton,
        rope_and_cache_write_triton,
        silu_and_mul_triton,
    )

    with pytest.raises(ValueError, match="H <="):
        rms_norm_triton(torch.randn(2, 2 * MAX_NORM_DIM), torch.randn(2 * MAX_NORM_DIM), EPS)
    with pytest.raises(ValueError, match="unit-stride"):
        rms_norm_triton(torch.randn(8, 2).t(), torch.randn(8), EPS)
    with pytest.raises(ValueError, match="unit-stride"):
        silu_and_mul_triton(torch.randn(8, 2).t())
    rope = rope_inputs(RopeCase(2, 4, 2, 16, "float32", qk_norm=False, layout="qkv"))
    with pytest.raises(ValueError, match="unit-stride"):
        rope_and_cache_write_triton(**{**rope, "q": rope["q"].transpose(1, 2).contiguous().transpose(1, 2)})


# --------------------------------------------------------------------------------------------------------------------
# Triton (interpreter, subprocess) vs reference
# --------------------------------------------------------------------------------------------------------------------

TOKENS = (1, 5, 17)
DTYPES = ("float32", "bfloat16")
NORM_CASES = [
    NormCase(t, h, dt, res) for t in TOKENS for h in (64, 96) for dt in DTYPES for res in (False, True)
] + [
    NormCase(5, 96, "bfloat16", True, row_pad=32),
    NormCase(5, 64, "float32", False, row_pad=8),
    NormCase(5, 96, "bfloat16", True, weight_dtype="float32"),
]
ROPE_CASES = [
    RopeCase(t, hq, hkv, d, dt, norm, layout)
    for t in TOKENS
    for dt in DTYPES
    for hq, hkv, d, norm, layout in (
        (4, 2, 16, False, "qkv"),
        (4, 2, 32, True, "qkv"),
        (4, 4, 24, True, "strided"),  # half = 12: a masked, non-power-of-two half
        (0, 2, 32, True, "qkv"),  # k/v only, as a context write has
    )
]
SILU_CASES = [SiluCase(t, i, dt) for t in TOKENS for i in (64, 96, 1500) for dt in DTYPES] + [
    SiluCase(5, 1500, "bfloat16", row_pad=24)
]
TOL = {"float32": 1e-5, "bfloat16": 1e-2}
# bf16 results round at the same points as the references; only fp32 last-bit differences (rsqrt, sum order) may
# flip a rounding.
MAX_BF16_MISMATCH = 0.02


@contextlib.contextmanager
def _poisoned_allocations() -> Iterator[None]:
    """Float tensors from torch.empty / empty_like start as NaN, so elements a kernel leaves unwritten show."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = lambda *a, **kw: poison(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poison(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def _compare(got: torch.Tensor, expected: torch.Tensor, dtype: str) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape, expected.shape)
    torch.testing.assert_close(got, expected, atol=TOL[dtype], rtol=TOL[dtype])
    if dtype == "bfloat16" and expected.dtype == torch.bfloat16 and expected.numel():
        mismatch = (got != expected).float().mean().item()
        assert mismatch <= MAX_BF16_MISMATCH, f"{mismatch:.1%} of bf16 elements differ from the reference"


def _run_norm(case: NormCase) -> None:
    from specpilot.kernels.fused import rms_norm_triton

    inp = norm_inputs(case)
    expected, expected_res = rms_norm_reference(**inp)
    with _poisoned_allocations():
        got, got_res = rms_norm_triton(**inp)
    _compare(got, expected, case.dtype)
    assert torch.equal(got_res, expected_res), "residual sum differs"


def _run_rope(case: RopeCase) -> None:
    from specpilot.kernels.fused import rope_and_cache_write_triton

    inp = rope_inputs(case)
    expected_inp = _clone_caches(inp)
    before = {n: inp[n].clone() for n in ("q", "k", "v")}
    expected_q = rope_and_cache_write_reference(**expected_inp)
    with _poisoned_allocations():
        got_q = rope_and_cache_write_triton(**inp)
    _compare(got_q, expected_q, case.dtype)
    written = torch.zeros(inp["k_cache"][:, :, 0, 0].numel(), dtype=torch.bool)
    written[inp["rows"]] = True
    for name in ("k_cache", "v_cache"):
        got_rows, expected_rows = (c.view(-1, *c.shape[2:]) for c in (inp[name], expected_inp[name]))
        _compare(got_rows[written], expected_rows[written], case.dtype)
        assert torch.equal(got_rows[~written], expected_rows[~written]), f"{name}: rows not listed were written"
    assert torch.equal(inp["v_cache"], expected_inp["v_cache"]), "v is copied, not recomputed: it must match exactly"
    for name, t in before.items():
        assert torch.equal(inp[name], t), f"{name} was modified"


def _run_silu(case: SiluCase) -> None:
    from specpilot.kernels.fused import silu_and_mul_triton

    gate_up = silu_inputs(case)
    with _poisoned_allocations():
        got = silu_and_mul_triton(gate_up)
    _compare(got, silu_and_mul_reference(gate_up), case.dtype)


def _triton_failures() -> dict[str, str]:
    """Runs in the interpreter subprocess: per case, the failure message or "" when it passes."""
    patch_bf16_cast()
    failures = {}
    for run, cases in ((_run_norm, NORM_CASES), (_run_rope, ROPE_CASES), (_run_silu, SILU_CASES)):
        for case in cases:
            try:
                run(case)
                failures[case.name] = ""
            except AssertionError as exc:
                failures[case.name] = str(exc)[-2000:] or "assertion failed"
    return failures


triton_failures = interpreter_fixture(__file__)


@pytest.mark.parametrize("name", [c.name for c in (*NORM_CASES, *ROPE_CASES, *SILU_CASES)])
def test_triton_matches_reference(triton_failures: dict[str, str], name: str) -> None:
    assert triton_failures[name] == "", triton_failures[name]


def test_case_names_are_unique() -> None:
    names = [c.name for c in (*NORM_CASES, *ROPE_CASES, *SILU_CASES)]
    assert len(names) == len(set(names))


if __name__ == "__main__":
    print(json.dumps(_triton_failures()))
