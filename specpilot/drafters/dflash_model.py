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

from specpilot.kernels.fused import rope_and_cache_write
from specpilot.kernels.slot_attention import slot_attention
from specpilot.models.config import ModelConfig
from specpilot.models.linear import Linear
from specpilot.models.rope import RotaryTable
from specpilot.models.transformer import MLP, RMSNorm
from specpilot.state.batch import ForwardBatch
from specpilot.state.cache import KVCache


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


class DFlashLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim ** -0.5
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def _rope_and_write(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                        cache: KVCache, rope: RotaryTable) -> torch.Tensor:
        """q/k norms, RoPE, and the K/V write into this layer's cache in one kernel; returns q."""
        k, v = kv.split(self.kv_size, dim=-1)
        T = kv.shape[0]
        return rope_and_cache_write(
            q.view(T, -1, self.head_dim), k.view(T, self.kv_heads, self.head_dim),
            v.view(T, self.kv_heads, self.head_dim), rope.cos, rope.sin, positions, rows, cache.k[self.layer],
            cache.v[self.layer], self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def write_context(self, kv: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, cache: KVCache,
                      rope: RotaryTable) -> None:
        """Context features enter as K/V only: `kv`, their projection by the k/v rows of qkv_proj."""
        self._rope_and_write(kv.new_empty(kv.shape[0], 0), kv, positions, rows, cache, rope)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, cache: KVCache,
                rope: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
        """Same residual convention as the target's DecoderLayer: returns (MLP output, residual)."""
        h, residual = self.input_layernorm.fused(x, residual)
        q, kv = self.qkv_proj(h).split([self.q_size, 2 * self.kv_size], dim=-1)
        q = self._rope_and_write(q, kv, batch.positions, batch.write_index, cache, rope)
        o = slot_attention(q, cache.k[self.layer], cache.v[self.layer], batch.slot_ids, batch.q_starts,
                           batch.q_lens, batch.kv_lens, scale=self.scale, causal=False,
                           max_q_len=batch.max_q_len, num_kv_splits=batch.num_kv_splits)
        h, residual = self.post_attention_layernorm.fused(self.o_proj(o.reshape(-1, self.q_size)), residual)
        return self.mlp(h), residual


class DFlashModel(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        lc = cfg.layers
        self.fc = Linear(len(cfg.target_layer_ids) * lc.hidden_size, lc.hidden_size)
        self.hidden_norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(lc, i) for i in range(lc.num_layers))
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)


def _fused_state_dict(raw: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    out = {k: raw[k] for k in ("fc.weight", "hidden_norm.weight", "norm.weight")}
    for i in range(num_layers):
        p = f"layers.{i}."
        out[p + "qkv_proj.weight"] = torch.cat([raw[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        out[p + "o_proj.weight"] = raw[p + "self_attn.o_proj.weight"]
        out[p + "q_norm.weight"] = raw[p + "self_attn.q_norm.weight"]
        out[p + "k_norm.weight"] = raw[p + "self_attn.k_norm.weight"]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([raw[p + "mlp.gate_proj.weight"], raw[p + "mlp.up_proj.weight"]])
        out[p + "mlp.down_proj.weight"] = raw[p + "mlp.down_proj.weight"]
        out[p + "input_layernorm.weight"] = raw[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = raw[p + "post_attention_layernorm.weight"]
    return out


def load_dflash_model(path: Path, cfg: DFlashConfig, device: torch.device, dtype: torch.dtype) -> DFlashModel:
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"DFlash drafter {path}: no model.safetensors")
    raw = load_file(str(weights))
    try:
        sd = _fused_state_dict(raw, cfg.layers.num_layers)
    except KeyError as err:
        raise ValueError(f"DFlash drafter {weights} lacks tensor {err.args[0]}") from None
    with torch.device("meta"):
        model = DFlashModel(cfg)
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in sd.items()}, strict=True, assign=True)
    return model.eval()
