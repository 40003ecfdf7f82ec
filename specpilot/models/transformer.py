"""Dense decoder-only transformer (Llama, Qwen2, Qwen3) over the shared slot KV cache; its layers also
make up the DFlash draft model (drafters/dflash_model.py).

Tokens of all requests in a pass are flat ([T, hidden]); only attention needs the per-request layout,
which it takes from the ForwardBatch.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from specpilot.kernels.fused import rms_norm, rope_and_cache_write, silu_and_mul
from specpilot.kernels.slot_attention import slot_attention, tree_tail_rows
from specpilot.models.config import ModelConfig
from specpilot.models.linear import Linear, set_batch_invariant
from specpilot.models.rope import RotaryTable
from specpilot.state.batch import ForwardBatch
from specpilot.state.cache import KVCache
from specpilot.state.pages import PageTable


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one kernel on CUDA."""
        return rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim ** -0.5
        # One fused projection: one weight read and one launch instead of three.
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.batch_invariant = False  # causal and tree passes take the batch-invariant attention kernel

    def _rope_and_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        rows: torch.Tensor, cache: KVCache, rope: RotaryTable) -> torch.Tensor:
        """One kernel: q/k norm (Qwen3), RoPE, and the K/V write into this layer's cache rows; returns q."""
        T = k.shape[0]
        qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm is not None else (None, None, 1e-6)
        # -1: as many heads as q has (none in a K/V-only write)
        return rope_and_cache_write(q.view(T, -1, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim),
                                    v.view(T, self.num_kv_heads, self.head_dim), rope.cos, rope.sin, positions, rows,
                                    cache.k[self.layer], cache.v[self.layer], *qk_norm)

    def write_context(self, kv: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, cache: KVCache,
                      rope: RotaryTable) -> None:
        """K/V without queries (a block drafter's context features): `kv`, their projection by the k/v rows of
        qkv_proj, [T, 2 * kv_size]."""
        k, v = kv.split(self.kv_size, dim=-1)
        self._rope_and_write(kv.new_empty(kv.shape[0], 0), k, v, positions, rows, cache, rope)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache, rope: RotaryTable) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self._rope_and_write(q, k, v, batch.positions, batch.write_index, cache, rope)
        invariant = self.batch_invariant and (batch.causal or batch.tree_mask is not None)
        o = slot_attention(
            q, cache.k[self.layer], cache.v[self.layer], batch.slot_ids, batch.q_starts, batch.q_lens,
            batch.kv_lens, scale=self.scale, causal=batch.causal, max_q_len=batch.max_q_len,
            num_kv_splits=batch.num_kv_splits, tree_mask=batch.tree_mask,
            positions=batch.positions if invariant else None, tail_rows=batch.tail_rows, page_table=cache.page_table,
        )
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, cache: KVCache,
                rope: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried separately so each add fuses into the next norm: returns
        (this layer's MLP output, the residual before it); the layer's output is their sum."""
        h, residual = self.input_layernorm.fused(x, residual)
        h, residual = self.post_attention_layernorm.fused(self.self_attn(h, batch, cache, rope), residual)
        return self.mlp(h), residual


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope: RotaryTable | None = None
        self.batch_invariant = False

    def set_batch_invariant(self, on: bool) -> None:
        """On CUDA, every projection and attention pass in a fixed reduction order per weight shape and key
        position (the kernels' "batch invariance"): a token's logits depend on its context only."""
        set_batch_invariant(self, on)
        self.batch_invariant = on
        for layer in self.layers:
            layer.self_attn.batch_invariant = on

    def setup_rope(self, max_positions: int) -> None:
        """Tables for positions [0, max_positions); never shrinks them (engines may share a model)."""
        if self.rope is not None and self.rope.cos.shape[0] >= max_positions:
            return
        cfg = self.config
        self.rope = RotaryTable(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions,
                                self.embed_tokens.weight.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, batch: ForwardBatch, cache: KVCache,
                tap_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the final-normed hidden states [T, H] and the outputs of `tap_layers`
        concatenated on the feature axis ([T, len(taps) * H]) for drafters, or None."""
        if self.rope is None:
            raise RuntimeError("call setup_rope(max_positions) before forward")
        if list(tap_layers) != sorted(set(tap_layers)):
            raise ValueError(f"tap_layers must be strictly increasing, got {tap_layers}")
        if self.batch_invariant and batch.tree_mask is not None:  # inside a captured graph: remade every replay
            batch = dataclasses.replace(batch, tail_rows=tree_tail_rows(batch.positions, batch.tree_mask))
        batch = cache.paged(batch)
        x, residual = self.embed(batch.input_ids), None
        taps: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, batch, cache, self.rope)
            if i in tap_layers:
                taps.append(x + residual)
        hidden, _ = self.norm.fused(x, residual)
        return hidden, (torch.cat(taps, dim=-1) if taps else None)

    @property
    def kv_layers(self) -> int:
        """Layers that keep K/V."""
        return self.config.num_layers

    def kv_cache(self, dtype: torch.dtype, pages: PageTable) -> KVCache:
        """The engine's cache for this model, over `pages`."""
        cfg = self.config
        return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, pages)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
