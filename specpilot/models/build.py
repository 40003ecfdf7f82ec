"""Turn a loaded checkpoint (HF tensor names) into our Transformer with fused projections."""

from __future__ import annotations

import torch

from specpilot.models.checkpoint import Checkpoint
from specpilot.models.config import ModelConfig
from specpilot.models.linear import use_cpu_layout
from specpilot.models.hybrid import HybridTransformer, build_hybrid
from specpilot.models.transformer import Transformer


def fuse_layer_weights(sd: dict[str, torch.Tensor], cfg: ModelConfig, prefix: str = "") -> dict[str, torch.Tensor]:
    """The decoder layers' tensors under our names (`layers.i.*`, q/k/v and gate/up concatenated) from HF's
    under `prefix` (the target's "model."; none in a DFlash drafter). A missing tensor raises KeyError."""
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        src, dst = f"{prefix}layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        out[dst + "self_attn.qkv_proj.weight"] = torch.cat(
            [sd[attn + f"{n}_proj.weight"] for n in "qkv"], dim=0)
        if cfg.qkv_bias:
            out[dst + "self_attn.qkv_proj.bias"] = torch.cat([sd[attn + f"{n}_proj.bias"] for n in "qkv"])
        if cfg.qk_norm:
            out[dst + "self_attn.q_norm.weight"] = sd[attn + "q_norm.weight"]
            out[dst + "self_attn.k_norm.weight"] = sd[attn + "k_norm.weight"]
        out[dst + "self_attn.o_proj.weight"] = sd[attn + "o_proj.weight"]
        out[dst + "mlp.gate_up_proj.weight"] = torch.cat(
            [sd[src + "mlp.gate_proj.weight"], sd[src + "mlp.up_proj.weight"]], dim=0)
        out[dst + "mlp.down_proj.weight"] = sd[src + "mlp.down_proj.weight"]
        out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = sd[src + "post_attention_layernorm.weight"]
    return out


def unfuse_layer_weights(fused: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """fuse_layer_weights undone (no prefix): the fused projections split back into HF's tensors, every
    other tensor under its own name, which is already HF's."""
    out: dict[str, torch.Tensor] = {}
    for name, t in fused.items():
        stem, _, param = name.rpartition(".")
        if stem.endswith("self_attn.qkv_proj"):
            head = stem.removesuffix("qkv_proj")
            out |= {f"{head}{n}_proj.{param}": part
                    for n, part in zip("qkv", t.split([cfg.q_size, cfg.kv_size, cfg.kv_size]))}
        elif stem.endswith("mlp.gate_up_proj"):
            head = stem.removesuffix("gate_up_proj")
            out |= {f"{head}{n}_proj.{param}": part for n, part in zip(("gate", "up"), t.chunk(2))}
        else:
            out[name] = t
    return out


def _fused_state_dict(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    sd = ckpt.state_dict
    cfg = ckpt.config
    out: dict[str, torch.Tensor] = {
        "embed_tokens.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
    }
    # Tied: the same tensor under both names, re-tied after loading.
    out["lm_head.weight"] = out["embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    return out | fuse_layer_weights(sd, cfg, "model.")


def build_model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> Transformer | HybridTransformer:
    if ckpt.config.hybrid is not None:
        return build_hybrid(ckpt, device, dtype)
    with torch.device("meta"):
        model = Transformer(ckpt.config)
    try:
        fused = _fused_state_dict(ckpt)
    except KeyError as err:
        raise ValueError(f"checkpoint {ckpt.source} lacks tensor {err.args[0]}") from None
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in fused.items()},
                          strict=True, assign=True)
    if ckpt.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if device.type == "cpu":
        use_cpu_layout(model)
    model.eval()
    return model
