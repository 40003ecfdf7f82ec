"""B12's size on real and synthetic weights (any device; the codec runs in torch): bits a weight and the
escape rate per source — the embedded model's matrices as the engine holds them in bf16, the shipped DFlash
drafter (a bf16 checkpoint), Gaussian and heavy-tailed (Student-t, row scales lognormal) matrices of
Llama-3.1-8B's projection shapes — each tensor's round trip checked. Prints a table, writes JSON.

    python benchmarks/b12_stats.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import out_dir, write_json  # noqa: E402

from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.drafters import EMBEDDED_DRAFTER  # noqa: E402
from specpilot.formats.b12 import B12Error, decode, encode  # noqa: E402
from specpilot.models.checkpoint import load_checkpoint  # noqa: E402


def matrices_of(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to(torch.bfloat16) for name, t in tensors.items() if t.dim() == 2}


def synthetic() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shapes = {"qkv 6144x4096": (6144, 4096), "down 4096x14336": (4096, 14336)}
    out: dict[str, dict[str, torch.Tensor]] = {"gaussian": {}, "student-t 3, lognormal rows": {}}
    for name, (n, k) in shapes.items():
        out["gaussian"][name] = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        t = torch.distributions.StudentT(3.0).sample((n, k)) * torch.exp(torch.randn(n, 1, generator=g))
        out["student-t 3, lognormal rows"][name] = (t * 0.02).to(torch.bfloat16)
    return out


def source_stats(tensors: dict[str, torch.Tensor]) -> dict:
    weights = bits = escapes = 0
    kept: list[str] = []
    worst = 0.0
    for name, t in tensors.items():
        try:
            b = encode(t, name)
        except B12Error:
            kept.append(name)
            continue
        assert torch.equal(decode(b).view(torch.int16), t.view(torch.int16)), name
        s = b.stats()
        weights += s["weights"]
        bits += s["bits_per_weight"] * s["weights"]
        escapes += s["escapes"]
        worst = max(worst, s["escape_rate"])
    return {"tensors": len(tensors), "weights": weights, "bits_per_weight": bits / max(weights, 1),
            "escape_rate": escapes / max(weights, 1), "worst_tensor_escape_rate": worst, "kept_bf16": kept}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sources = {"embedded SmolLM2-135M (bf16 cast)": matrices_of(load_checkpoint(None).state_dict),
               "shipped DFlash drafter (bf16 checkpoint)":
                   matrices_of(load_file(str(Path(EMBEDDED_DRAFTER) / "model.safetensors"))),
               **synthetic()}
    report = {"provenance": collect(None, "bfloat16"), "command": " ".join(sys.argv), "sources": {}}
    print(f"{'source':44s} {'tensors':>7s} {'weights':>12s} {'bits/w':>7s} {'escapes':>9s} {'worst':>9s}")
    for name, tensors in sources.items():
        s = report["sources"][name] = source_stats(tensors)
        print(f"{name:44s} {s['tensors']:7d} {s['weights']:12d} {s['bits_per_weight']:7.3f} "
              f"{s['escape_rate']:9.2e} {s['worst_tensor_escape_rate']:9.2e}"
              + (f"  kept bf16: {s['kept_bf16']}" if s["kept_bf16"] else ""))
    write_json(out_dir(args.out) / "b12_stats.json", report)


if __name__ == "__main__":
    main()
