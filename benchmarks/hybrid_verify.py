"""One Gated DeltaNet layer's verify of a draft, the tree form (models/gated_deltanet.py: every node in one
pass, one state committed) against the per-node-snapshot baseline (SGLang's and vLLM's way), synthetic weights:
a 16-node tree and a 16-token chain, time per verify (median and range over interleaved repeats) and the extra
memory a request holds between its verify and its commit (the tree form's per-node inputs against one state per
node). Checks the two give the same outputs. Shapes: Qwen3.5-style at `--scale full` (hidden 4096, 16 key
heads x 128, 32 value heads x 128), or small ones for a CPU first look.

    python benchmarks/hybrid_verify.py [--device cpu|cuda] [--scale small|full] [--repeats 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import timed_ms  # noqa: E402

from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig, RecurrentState  # noqa: E402

SCALES = {"small": GatedDeltaNetConfig(256, 2, 4, 64, 64), "full": GatedDeltaNetConfig(4096, 16, 32, 128, 128)}
TREE = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 4, 4, 5, 6, 7, 9, 10]  # 16 nodes, depth up to 5
CHAIN = list(range(-1, 15))


def state_bytes(s: RecurrentState) -> int:
    return s.conv.numel() * s.conv.element_size() + s.ssm.numel() * s.ssm.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--scale", choices=list(SCALES), default="small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device, cfg = torch.device(args.device), SCALES[args.scale]
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02)
        state = RecurrentState(torch.randn(cfg.conv_kernel - 1, cfg.conv_dim, device=device) * 0.1,
                               torch.randn(cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim, device=device))
    report = {"provenance": collect(device, "float32"), "scale": args.scale, "config": vars(cfg), "runs": {}}
    for name, parents in (("tree-16", TREE), ("chain-16", CHAIN)):
        x = torch.randn(len(parents), cfg.hidden_size, device=device) * 0.5
        with torch.no_grad():
            tree_out, tree = layer.verify_tree(x, state, parents)
            snap_out, snaps = layer.verify_snapshots(x, state, parents)
            if not torch.allclose(tree_out, snap_out, rtol=1e-3, atol=1e-4):
                raise SystemExit(f"{name}: the tree form and the snapshots disagree")
            ms: dict[str, list[float]] = {"tree": [], "snapshots": []}
            for _ in range(args.repeats):
                ms["tree"].append(timed_ms(lambda: layer.verify_tree(x, state, parents), device))
                ms["snapshots"].append(timed_ms(lambda: layer.verify_snapshots(x, state, parents), device))
        extra = {"tree": sum(t.numel() * t.element_size() for t in vars(tree).values()),
                 "snapshots": sum(state_bytes(s) for s in snaps)}
        run = report["runs"][name] = {
            "ms": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in ms.items()},
            "extra_bytes_per_request": extra, "state_bytes": state_bytes(state)}
        print(f"{name}: tree {run['ms']['tree']['median']:.3f} ms, snapshots {run['ms']['snapshots']['median']:.3f} "
              f"ms; extra memory: tree {extra['tree'] / 2**10:.1f} KiB, snapshots {extra['snapshots'] / 2**10:.1f} "
              f"KiB ({extra['snapshots'] / state_bytes(state):.1f} states)")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"hybrid_verify_{args.scale}_{device.type}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
