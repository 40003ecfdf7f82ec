"""Shared pieces of the GPU benchmark scripts: synthetic models of real shapes, ceilings, timing."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from specpilot.bench.harness import spread
from specpilot.config import SamplingParams
from specpilot.costmodel.cost_table import profile_cost_table
from specpilot.engine.cost_table import key_for, load_cost_table, save_cost_table
from specpilot.engine.engine import Engine, EngineConfig
from specpilot.engine.registry import Profile, embedded_profile, open_defaults
from specpilot.kernels.stream_read import stream_read_triton
from specpilot.models.config import ModelConfig
from specpilot.models.hybrid import HybridConfig, HybridTransformer
from specpilot.models.linear import iter_linears
from specpilot.models.transformer import Transformer
from specpilot.state.request import Request

LLAMA31_8B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=[128001],
)


def hybrid_config(raw: dict) -> ModelConfig:
    """The engine's config of a hybrid target from its Hugging Face config.json fields."""
    return ModelConfig(
        architecture=raw["model_type"], vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"],
        num_heads=raw["num_attention_heads"], num_kv_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"],
        rms_norm_eps=raw["rms_norm_eps"], rope_theta=raw["rope_theta"], max_position_embeddings=8192,
        tie_word_embeddings=False, eos_token_ids=[raw["vocab_size"] - 2], hybrid=HybridConfig.from_hf(raw))


# Qwen3.5-style hybrid text model at ~8B (7.6 B parameters): three Gated DeltaNet layers to one gated attention
# layer, Qwen3-Next's head shapes, a dense MLP. A shape to time, not a published checkpoint's config.
QWEN35_STYLE_8B = hybrid_config({
    "model_type": "qwen3_5_text", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 32, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
} | {"layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8})


def synthetic_hybrid(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> HybridTransformer:
    """A hybrid target of `cfg`'s shapes: random matrices and embeddings, the modules' own norms and gates."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = HybridTransformer(cfg.hybrid, cfg.max_position_embeddings).to(dtype)
    for p in model.parameters():
        if p.dim() == 2:
            p.data.normal_(0.0, 0.02)
    return model.eval()


def synthetic_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Transformer:
    """Random weights of the real shapes (never zeros: they can time faster than real data)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg).to(dtype)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.uniform_(0.8, 1.2)
        else:
            p.data.normal_(0.0, 0.02)
    return model.eval()


def weight_bytes_per_step(model: Transformer, batch_rows: int = 1) -> int:
    """Bytes every step must read: every linear weight once, plus the embedding rows looked up."""
    seen: set[int] = set()
    total = 0
    for _, lin in iter_linears(model):
        if lin.weight.data_ptr() not in seen:
            seen.add(lin.weight.data_ptr())
            total += lin.weight.numel() * lin.weight.element_size()
    emb = model.embed_tokens.weight
    return total + batch_rows * emb.shape[1] * emb.element_size()


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), iters=20)
    return 2 * n * 2 / (ms * 1e-3)


def read_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Read-only bandwidth in bytes/s: kernels/stream_read.py's streaming probe over `gib` GiB (the floor a
    weight read can reach, beside copy_bandwidth's copy)."""
    src = torch.randn(int(gib * 2**30) // 4, device=device)
    ms = time_cuda(lambda: stream_read_triton(src), iters=20)
    return src.numel() * 4 / (ms * 1e-3)


def timed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """One call's wall time in ms, the device's queue drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


class TritonCompiles:
    """Triton kernels compiled (or loaded from the disk cache) while the context is open, with their seconds: a
    timed run that specialises a kernel anew pays for a compile inside its steps. Counts nothing where triton
    lacks the runtime hooks (CPU-only installs without triton.knobs)."""

    def __init__(self) -> None:
        self.kernels: Counter[str] = Counter()
        # each compile's cache key (argument types and specialisations, constexprs, options): diffing two of a
        # kernel shows which argument took a new value
        self.specialisations: list[str] = []
        self.seconds = 0.0
        self._started: float | None = None

    def _before(self, *_, **kwargs) -> bool:
        self._started = time.perf_counter()
        return False  # False: compile as usual

    def _after(self, *_, **kwargs) -> None:
        self.kernels[getattr(kwargs.get("fn"), "name", "?")] += 1
        self.specialisations.append(str(kwargs.get("key", kwargs.get("repr", ""))))
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def __enter__(self) -> TritonCompiles:
        try:
            from triton import knobs
        except ImportError:
            self._hooks = None
            return self
        self._hooks = knobs.runtime
        self._saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc) -> None:
        if self._hooks is not None:
            self._hooks.jit_cache_hook, self._hooks.jit_post_compile_hook = self._saved

    def report(self) -> dict:
        return {"count": sum(self.kernels.values()), "seconds": self.seconds, "kernels": dict(self.kernels),
                "specialisations": self.specialisations}


def time_cuda(fn: Callable[[], object], iters: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of fn over iters runs, with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int,
                     timer: Callable[..., float] = time_cuda, **kwargs) -> dict[str, dict[str, float]]:
    """Each fn timed `repeats` times by `timer` (fn, **kwargs), alternating between them: median, min, max and
    values of the timings."""
    seen: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            seen[name].append(timer(fn, **kwargs))
    return {k: spread(v) for k, v in seen.items()}


def out_dir(arg: str | None) -> Path:
    path = Path(arg or os.environ.get("OUT", "bench_out"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2))


def pass_clock(engine: Engine) -> dict[str, dict[str, float]]:
    """Prefill passes and decode steps, each with its host seconds (a prefill: the prompts' pass, the drafter's
    start and the first tokens' commit, which syncs), summed into the returned dict as they run: with waves,
    admitting as requests end makes prefills a cost of their own."""
    spent = {kind: {"passes": 0.0, "s": 0.0} for kind in ("prefill", "decode")}
    for kind in spent:
        run = getattr(engine, f"_{kind}")

        def timed(reqs, run=run, tally=spent[kind]):
            start = time.perf_counter()
            try:
                return run(reqs)
            finally:
                tally["passes"] += 1
                tally["s"] += time.perf_counter() - start

        setattr(engine, f"_{kind}", timed)
    return spent


def timed_generate(engine: Engine, prompts: list[list[int]], params: SamplingParams, ar: bool,
                   clock: dict[str, dict[str, float]]) -> tuple[list[Request], float, dict[str, dict[str, float]]]:
    """The requests of one `generate` (AR, or as the engine speculates), its wall seconds, and its prefill passes and
    decode steps with their seconds and share of the wall (`clock`: pass_clock's, zeroed first)."""
    for tally in clock.values():
        tally.update(passes=0.0, s=0.0)
    start = time.perf_counter()
    with engine.autoregressive() if ar else nullcontext():
        reqs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    return reqs, wall, {kind: {"passes": int(t["passes"]), "s": round(t["s"], 4), "share": round(t["s"] / wall, 4)}
                        for kind, t in clock.items()}


def shipped_config(device: str, **fields: object) -> EngineConfig:
    """The embedded model with its DFlash drafter as serve runs it on `device` (the open defaults and the shipped
    profile), with `fields` set."""
    config = EngineConfig(device=device, speculative_algorithm="dflash", **open_defaults(device, "dflash"))
    profile = embedded_profile(device)
    return replace(Profile.load(profile).apply(config) if profile else config, **fields)


def ensure_cost_table(engine: Engine, batch_sizes: list[int], tokens: list[int], context: int) -> None:
    """Two-level's cost table of `engine`'s target on this device, profiled where none is cached."""
    key = key_for(engine.device, engine.checkpoint.source, engine.dtype, engine.exact)
    if load_cost_table(key) is None:
        print(f"profiling the cost table {key} (batch sizes {batch_sizes}, rows {tokens})", flush=True)
        save_cost_table(profile_cost_table(engine, batch_sizes, tokens, context=context))
