"""Qwen3-Next and Qwen3.5 (text), hybrid targets: Gated DeltaNet layers (models/gated_deltanet.py) between gated attention
layers, mixture-of-experts MLPs, over a ForwardBatch like the dense Transformer — attention layers on the paged
KV cache, DeltaNet layers on each request's recurrent state (state/recurrent.py).

What differs from the dense models: norms scale by 1 + w (zero-centred weights); an attention layer's query
projection also gives a per-channel output gate (sigmoid), its q/k norms are per head, and RoPE turns only the
first `partial_rotary_factor` of each head; an MoE MLP routes each token to its top-k experts (softmax over
all, renormalised where `norm_topk_prob`) and adds a shared expert scaled by sigmoid(its gate). Parameters carry
the names Hugging Face's Qwen3-Next module holds (experts fused per layer as gate_up_proj [E, 2I, H] and
down_proj [E, H, I]; published checkpoints' per-expert tensors are fused on load). A DeltaNet layer takes every
request of a pass at once (`GatedDeltaNet.forward_spans`: the delta rule's Triton kernel on CUDA, each request's
plain-torch form elsewhere); the rest is plain torch. In the engine the model runs AR (prefill and decode) over a
HybridCache: the paged KV cache of its attention layers with the DeltaNet layers' states beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.kernels.gated_delta import PaddedPaths
from specpilot.kernels.slot_attention import slot_attention
from specpilot.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig, Spans, commit_states
from specpilot.models.rope import RotaryTable
from specpilot.state.batch import ForwardBatch
from specpilot.models.checkpoint import Checkpoint
from specpilot.state.cache import KVCache
from specpilot.state.pages import PageTable
from specpilot.state.recurrent import RecurrentCache


@dataclass(frozen=True)
class HybridConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" per layer
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    rms_norm_eps: float
    deltanet: GatedDeltaNetConfig
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> HybridConfig:
        """From a Qwen3-Next (qwen3_next) or Qwen3.5 text (qwen3_5_text) config.json."""
        rope = raw.get("rope_parameters") or {}
        return cls(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            layer_types=tuple(raw["layer_types"]), num_heads=raw["num_attention_heads"],
            num_kv_heads=raw["num_key_value_heads"], head_dim=raw.get("head_dim") or
            raw["hidden_size"] // raw["num_attention_heads"],
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))),
            rms_norm_eps=raw["rms_norm_eps"],
            deltanet=GatedDeltaNetConfig(raw["hidden_size"], raw["linear_num_key_heads"],
                                         raw["linear_num_value_heads"], raw["linear_key_head_dim"],
                                         raw["linear_value_head_dim"], raw["linear_conv_kernel_dim"],
                                         raw["rms_norm_eps"], fused_projections=raw["model_type"] == "qwen3_next"),
            num_experts=raw.get("num_experts", 0), num_experts_per_tok=raw.get("num_experts_per_tok", 1),
            moe_intermediate_size=raw.get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=raw.get("norm_topk_prob", True), decoder_sparse_step=raw.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
            tie_word_embeddings=raw.get("tie_word_embeddings", False))

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def deltanet_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    def sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0


class CenteredRMSNorm(nn.Module):
    """RMS norm scaled by 1 + w (the weights are stored centred on zero), in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).type_as(x)


class GatedAttention(nn.Module):
    def __init__(self, cfg: HybridConfig, slot: int) -> None:
        super().__init__()
        self.cfg, self.slot = cfg, slot  # slot: this layer's index among the attention layers (its KV cache layer)
        h, d = cfg.num_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = CenteredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = CenteredRMSNorm(d, cfg.rms_norm_eps)
        self.rotary_dim = int(d * cfg.partial_rotary_factor)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryTable) -> torch.Tensor:
        r = self.rotary_dim
        return torch.cat([rope.apply(x[..., :r], positions), x[..., r:]], dim=-1)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache, rope: RotaryTable) -> torch.Tensor:
        t, h, d, hk = x.shape[0], self.cfg.num_heads, self.cfg.head_dim, self.cfg.num_kv_heads
        q, gate = self.q_proj(x).view(t, h, 2 * d).chunk(2, dim=-1)
        q = self._rope(self.q_norm(q), batch.positions, rope)
        k = self._rope(self.k_norm(self.k_proj(x).view(t, hk, d)), batch.positions, rope)
        v = self.v_proj(x).view(t, hk, d)
        cache.k[self.slot].view(-1, hk, d).index_copy_(0, batch.write_index, k.to(cache.kv.dtype))
        cache.v[self.slot].view(-1, hk, d).index_copy_(0, batch.write_index, v.to(cache.kv.dtype))
        o = slot_attention(q.contiguous(), cache.k[self.slot], cache.v[self.slot], batch.slot_ids, batch.q_starts,
                           batch.q_lens, batch.kv_lens, scale=d**-0.5, causal=batch.causal,
                           max_q_len=batch.max_q_len, tree_mask=batch.tree_mask, page_table=cache.page_table)
        return self.o_proj(o.reshape(t, h * d) * torch.sigmoid(gate.reshape(t, h * d)))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token its top-k experts and their weights."""
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.cfg.num_experts_per_tok, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts


class Experts(nn.Module):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            tokens, rank = (experts == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[tokens], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[tokens, rank, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


class SparseMoE(nn.Module):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        return self.experts(x, weights, experts) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def spans_of(batch: ForwardBatch, verify: bool, conv_width: int) -> Spans:
    """The pass's requests as every DeltaNet layer reads them, laid out once for all its layers. A verify's tree
    comes from batch.tree_parents and tree_mask; a chain's node j hangs under j - 1."""
    tree = verify and batch.tree_parents is not None
    return Spans.build(batch.slot_ids, batch.q_starts, batch.q_lens, conv_width, verify,
                       batch.tree_parents if tree else None, batch.tree_mask if tree else None)


class HybridLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, layer: int) -> None:
        super().__init__()
        self.deltanet = cfg.layer_types[layer] == "linear_attention"
        if self.deltanet:
            self.linear_attn = GatedDeltaNet(cfg.deltanet)
            self.state_slot = cfg.deltanet_layers.index(layer)
        else:
            self.self_attn = GatedAttention(cfg, cfg.attention_layers.index(layer))
        self.mlp = SparseMoE(cfg) if cfg.sparse(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _mix(self, h: torch.Tensor, batch: ForwardBatch, cache: KVCache, states: RecurrentCache,
             rope: RotaryTable, spans: Spans) -> torch.Tensor:
        if not self.deltanet:
            return self.self_attn(h, batch, cache, rope)
        layer = self.state_slot
        out, tree = self.linear_attn.forward_spans(h, states.conv[:, layer], states.ssm[:, layer], spans)
        if tree is not None:
            states.pending[layer] = (tree, spans.host)
        return out

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache, states: RecurrentCache,
                rope: RotaryTable, spans: Spans) -> torch.Tensor:
        x = x + self._mix(self.input_layernorm(x), batch, cache, states, rope, spans)
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridBody(nn.Module):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, i) for i in range(len(cfg.layer_types)))
        self.norm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HybridCache(KVCache):
    """The engine's cache of a hybrid target: attention layers' K/V on the pages, DeltaNet layers' states per
    slot (`recurrent`), zeroed when a request takes the slot and copied with a shared prefill."""

    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, pages: PageTable) -> None:
        super().__init__(len(cfg.attention_layers), cfg.num_kv_heads, cfg.head_dim, dtype, pages)
        d = cfg.deltanet
        self.recurrent = RecurrentCache(len(cfg.deltanet_layers), pages.num_slots, (d.conv_kernel - 1, d.conv_dim),
                                        (d.num_value_heads, d.key_head_dim, d.value_head_dim), dtype,
                                        pages.table.device)

    def allocate(self, length: int | None = None, share: tuple[int, int] | None = None) -> int:
        slot = super().allocate(length, share)
        self.recurrent.reset(slot)
        return slot

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        super().copy_prefix(src, dst, length)
        self.recurrent.conv[dst].copy_(self.recurrent.conv[src])
        self.recurrent.ssm[dst].copy_(self.recurrent.ssm[src])

    def commit_paths(self, slots: list[int], paths: list[list[int]]) -> None:
        """Each DeltaNet layer's state of slots[i] becomes the one after its verify's accepted paths[i] (node
        indices within the request's block): all the pass's requests at once, layer by layer."""
        states = self.recurrent
        pending = [states.pending.pop(layer) for layer in range(states.conv.shape[1])]
        starts = {slot: start for slot, start, _ in pending[0][1]}  # every layer's pass laid out alike
        rows = PaddedPaths.of([[starts[slot] + node for node in path] for slot, path in zip(slots, paths)],
                              states.conv.device)
        index = torch.tensor(slots, device=states.conv.device)
        for layer, (tree, _) in enumerate(pending):
            conv, ssm = commit_states(states.conv[index, layer], states.ssm[index, layer], tree, rows)
            states.conv[index, layer] = conv
            states.ssm[index, layer] = ssm


class HybridTransformer(nn.Module):
    """`model` and `lm_head`, as Hugging Face names them."""

    batch_invariant = False  # plain torch: no invariant kernels yet

    def __init__(self, cfg: HybridConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = HybridBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope: RotaryTable | None = None
        self.setup_rope(max_positions)

    def setup_rope(self, max_positions: int) -> None:
        """Tables for positions [0, max_positions); never shrinks them."""
        if self.rope is not None and self.rope.cos.shape[0] >= max_positions:
            return
        cfg = self.config
        self.rope = RotaryTable(int(cfg.head_dim * cfg.partial_rotary_factor), cfg.rope_theta, None, max_positions,
                                self.lm_head.weight.device)

    def set_batch_invariant(self, on: bool) -> None:
        if on:
            raise ValueError("hybrid targets have no batch-invariant kernels yet: pass --no-batch-invariant")

    @property
    def kv_layers(self) -> int:
        """Layers that keep K/V: the attention ones."""
        return len(self.config.attention_layers)

    def kv_cache(self, dtype: torch.dtype, pages: PageTable) -> HybridCache:
        return HybridCache(self.config, dtype, pages)

    def caches(self, num_slots: int, max_len: int, dtype: torch.dtype,
               device: torch.device) -> tuple[KVCache, RecurrentCache]:
        """A cache of `num_slots` whole slots: its K/V and its recurrent states."""
        cache = HybridCache(self.config, dtype, PageTable(num_slots, max_len, None, device))
        return cache, cache.recurrent

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def hidden(self, batch: ForwardBatch, cache: KVCache, states: RecurrentCache, verify: bool = False,
               tap_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final hidden states [T, H] of every token of the pass, the outputs of `tap_layers` side by side
        [T, taps * H] or None). A prefill or decode leaves its tokens in the caches; a `verify` (a chain, or a
        tree: batch.tree_mask and tree_parents) writes its nodes' K/V at their own rows and no recurrent state:
        the cache's commit_paths then keeps the accepted path's."""
        batch = cache.paged(batch)
        spans = spans_of(batch, verify, self.config.deltanet.conv_kernel)
        x = self.model.embed_tokens(batch.input_ids)
        taps = []
        for i, layer in enumerate(self.model.layers):
            x = layer(x, batch, cache, states, self.rope, spans)
            if i in tap_layers:
                taps.append(x)
        return self.model.norm(x), (torch.cat(taps, dim=-1) if taps else None)

    def forward(self, batch: ForwardBatch, cache: HybridCache,
                tap_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The engine's pass over its HybridCache: (final hidden states [T, H], the taps a drafter reads)."""
        return self.hidden(batch, cache, cache.recurrent, batch.verify, tap_layers)




def _fused_experts(sd: dict[str, torch.Tensor], cfg: HybridConfig) -> dict[str, torch.Tensor]:
    """Published checkpoints' per-expert tensors (mlp.experts.{e}.{gate,up,down}_proj.weight) as the fused
    gate_up_proj [E, 2I, H] and down_proj [E, H, I] of each sparse layer; fused ones pass as they are."""
    out = {k: v for k, v in sd.items() if ".mlp.experts." not in k or k.endswith(("gate_up_proj", "experts.down_proj"))}
    for layer in range(len(cfg.layer_types)):
        head = f"model.layers.{layer}.mlp.experts."
        if f"{head}0.gate_proj.weight" not in sd:
            continue
        experts = range(cfg.num_experts)
        out[f"{head}gate_up_proj"] = torch.stack([torch.cat([sd[f"{head}{e}.gate_proj.weight"],
                                                             sd[f"{head}{e}.up_proj.weight"]]) for e in experts])
        out[f"{head}down_proj"] = torch.stack([sd[f"{head}{e}.down_proj.weight"] for e in experts])
    return out


def build_hybrid(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> HybridTransformer:
    """The hybrid target of a loaded checkpoint (Hugging Face names), its tensors checked by a strict load."""
    cfg = ckpt.config.hybrid
    model = HybridTransformer(cfg, ckpt.config.max_position_embeddings)
    state = _fused_experts(ckpt.state_dict, cfg)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt.source} does not match its {ckpt.config.architecture} config: missing "
                         f"tensors {sorted(missing)[:5]}, unexpected tensors {sorted(unexpected)[:5]}")
    return model.to(device=device, dtype=dtype).eval()
