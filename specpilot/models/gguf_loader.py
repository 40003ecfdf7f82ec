"""GGUF (llama.cpp) checkpoints: metadata -> ModelConfig, dequantized tensors -> HF-named state dict."""

from __future__ import annotations

import math
import os
import pathlib
from typing import Any

import gguf
import numpy as np
import torch
import transformers

from specpilot.config import cache_root
from specpilot.models.checkpoint import Checkpoint, check_state_dict, collect_eos_ids
from specpilot.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from specpilot.progress import bar

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# llama.cpp stores Llama-3.1 style RoPE scaling as per-frequency divisors in this tensor.
_ROPE_FREQS = "rope_freqs.weight"
# llama3 scaling only depends on original_context / {low,high}_freq_factor, so the original
# context cannot be recovered; Llama 3.x uses 8192, which makes the fitted factors the published ones.
_LLAMA3_ORIGINAL_CONTEXT = 8192


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Checkpoint:
    path = pathlib.Path(path)
    source = str(path)
    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF {source!r} has unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    tokenizer = gguf_tokenizer(path) if "tokenizer.ggml.model" in reader.fields else None
    config = _build_config(reader, arch, tensors, tokenizer, source)
    # rope_freqs is folded into config.rope_scaling above.
    weights = [t for t in reader.tensors if t.name != _ROPE_FREQS]
    state_dict = {_hf_name(t.name, source): _to_torch(t, dtype, source)
                  for t in bar(weights, f"dequantizing {path.name}")}
    check_state_dict(config, state_dict, source)
    if arch == "llama":
        _unpermute_llama_qk(state_dict, config)
    return Checkpoint(config=config, state_dict=state_dict, tokenizer=tokenizer, source=source)


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        # Shortest float32 repr recovers the decimal the converter wrote (1e-05, not 9.9999997e-06).
        return float(str(np.float32(field.contents())))
    return field.contents()


def _dequantize(tensor: gguf.ReaderTensor, source: str) -> np.ndarray:
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as err:
        raise ValueError(
            f"GGUF {source!r}: tensor {tensor.name} has type {tensor.tensor_type.name}, "
            f"which the gguf library cannot dequantize"
        ) from err
    return values.reshape(_shape(tensor))


def _shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    # GGUF lists dims fastest-first; reversed they are the row-major (PyTorch) shape.
    return tuple(int(d) for d in reversed(tensor.shape))


def _to_torch(tensor: gguf.ReaderTensor, dtype: torch.dtype, source: str) -> torch.Tensor:
    values = _dequantize(tensor, source)
    if not values.flags.writeable:  # F32 tensors are views of the read-only memmap
        values = values.copy()
    return torch.from_numpy(values).to(dtype)


def gguf_tokenizer(path: pathlib.Path) -> transformers.PreTrainedTokenizerBase:
    """transformers rebuilds a fast tokenizer from the GGUF metadata (no hub access involved), which
    takes most of a small model's load time; the result is kept in the user's cache for the next start."""
    cached = tokenizer_cache_dir(path)
    if (cached / "tokenizer.json").is_file():
        return transformers.AutoTokenizer.from_pretrained(str(cached))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tokenizer.save_pretrained(str(cached))
    except OSError:  # a read-only home: convert again next time
        pass
    return tokenizer


def tokenizer_cache_dir(path: pathlib.Path) -> pathlib.Path:
    """One folder per GGUF file (name, size, mtime) and transformers version, under $SPECPILOT_CACHE_DIR
    or $XDG_CACHE_HOME/specpilot (default ~/.cache/specpilot)."""
    stat = path.stat()
    return cache_root() / "tokenizers" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-tf{transformers.__version__}"


def _build_config(
    reader: gguf.GGUFReader,
    arch: str,
    tensors: dict[str, gguf.ReaderTensor],
    tokenizer: transformers.PreTrainedTokenizerBase | None,
    source: str,
) -> ModelConfig:
    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF {source!r} lacks required metadata key {arch}.{key}")
        return value

    hidden, num_heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    rope_dim = int(meta("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"GGUF {source!r}: partial rotary embeddings (rope dim {rope_dim} != head dim {head_dim})")
    rope_theta = float(meta("rope.freq_base", 10000.0))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab_size = len(tokens.data)
    else:
        vocab_size = int(meta("vocab_size", _shape(tensors["token_embd.weight"])[0]))
    rope_freqs = _dequantize(tensors[_ROPE_FREQS], source) if _ROPE_FREQS in tensors else None
    declared_eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(reader, arch, rope_freqs, rope_theta, head_dim, source),
        max_position_embeddings=int(meta("context_length", 8192)),
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=collect_eos_ids(declared_eos, tokenizer),
    )


def _rope_scaling(
    reader: gguf.GGUFReader,
    arch: str,
    rope_freqs: np.ndarray | None,
    rope_theta: float,
    head_dim: int,
    source: str,
) -> dict[str, Any] | None:
    if rope_freqs is not None:
        return _llama3_scaling_from_factors(rope_freqs, rope_theta, head_dim, source)
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _llama3_factors(inv_freq: np.ndarray, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """Per-frequency divisors of the Llama-3.1 RoPE scaling (the values llama.cpp stores)."""
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)


def _llama3_scaling_from_factors(factors: np.ndarray, rope_theta: float, head_dim: int, source: str) -> dict | None:
    """Recover the HF llama3 rope_scaling dict from llama.cpp's rope_freqs tensor.

    In the smoothing band, smooth = (C / wavelen - low) / (high - low) is linear in 1 / wavelen,
    so a line fit through the band gives low and high; the result is verified against the tensor.
    """
    factors = factors.astype(np.float64).reshape(-1)
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"GGUF {source!r}: {_ROPE_FREQS} has {factors.size} values, expected {inv_freq.size}")
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    band = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if band.sum() < 2:
        raise ValueError(
            f"GGUF {source!r}: cannot recover llama3 RoPE scaling from {_ROPE_FREQS} (too few smoothed bands)"
        )
    smooth = (factor / factors[band] - 1) / (factor - 1)
    slope, intercept = np.polyfit(_LLAMA3_ORIGINAL_CONTEXT * inv_freq[band] / (2 * math.pi), smooth, 1)
    low = round(float(-intercept / slope), 3)
    high = round(low + float(1 / slope), 3)
    refit = _llama3_factors(inv_freq, factor, low, high, _LLAMA3_ORIGINAL_CONTEXT)
    if not np.allclose(refit, factors, rtol=1e-3):
        raise ValueError(f"GGUF {source!r}: {_ROPE_FREQS} does not follow the llama3 RoPE scaling rule")
    return {
        "rope_type": "llama3",
        "factor": round(factor, 4),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": _LLAMA3_ORIGINAL_CONTEXT,
    }


def _hf_name(gguf_name: str, source: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_TENSORS:
        return f"model.layers.{layer}.{_LAYER_TENSORS[suffix]}"
    raise ValueError(f"GGUF {source!r}: unsupported tensor {gguf_name!r}")


def _unpermute_rope(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs) to get HF's rotate-half layout.

    The converter applied w.reshape(n, 2, d/2, *rest).swapaxes(1, 2) to weights and biases; this is its inverse.
    """
    head_dim = weight.shape[0] // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _unpermute_llama_qk(state_dict: dict[str, torch.Tensor], config: ModelConfig) -> None:
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}.self_attn."
        for proj, n_heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
            for key in (f"{prefix}{proj}.weight", f"{prefix}{proj}.bias"):
                if key in state_dict:
                    state_dict[key] = _unpermute_rope(state_dict[key], n_heads)
