"""CUDA: where the B12 kernel's packed PTX decode and its plain one differ: the GEMM of one-hot rows (y = w.T,
exactly) for each case of tests/test_b12_gemm.py's weights, packed and plain against the decoded matrix.

    python benchmarks/b12_decode_probe.py     (CUDA; the device: PYTHONPATH=$PWD, nothing ferried)
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_b12_gemm import weights  # noqa: E402

from specpilot.formats.b12 import decode, encode  # noqa: E402
from specpilot.kernels.b12_gemm import b12_gemm  # noqa: E402

for n, k, escapes in [(1000, 600, "dense"), (1000, 600, "few"), (1000, 512, "dense"), (1024, 600, "few"),
                      (1024, 600, "none"), (1000, 768, "dense"), (64, 600, "dense"), (64, 130, "dense")]:
    g = torch.Generator().manual_seed(0)
    p = encode(weights(n, k, escapes, g).cuda())
    ref = decode(p).view(torch.int16).T
    finite_rows = torch.isfinite(decode(p)).all(dim=1)
    x = torch.eye(k, dtype=torch.bfloat16, device="cuda")
    for packed in (True, False):
        got = b12_gemm(x, p, packed=packed).view(torch.int16)
        bad = (got != ref) & ~(torch.isnan(got.view(torch.bfloat16)) & torch.isnan(ref.view(torch.bfloat16)))
        bad &= finite_rows[None, :]  # a row holding inf or NaN gives NaN everywhere: 0 * inf in the sum
        where = bad.nonzero().tolist()[:8]
        print(f"n={n} k={k} {escapes:5s} packed={packed!s:5s} escapes/block<= {p.max_block_escapes} mismatches "
              f"{int(bad.sum())} at (col k, row n) {where} "
              f"ref {[hex(int(ref[i, j]) & 0xFFFF) for i, j in where[:4]]} got {[hex(int(got[i, j]) & 0xFFFF) for i, j in where[:4]]}")
