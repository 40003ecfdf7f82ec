"""Batch invariance of the GEMM and attention kernels (tests/invariance_cases.py): every scenario's rows are
bitwise equal to the one-request baseline, under the CPU interpreter and, where there is one, on CUDA. The
invariant attention is also checked against the plain-torch reference for accuracy."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import pytest
import torch
from invariance_cases import attention_report, gemm_report
from triton_interpret import interpreter_fixture, patch_dot, share

DTYPES = ("float32", "bfloat16")


def _accuracy(device: str, dtypes: Sequence[str]) -> dict[str, float]:
    """Max |invariant - reference| over a mixed batch (decode, verify, prefill rows; GQA 3), per dtype."""
    from specpilot.kernels.slot_attention import slot_attention_invariant, slot_attention_reference

    errors = {}
    for dtype in dtypes:
        g = torch.Generator().manual_seed(5)
        dt = getattr(torch, dtype)
        k = torch.randn(3, 420, 2, 64, generator=g).to(dt).to(device)
        v = torch.randn(3, 420, 2, 64, generator=g).to(dt).to(device)
        q_lens, kv_lens = [1, 16, 90], [400, 300, 90]
        q = torch.randn(sum(q_lens), 6, 64, generator=g).to(dt).to(device)
        meta = {name: torch.tensor(x, dtype=torch.int32, device=device) for name, x in
                (("slot_ids", [2, 0, 1]), ("q_starts", [0, 1, 17]), ("q_lens", q_lens), ("kv_lens", kv_lens))}
        positions = torch.tensor([399, *range(284, 300), *range(90)], device=device)
        scale = 1 / math.sqrt(64)
        ref = slot_attention_reference(q.cpu(), k.cpu(), v.cpu(), **{n: t.cpu() for n, t in meta.items()}, scale=scale)
        got = slot_attention_invariant(q, k, v, **meta, positions=positions, scale=scale)
        errors[dtype] = (got.float().cpu() - ref.float()).abs().max().item()
    return errors


def _reports(device: str, dtypes: Sequence[str] = DTYPES) -> dict:
    out = {"accuracy": _accuracy(device, dtypes)}
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        out[f"attention {dtype}"] = attention_report(device, dt)
        out[f"gemm {dtype}"] = gemm_report(device, dt, pinned=device != "cuda")
    return out


triton_results = interpreter_fixture(__file__, parts=len(DTYPES))  # a dtype each


def _check(results: dict) -> None:
    assert results.pop("accuracy")["float32"] < 1e-4
    for name, report in results.items():
        assert all(v == 0 for v in report.values()), f"{name}: differing elements {report}"


def test_invariant_kernels_under_the_interpreter(triton_results: dict) -> None:
    _check(dict(triton_results))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_invariant_kernels_on_cuda() -> None:
    results = _reports("cuda")
    assert results["accuracy"]["bfloat16"] < 3e-2
    _check(results)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_tiles_do_not_change_a_row(dtype: str) -> None:
    """The invariant GEMM's tiles by M (decode, verify and prefill sizes) and its x-row padding (16..256
    rows per program) never reach a row's sums: every choice gives the decode tiles' rows."""
    from specpilot.kernels.skinny_gemm import invariant_config, invariant_gemm

    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 4096, generator=g).to(getattr(torch, dtype)).cuda()
    for n in (1024, 6144, 12288):  # each width class of the tile table
        w = torch.randn(n, 4096, generator=g).to(x.dtype).cuda()
        decode, _ = invariant_config(1, *w.shape)
        base = invariant_gemm(x, w, block_m=16, config=decode)
        for m in (1, 64, 128, 256, 384, 512, 4096):
            config, block_m = invariant_config(m, *w.shape)
            for rows in (block_m, 16, 64, 256):
                assert torch.equal(invariant_gemm(x, w, block_m=rows, config=config), base), (n, m, rows)
        assert torch.equal(invariant_gemm(x, w), base)

if __name__ == "__main__":
    patch_dot()
    print(json.dumps(_reports("cpu", share(DTYPES))))
