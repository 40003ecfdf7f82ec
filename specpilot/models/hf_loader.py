"""Hugging Face model directories: config.json + (sharded) safetensors -> Checkpoint."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import safetensors.torch
import torch
import transformers

from specpilot.formats.checkpoint import decode_state, format_note
from specpilot.models.checkpoint import Checkpoint, check_state_dict, collect_eos_ids
from specpilot.models.config import HYBRID_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelConfig
from specpilot.models.hybrid import HybridConfig

# vision-language model types whose language model loads alone: the prefix of its tensors' names
MULTIMODAL_TEXT = {"qwen3_5": "model.language_model."}
_LOADABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def load_hf_dir(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Checkpoint:
    path = pathlib.Path(path)
    source = str(path)
    raw = _read_json(path / "config.json")
    note = format_note(raw)
    text_prefix = MULTIMODAL_TEXT.get(raw.get("model_type"))
    if text_prefix is not None:  # a vision-language checkpoint: its language model, as a text-only one
        raw = {"tie_word_embeddings": raw.get("tie_word_embeddings", False), **raw["text_config"]}
    _check_supported(raw, source)
    tokenizer = _load_tokenizer(path)
    config = _build_config(raw, _generation_eos(path), tokenizer)
    state_dict = _load_weights(path, dtype, note)
    if text_prefix is not None:
        state_dict = {"model." + k.removeprefix(text_prefix) if k.startswith(text_prefix) else k: v
                      for k, v in state_dict.items() if not k.startswith("model.visual.")}
    # HF serialises rotary caches in some old checkpoints and may write lm_head even when tied.
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    check_state_dict(config, state_dict, source)
    return Checkpoint(config=config, state_dict=state_dict, tokenizer=tokenizer, source=source,
                      weight_format=note["format"] if note else None)


def _read_json(file: pathlib.Path) -> dict[str, Any]:
    if not file.is_file():
        raise FileNotFoundError(f"missing {file.name}: {str(file)!r} does not exist")
    return json.loads(file.read_text())


def _as_list(value: int | list[int] | None) -> list[int | None]:
    return value if isinstance(value, list) else [value]


def _generation_eos(path: pathlib.Path) -> list[int | None]:
    # generation_config.json is what HF generate() stops on; it often lists more ids than config.json.
    file = path / "generation_config.json"
    return _as_list(json.loads(file.read_text()).get("eos_token_id")) if file.is_file() else []


def _load_tokenizer(path: pathlib.Path) -> transformers.PreTrainedTokenizerBase | None:
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    return transformers.AutoTokenizer.from_pretrained(str(path))


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the scaling dict, from legacy (`rope_theta`/`rope_scaling`) or transformers 5
    (`rope_parameters`, which also carries rope_theta) keys."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    if "type" in params and "rope_type" not in params:  # pre-4.45 spelling
        params["rope_type"] = params.pop("type")
    if params.get("rope_type", "default") == "default":
        return theta, None
    return theta, params


def _check_supported(raw: dict[str, Any], source: str) -> None:
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source!r}: unsupported model_type {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    # Llama/Qwen3 `attention_bias` also adds an o_proj bias, which ModelConfig cannot express;
    # Qwen2 always has q/k/v biases and never an o_proj bias.
    if arch != "qwen2" and raw.get("attention_bias"):
        raise ValueError(f"{source!r}: attention_bias=true (biased o_proj) is not supported for {arch}")
    if raw.get("mlp_bias"):
        raise ValueError(f"{source!r}: mlp_bias=true is not supported")
    if raw.get("use_sliding_window"):
        raise ValueError(f"{source!r}: sliding-window attention is not supported")


def _build_config(
    raw: dict[str, Any],
    generation_eos: list[int | None],
    tokenizer: transformers.PreTrainedTokenizerBase | None,
) -> ModelConfig:
    arch = raw["model_type"]
    hidden, num_heads = raw["hidden_size"], raw["num_attention_heads"]
    rope_theta, rope_scaling = _rope(raw)
    return ModelConfig(
        hybrid=HybridConfig.from_hf(raw) if arch in HYBRID_ARCHITECTURES else None,
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or hidden // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 8192),
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=collect_eos_ids(_as_list(raw.get("eos_token_id")) + generation_eos, tokenizer),
    )


def weight_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / WEIGHTS_INDEX
    if not index.is_file():
        single = path / _WEIGHTS_FILE
        if not single.is_file():
            raise FileNotFoundError(
                f"{str(path)!r} has neither {_WEIGHTS_FILE} nor {WEIGHTS_INDEX} (only safetensors are supported)"
            )
        return [single]
    files = [path / shard for shard in sorted(set(_read_json(index)["weight_map"].values()))]
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{str(path)!r}: weight shards {', '.join(missing)} listed in {WEIGHTS_INDEX} are missing"
        )
    return files


def _load_weights(path: pathlib.Path, dtype: torch.dtype, note: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    """`note`: config.json's weight format note, whose B12 tensors are decoded to bf16 first."""
    raw: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        raw.update(safetensors.torch.load_file(file))
    if note is not None:
        raw = decode_state(raw, note)
    for name, tensor in raw.items():
        if tensor.dtype not in _LOADABLE_DTYPES:
            raise ValueError(f"{str(path)!r}: tensor {name} has unsupported dtype {tensor.dtype}")
    return {name: tensor.to(dtype) for name, tensor in raw.items()}
