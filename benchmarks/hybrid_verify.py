"""One Gated DeltaNet layer's verify of a draft, the tree form (models/gated_deltanet.py: every node in one
pass, one state committed) against the per-node-snapshot baseline (SGLang's and vLLM's way), synthetic weights:
a 16-node tree and a 16-token chain, time per verify (median and range over interleaved repeats) and the extra
memory a request holds between its verify and its commit (the tree form's per-node inputs against one state per
node). Then the delta rule alone over many requests at once (kernels/gated_delta.py): `--batch` requests' trees
and chains verified, and `--prefill` tokens prefilled as one request and spread over `--batch`. On CUDA every
tree form and rule row runs twice, as plain torch and as the Triton kernel; on CPU, torch only. Checks that the
forms give the same outputs. Shapes: Qwen3.5-style at `--scale full` (hidden 4096, 16 key heads x 128, 32 value
heads x 128), or small ones for a CPU first look.

    python benchmarks/hybrid_verify.py [--device cpu|cuda] [--scale small|full] [--repeats 5] [--batch 32]
        [--prefill 2048] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import timed_ms  # noqa: E402

from specpilot.bench.provenance import collect  # noqa: E402
from specpilot.kernels.gated_delta import ancestor_bits, gated_delta_prefill, gated_delta_verify  # noqa: E402
from specpilot.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig, RecurrentState  # noqa: E402

SCALES = {"small": GatedDeltaNetConfig(256, 2, 4, 64, 64), "full": GatedDeltaNetConfig(4096, 16, 32, 128, 128)}
TREE = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 4, 4, 5, 6, 7, 9, 10]  # 16 nodes, depth up to 5
CHAIN = list(range(-1, 15))


def state_bytes(s: RecurrentState) -> int:
    return s.conv.numel() * s.conv.element_size() + s.ssm.numel() * s.ssm.element_size()


def timings(methods: dict[str, Callable[[], object]], repeats: int, device: torch.device) -> dict[str, dict]:
    """Each method's ms per call, interleaved over `repeats` rounds: median, min, max."""
    ms: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            ms[name].append(timed_ms(fn, device))
    return {name: {"median": statistics.median(v), "min": min(v), "max": max(v)} for name, v in ms.items()}


def agree(name: str, results: dict[str, tuple[torch.Tensor, ...]]) -> float:
    """The largest difference of any method's outputs from the first's, relative to their magnitude (at least 1);
    exits if the forms disagree."""
    first, *others = results.values()
    worst = max((float((a - b).abs().max()) / max(1.0, float(b.abs().max()))
                 for other in others for a, b in zip(other, first)), default=0.0)
    if worst > 1e-3:
        raise SystemExit(f"{name}: the forms disagree ({worst:.2e})")
    return worst


def show(name: str, run: dict) -> None:
    rows = ", ".join(f"{method} {t['median']:.3f}" for method, t in run["ms"].items())
    print(f"{name}: {rows} ms (max relative difference {run['max_rel_diff']:.1e})")


def layer_runs(layer: GatedDeltaNet, state: RecurrentState, backends: list[str], repeats: int,
               device: torch.device) -> dict[str, dict]:
    """One request's 16-node tree and 16-token chain through the whole layer: the tree form per backend against
    the per-node snapshots, and the memory each holds until the commit."""
    runs = {}
    for name, parents in (("tree-16", TREE), ("chain-16", CHAIN)):
        x = torch.randn(len(parents), layer.cfg.hidden_size, device=device) * 0.5

        def tree_form(backend: str, x: torch.Tensor = x, parents: list[int] = parents) -> tuple:
            layer.backend = backend
            return layer.verify_tree(x, state, parents)

        with torch.no_grad():
            outs = {f"tree {b}": tree_form(b) for b in backends}
            snap_out, snaps = layer.verify_snapshots(x, state, parents)
            diff = agree(name, {"snapshots": (snap_out,)} | {k: (out,) for k, (out, _) in outs.items()})
            methods: dict[str, Callable[[], object]] = {f"tree {b}": (lambda b=b: tree_form(b)) for b in backends}
            methods["snapshots"] = lambda x=x, parents=parents: layer.verify_snapshots(x, state, parents)
            ms = timings(methods, repeats, device)
        tree = next(iter(outs.values()))[1]
        extra = {"tree": sum(t.numel() * t.element_size() for t in vars(tree).values()),
                 "snapshots": sum(state_bytes(s) for s in snaps)}
        run = runs[name] = {"ms": ms, "max_rel_diff": diff, "extra_bytes_per_request": extra,
                            "state_bytes": state_bytes(state)}
        show(name, run)
        print(f"  extra memory: tree {extra['tree'] / 2**10:.1f} KiB, snapshots {extra['snapshots'] / 2**10:.1f} KiB "
              f"({extra['snapshots'] / state_bytes(state):.1f} states)")
    return runs


def rule_inputs(t: int, cfg: GatedDeltaNetConfig, device: torch.device) -> tuple[torch.Tensor, ...]:
    """q, k, v, g, beta of t tokens as the layer hands them to the rule."""
    hk, hv, dk, dv = cfg.num_key_heads, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim
    q = F.normalize(torch.randn(t, hk, dk, device=device), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(t, hk, dk, device=device), dim=-1)
    v = torch.randn(t, hv, dv, device=device)
    g = -F.softplus(torch.randn(t, hv, device=device)) * 0.5
    return q, k, v, g, torch.sigmoid(torch.randn(t, hv, device=device))


def rule_runs(cfg: GatedDeltaNetConfig, batch: int, prefill: int, backends: list[str], repeats: int,
              device: torch.device) -> dict[str, dict]:
    """The delta rule alone over many requests' spans per backend: verifies of `batch` trees and chains of 16,
    prefills of `prefill` tokens as one request and spread over `batch`."""
    table = torch.randn(batch + 1, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim, device=device) * 0.1
    runs = {}
    for name, parents in ((f"verify-{batch}x-tree-16", TREE), (f"verify-{batch}x-chain-16", CHAIN)):
        n = len(parents)
        spans = (torch.arange(1, batch + 1, device=device), torch.arange(0, batch * n, n, device=device),
                 torch.full((batch,), n, device=device))
        bits = ancestor_bits(parents).repeat(batch).to(device) if parents is TREE else None
        inputs = rule_inputs(batch * n, cfg, device)

        def verify(backend: str, inputs: tuple = inputs, spans: tuple = spans, bits: torch.Tensor | None = bits,
                   n: int = n) -> tuple[torch.Tensor, ...]:
            return gated_delta_verify(*inputs, table, *spans, bits, n, backend)

        diff = agree(name, {b: verify(b) for b in backends})
        runs[name] = {"ms": timings({b: (lambda b=b: verify(b)) for b in backends}, repeats, device),
                      "max_rel_diff": diff}
        show(name, runs[name])
    for requests in (1, batch):
        n = prefill // requests
        name = f"prefill-{requests}x{n}"
        spans = (torch.arange(1, requests + 1, device=device), torch.arange(0, requests * n, n, device=device),
                 torch.full((requests,), n, device=device))
        inputs = rule_inputs(requests * n, cfg, device)

        def run_prefill(backend: str, states: torch.Tensor, inputs: tuple = inputs, spans: tuple = spans,
                        n: int = n) -> tuple[torch.Tensor, torch.Tensor]:
            return gated_delta_prefill(*inputs, states, *spans, n, backend), states

        diff = agree(name, {b: run_prefill(b, table.clone()) for b in backends})
        # timed on one table the calls keep moving on: a state stays bounded however many spans it absorbs
        runs[name] = {"ms": timings({b: (lambda b=b: run_prefill(b, table)) for b in backends}, repeats, device),
                      "max_rel_diff": diff}
        show(name, runs[name])
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--scale", choices=list(SCALES), default="small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32, help="requests of the rule's batched rows")
    ap.add_argument("--prefill", type=int, default=2048, help="tokens of the rule's prefill rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device, cfg = torch.device(args.device), SCALES[args.scale]
    backends = ["torch", "triton"] if device.type == "cuda" else ["torch"]
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02)
        state = RecurrentState(torch.randn(cfg.conv_kernel - 1, cfg.conv_dim, device=device) * 0.1,
                               torch.randn(cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim, device=device))
    report = {"provenance": collect(device, "float32"), "scale": args.scale, "config": vars(cfg),
              "batch": args.batch, "prefill": args.prefill,
              "runs": layer_runs(layer, state, backends, args.repeats, device)
              | rule_runs(cfg, args.batch, args.prefill, backends, args.repeats, device)}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"hybrid_verify_{args.scale}_{device.type}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
