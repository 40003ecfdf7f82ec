"""H200: decode and verify step time of our engine on Llama-3.1-8B shapes (synthetic bf16 weights)
against the weight-read floor, with and without CUDA graphs. Checks correctness in the same run.

    python benchmarks/gpu_engine.py [--out DIR] [--context 512]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    LLAMA31_8B,
    copy_bandwidth,
    out_dir,
    synthetic_model,
    time_cuda,
    weight_bytes_per_step,
    write_json,
)

from specpilot.kernels.slot_attention import (  # noqa: E402
    slot_attention_reference,
    slot_attention_triton,
)
from specpilot.models.runner import ModelRunner  # noqa: E402
from specpilot.state.batch import ForwardBatch  # noqa: E402
from specpilot.state.cache import KVCache  # noqa: E402

BATCHES = (1, 8, 32)
VERIFY_Q = 16


def check_attention(device: torch.device) -> float:
    """Triton attention vs the torch reference at the real head shape, ragged verify-like batch."""
    g = torch.Generator(device="cpu").manual_seed(0)
    slots, L, kvh, hq, d = 6, 700, 8, 32, 128
    kc = torch.randn(slots, L, kvh, d, generator=g).to(device, torch.bfloat16)
    vc = torch.randn(slots, L, kvh, d, generator=g).to(device, torch.bfloat16)
    q_lens = [16, 1, 16, 5]
    kv_lens = [600, 33, 16, 690]
    T = sum(q_lens)
    q = torch.randn(T, hq, d, generator=g).to(device, torch.bfloat16)
    args = [torch.tensor(v, dtype=torch.int32, device=device) for v in
            ([4, 0, 2, 5], [0, 16, 17, 33], q_lens, kv_lens)]
    ref = slot_attention_reference(q, kc, vc, *args, scale=d ** -0.5)
    worst = 0.0
    for splits in (1, 4):
        out = slot_attention_triton(q, kc, vc, *args, scale=d ** -0.5, max_q_len=16, num_kv_splits=splits)
        worst = max(worst, float((out.float() - ref.float()).norm() / ref.float().norm()))
    return worst


def check_fused(device: torch.device) -> dict[str, float]:
    """Each fused Triton kernel and the skinny GEMM against its torch reference at real shapes (bf16)."""
    from specpilot.kernels import fused
    from specpilot.kernels.skinny_gemm import skinny_gemm, skinny_gemm_reference

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    T, H, hq, hkv, d, bf = 16, 4096, 32, 8, 128, torch.bfloat16
    x, res = (torch.randn(T, H, device=device, dtype=bf) for _ in range(2))
    w = torch.randn(H, device=device, dtype=bf)
    errs = {"rms_norm": max(rel(a, b) for a, b in zip(fused.rms_norm(x, w, 1e-5, res, backend="triton"),
                                                       fused.rms_norm(x, w, 1e-5, res, backend="torch")))}
    gu = torch.randn(T, 2 * 14336, device=device, dtype=bf)
    errs["silu_and_mul"] = rel(fused.silu_and_mul(gu, backend="triton"), fused.silu_and_mul(gu, backend="torch"))
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device=device, dtype=bf)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(T, hq, d), k.view(T, hkv, d), v.view(T, hkv, d)
    pos = torch.randint(0, 500, (T,), device=device)
    rows = torch.randperm(4 * 512, device=device)[:T]
    cos, sin = torch.randn(512, d, device=device), torch.randn(512, d, device=device)
    outs = []
    for backend in ("triton", "torch"):
        kc, vc = (torch.zeros(4, 512, hkv, d, device=device, dtype=bf) for _ in range(2))
        outs.append((fused.rope_and_cache_write(q, k, v, cos, sin, pos, rows, kc, vc, backend=backend), kc, vc))
    errs["rope_and_cache_write"] = max(rel(a, b) for a, b in zip(*outs))
    for m in (1, 16):
        xm, wm = torch.randn(m, 4096, device=device, dtype=bf), torch.randn(6144, 4096, device=device, dtype=bf)
        errs[f"skinny_gemm_m{m}"] = rel(skinny_gemm(xm, wm), skinny_gemm_reference(xm, wm))
    return errs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens already in each request's cache")
    args = ap.parse_args()
    device = torch.device("cuda")
    out = out_dir(args.out)

    attn_err = check_attention(device)
    fused_errs = check_fused(device)
    bw = copy_bandwidth(device)
    cfg = LLAMA31_8B
    model = synthetic_model(cfg, device, torch.bfloat16)
    max_len = args.context + 64
    model.setup_rope(max_len)
    cache = KVCache(cfg.num_layers, max(BATCHES), max_len, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, device)
    runner = ModelRunner(model, cache, device)
    floor_ms = weight_bytes_per_step(model) / bw * 1e3

    rng = random.Random(0)
    slots = [cache.allocate() for _ in range(max(BATCHES))]
    for s in slots:  # prefill every slot with a random prompt (eager, ragged path)
        runner.forward([s], [0], [[rng.randrange(cfg.vocab_size) for _ in range(args.context)]], last_only=True)
    runner.capture(q_lens=(1, VERIFY_Q), batch_sizes=BATCHES)

    rows = []
    for b in BATCHES:
        for q in (1, VERIFY_Q):
            toks = [[rng.randrange(cfg.vocab_size) for _ in range(q)] for _ in range(b)]
            starts = [args.context] * b
            graph_out = runner.forward(slots[:b], starts, toks).logits.clone()
            g = runner.graphs[(q, b)]
            graph_ms = time_cuda(g.graph.replay)
            step_ms = time_cuda(lambda: runner.forward(slots[:b], starts, toks))  # host prep included
            batch = ForwardBatch.build(slots[:b], starts, toks, max_len, device)
            with torch.inference_mode():
                eager_logits = runner.run(batch).logits
                eager_ms = time_cuda(lambda: runner.run(batch), iters=10)
            agree = float((graph_out.argmax(-1) == eager_logits.argmax(-1)).float().mean())
            logits_err = float((graph_out - eager_logits).norm() / eager_logits.norm())
            rows.append({"batch": b, "q": q, "graph_ms": graph_ms, "step_ms": step_ms, "eager_ms": eager_ms,
                         "vs_floor": graph_ms / floor_ms, "argmax_agree_graph_vs_eager": agree,
                         "logits_rel_err_graph_vs_eager": logits_err})
    decode1 = next(r for r in rows if r["batch"] == 1 and r["q"] == 1)["graph_ms"]
    verify1 = next(r for r in rows if r["batch"] == 1 and r["q"] == VERIFY_Q)["graph_ms"]
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "context": args.context,
        "copy_bandwidth_TBps": bw / 1e12, "weight_GB": weight_bytes_per_step(model) / 1e9, "floor_ms": floor_ms,
        "attention_rel_err_triton_vs_torch": attn_err, "fused_rel_err_triton_vs_torch": fused_errs, "rows": rows,
        "decode_b1_vs_floor": decode1 / floor_ms, "verify16_vs_decode_b1": verify1 / decode1,
    }
    write_json(out / "gpu_engine.json", result)
    print(f"\nGPU {result['gpu']}  copy {bw / 1e12:.2f} TB/s  weights {result['weight_GB']:.2f} GB  "
          f"floor {floor_ms:.3f} ms  attention rel err {attn_err:.2e}")
    print("fused kernels rel err vs torch: " + ", ".join(f"{k} {v:.1e}" for k, v in fused_errs.items()))
    print(f"{'B':>3} {'q':>3} {'graph ms':>9} {'step ms':>8} {'eager ms':>9} {'x floor':>8} {'agree':>6} {'logit err':>9}")
    for r in rows:
        print(f"{r['batch']:>3} {r['q']:>3} {r['graph_ms']:>9.3f} {r['step_ms']:>8.3f} {r['eager_ms']:>9.3f} "
              f"{r['vs_floor']:>8.2f} {r['argmax_agree_graph_vs_eager']:>6.3f} {r['logits_rel_err_graph_vs_eager']:>9.1e}")
    print(f"decode B=1 / floor = {result['decode_b1_vs_floor']:.3f} (goal <= 1.45); "
          f"verify-16 / decode at B=1 = {result['verify16_vs_decode_b1']:.3f} (goal <= 1.15)")


if __name__ == "__main__":
    main()
