"""The DFlash draft model, loaded from a checkpoint directory in the published format.

config.json: architectures ["DFlashDraftModel"], Qwen3 keys, `dflash_config {mask_token_id,
target_layer_ids[, block_size]}` (block_size may also sit at top level). Tensors: `fc`, `hidden_norm`,
`norm`, `layers.i.*` Qwen3-style with q/k norms; no embedding or head (the target's are used).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from specpilot.models.build import fuse_layer_weights
from specpilot.models.config import ModelConfig
from specpilot.models.linear import Linear
from specpilot.models.transformer import DecoderLayer, RMSNorm


@dataclass
class DFlashConfig:
    layers: ModelConfig  # Qwen3-style shapes of the draft layers
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int


def read_dflash_config(path: Path) -> DFlashConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"DFlash drafter {path}: no config.json")
    raw = json.loads(cfg_file.read_text())
    if "DFlashDraftModel" not in raw.get("architectures", []):
        raise ValueError(f"{cfg_file}: architectures {raw.get('architectures')} do not include DFlashDraftModel")
    dcfg = raw.get("dflash_config") or {}
    for key in ("mask_token_id", "target_layer_ids"):
        if key not in dcfg:
            raise ValueError(f"{cfg_file}: dflash_config lacks {key!r}")
    block = dcfg.get("block_size", raw.get("block_size", 16))
    heads = raw["num_attention_heads"]
    layers = ModelConfig(
        architecture="qwen3", vocab_size=raw.get("vocab_size", 1), hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads", heads), head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 1e6)),
        rope_scaling=raw.get("rope_scaling"), max_position_embeddings=raw.get("max_position_embeddings", 32768),
        qk_norm=True,
    )
    return DFlashConfig(layers, list(dcfg["target_layer_ids"]), int(dcfg["mask_token_id"]), int(block))


class DFlashModel(nn.Module):
    """fc + hidden_norm turn tap features into context features; the layers are the target's DecoderLayer
    (q/k norms), which the drafter runs over a non-causal batch and feeds context K/V through
    `Attention.write_context`."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        lc = cfg.layers
        self.fc = Linear(len(cfg.target_layer_ids) * lc.hidden_size, lc.hidden_size)
        self.hidden_norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(lc, i) for i in range(lc.num_layers))
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)


def load_dflash_model(path: Path, cfg: DFlashConfig, device: torch.device, dtype: torch.dtype) -> DFlashModel:
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"DFlash drafter {path}: no model.safetensors")
    raw = load_file(str(weights))
    try:
        sd = {k: raw[k] for k in ("fc.weight", "hidden_norm.weight", "norm.weight")}
        sd |= fuse_layer_weights(raw, cfg.layers)
    except KeyError as err:
        raise ValueError(f"DFlash drafter {weights} lacks tensor {err.args[0]}") from None
    with torch.device("meta"):
        model = DFlashModel(cfg)
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in sd.items()}, strict=True, assign=True)
    return model.eval()
