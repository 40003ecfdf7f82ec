"""H200: decode and verify step time of our engine on Llama-3.1-8B shapes (synthetic bf16 weights)
against the weight-read floor, with and without CUDA graphs. Checks correctness in the same run.

Today's fastest kernels per pass, the batch-invariant ones and the invariant path with the weights held as B12
(the b12 mechanism: a second copy of the model, whose logits must be bitwise the invariant ones) are timed in one
run, interleaved.

With --tuned-tiles the GEMMs' decode tiles are first tuned on this device for the model's weight shapes
(engine/gemm_tiles.py, both kernels), and the invariant and B12 sets also run on them ("invariant_tuned",
"b12_tuned"), their logits checked bitwise against the untuned invariant ones.

    python benchmarks/gpu_engine.py [--out DIR] [--context 512] [--repeats 3] [--tuned-tiles]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    LLAMA31_8B,
    copy_bandwidth,
    read_bandwidth,
    out_dir,
    synthetic_model,
    time_interleaved,
    weight_bytes_per_step,
    write_json,
)

from specpilot.engine.gemm_tiles import tune  # noqa: E402
from specpilot.models.linear import iter_linears, set_tile_table, to_b12, weight_bytes  # noqa: E402
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


# the fastest kernel per pass (cuBLAS, skinny GEMM, batch-sized key splits), and the batch-invariant ones
KERNELS = ("fastest", "invariant", "b12")
PREFILL = (8, 1024)  # prompts x tokens of the prefill timing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens already in each request's cache")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timings of each kernel set")
    ap.add_argument("--tuned-tiles", action="store_true", help="also time the invariant sets on tuned GEMM tiles")
    args = ap.parse_args()
    device = torch.device("cuda")
    out = out_dir(args.out)

    attn_err = check_attention(device)
    fused_errs = check_fused(device)
    bw, read_bw = copy_bandwidth(device), read_bandwidth(device)
    cfg = LLAMA31_8B
    model = synthetic_model(cfg, device, torch.bfloat16)
    max_len = max(args.context + 64, PREFILL[1])
    model.setup_rope(max_len)
    cache = KVCache.whole_slots(cfg.num_layers, max(BATCHES), max_len, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16,
                                device)
    floor_ms = weight_bytes_per_step(model) / bw * 1e3
    read_floor_ms = weight_bytes_per_step(model) / read_bw * 1e3
    b12_model = synthetic_model(cfg, device, torch.bfloat16)  # the same seed: the same weights
    b12_model.setup_rope(max_len)
    b12_report = to_b12(b12_model)
    torch.cuda.empty_cache()
    models = {"fastest": model, "invariant": model, "b12": b12_model}
    tiles = dict.fromkeys(models)
    if args.tuned_tiles:
        table = tune({(lin.out_features, lin.in_features) for _, lin in iter_linears(model)})
        models |= {"invariant_tuned": model, "b12_tuned": b12_model}
        tiles |= {"invariant_tuned": table, "b12_tuned": table}
    kernel_sets = tuple(models)

    def use(kernels: str) -> None:  # the kernels in effect for a set: captured with its graphs, set for eager runs
        models[kernels].set_batch_invariant(kernels != "fastest")
        set_tile_table(models[kernels], tiles[kernels])

    runners = {k: ModelRunner(models[k], cache, device) for k in kernel_sets}

    rng = random.Random(0)
    slots = [cache.allocate() for _ in range(max(BATCHES))]
    prompts = {s: [rng.randrange(cfg.vocab_size) for _ in range(args.context)] for s in slots}
    b12_model.set_batch_invariant(True)
    for kernels, runner in runners.items():  # graphs keep the kernels in effect when captured
        use(kernels)
        runner.capture(q_lens=(1, VERIFY_Q), batch_sizes=BATCHES)
    use("invariant")
    for s in slots:  # prefill every slot with a random prompt (eager, ragged path)
        runners["invariant"].forward([s], [0], [prompts[s]], last_only=True)

    rows = []
    for b in BATCHES:
        for q in (1, VERIFY_Q):
            toks = [[rng.randrange(cfg.vocab_size) for _ in range(q)] for _ in range(b)]
            starts = [args.context] * b
            logits = {}
            for kernels, runner in runners.items():
                use(kernels)
                logits[kernels] = runner.forward(slots[:b], starts, toks).logits.clone()
            times = time_interleaved({k: r.graphs[(q, b)].graph.replay for k, r in runners.items()}, args.repeats)
            agree = float((logits["fastest"].argmax(-1) == logits["invariant"].argmax(-1)).float().mean())
            rows.append({"batch": b, "q": q, **{f"{k}_graph_ms": t for k, t in times.items()},
                         "invariant_over_fastest": times["invariant"]["median"] / times["fastest"]["median"],
                         "invariant_vs_floor": times["invariant"]["median"] / floor_ms,
                         "invariant_vs_read_floor": times["invariant"]["median"] / read_floor_ms,
                         "b12_over_invariant": times["b12"]["median"] / times["invariant"]["median"],
                         "b12_logits_bitwise_invariant": torch.equal(logits["b12"].view(torch.int16),
                                                                     logits["invariant"].view(torch.int16)),
                         "argmax_agree_fastest_vs_invariant": agree,
                         **{f"{k}_over_invariant": times[k]["median"] / times["invariant"]["median"]
                            for k in kernel_sets if k.endswith("_tuned")},
                         **{f"{k}_logits_bitwise_invariant": torch.equal(logits[k].view(torch.int16),
                                                                         logits["invariant"].view(torch.int16))
                            for k in kernel_sets if k.endswith("_tuned")}})

    n, length = PREFILL
    prefill = ForwardBatch.build(slots[:n], [0] * n, [prompts[s][:1] * length for s in slots[:n]], max_len, device)

    def prefill_with(kernels: str):
        def run() -> None:
            use(kernels)
            with torch.inference_mode():
                runners[kernels].run(prefill)
        return run

    prefill_times = time_interleaved({k: prefill_with(k) for k in KERNELS}, args.repeats, iters=5, warmup=1)
    use("invariant")
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "context": args.context,
        "copy_bandwidth_TBps": bw / 1e12, "read_bandwidth_TBps": read_bw / 1e12,
        "weight_GB": weight_bytes_per_step(model) / 1e9, "floor_ms": floor_ms,
        "read_floor_ms": read_floor_ms,
        "b12": {**b12_report, "weight_bytes": weight_bytes(b12_model)},
        "attention_rel_err_triton_vs_torch": attn_err, "fused_rel_err_triton_vs_torch": fused_errs, "rows": rows,
        "tuned_tiles": json.loads(tiles["invariant_tuned"].to_json()) if args.tuned_tiles else None,
        "prefill": {"prompts": n, "tokens": length, **{f"{k}_ms": t for k, t in prefill_times.items()},
                    "invariant_over_fastest": (prefill_times["invariant"]["median"]
                                               / prefill_times["fastest"]["median"])},
    }
    write_json(out / "gpu_engine.json", result)
    print(f"\nGPU {result['gpu']}  copy {bw / 1e12:.2f} TB/s  read {read_bw / 1e12:.2f} TB/s  weights "
          f"{result['weight_GB']:.2f} GB  floor {floor_ms:.3f} ms (at the read limit {result['read_floor_ms']:.3f})  "
          f"attention rel err {attn_err:.2e}")
    print("fused kernels rel err vs torch: " + ", ".join(f"{k} {v:.1e}" for k, v in fused_errs.items()))
    print(f"{'B':>3} {'q':>3} {'fastest ms':>10} {'invariant ms':>12} {'ratio':>6} {'x read floor':>12} {'agree':>6} "
          f"{'b12 ms':>7} {'b12/inv':>7} bitwise")
    for r in rows:
        print(f"{r['batch']:>3} {r['q']:>3} {r['fastest_graph_ms']['median']:>10.3f} "
              f"{r['invariant_graph_ms']['median']:>12.3f} {r['invariant_over_fastest']:>6.3f} "
              f"{r['invariant_vs_read_floor']:>12.2f} {r['argmax_agree_fastest_vs_invariant']:>6.3f} "
              f"{r['b12_graph_ms']['median']:>7.3f} {r['b12_over_invariant']:>7.3f} {r['b12_logits_bitwise_invariant']}"
              + "".join(f"  {k} {r[f'{k}_over_invariant']:.3f}x inv, bitwise {r[f'{k}_logits_bitwise_invariant']}"
                        for k in kernel_sets if k.endswith("_tuned")))
    p = result["prefill"]
    print(f"prefill {n} x {length}: fastest {p['fastest_ms']['median']:.2f} ms, invariant "
          f"{p['invariant_ms']['median']:.2f} ms => {p['invariant_over_fastest']:.3f} (goal <= 1.25)")


if __name__ == "__main__":
    main()
