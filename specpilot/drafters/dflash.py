"""DFlash block drafter, loaded from a checkpoint directory in the published format.

config.json: architectures ["DFlashDraftModel"], Qwen3 keys, `dflash_config {mask_token_id,
target_layer_ids[, block_size]}` (block_size may also sit at top level). Tensors: `fc`, `hidden_norm`,
`norm`, `layers.i.*` Qwen3-style with q/k norms; no embedding or head (the target's are used).

Per request the drafter keeps context K/V, one entry per committed token, computed from the target's
tap features (concat -> fc -> RMSNorm, then each layer's k/v projections). A draft is one non-causal
pass over the block [newest committed token, mask x (B-1)] whose queries see the whole context and the
whole block; output slot k predicts the token at slot k. Block K/V are written past the context and
are overwritten by the next round, so dropping them costs nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from specpilot.drafters.base import Draft, Drafter
from specpilot.drafters.draft_tree import TreeBuilder, TreeLayout, merge_lookup
from specpilot.engine.forward_batch import ForwardBatch
from specpilot.engine.graphs import CapturedPass, EagerReplay, GraphBackend
from specpilot.engine.kv_cache import KVCache
from specpilot.engine.model_runner import _StaticInputs
from specpilot.engine.request import Request
from specpilot.kernels.fused import rope_and_cache_write
from specpilot.kernels.slot_attention import slot_attention
from specpilot.models.config import ModelConfig
from specpilot.models.linear import Linear
from specpilot.models.rope import RotaryTable
from specpilot.models.transformer import MLP, RMSNorm, Transformer


# The probability a tree gives prompt lookup's tokens when it merges them into the slots' top-k: above
# most of the drafter's second choices, so the lookup's path is kept whenever a context repeats.
# Embedded model, shipped drafter, top-4, HumanEval 12 prompts on CPU: tau 3.18 / 3.20 / 3.13 at
# 0.8 / 0.9 / 0.99 (0.5: 3.03; replacing the whole tree by the lookup's chain: 3.04).
LOOKUP_PROB = 0.9


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

    def write_context(self, ctx: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, cache: KVCache,
                      rope: RotaryTable) -> None:
        """Context features enter as K/V only: the k/v rows of the fused projection."""
        kv = torch.nn.functional.linear(ctx, self.qkv_proj.weight[self.q_size :])
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


class DFlashDrafter(Drafter):
    """Context K/V of the committed tokens are appended in the same pass that drafts the next block,
    so one step is one (graph-capturable) pass: [pending context rows ; block rows]. Pending rows
    are the verify rows of the previous step; rows that were not committed write to the scratch slot."""

    name = "dflash"

    def __init__(self, model: DFlashModel, cfg: DFlashConfig, target: Transformer, num_slots: int,
                 context_length: int, device: torch.device, dtype: torch.dtype, block_size: int | None = None,
                 topk: int = 1) -> None:
        super().__init__(block_size or cfg.block_size)
        tcfg = target.config
        if cfg.layers.hidden_size != tcfg.hidden_size:
            raise ValueError(f"DFlash drafter hidden size {cfg.layers.hidden_size} != target's {tcfg.hidden_size}")
        if not 0 <= cfg.mask_token_id < tcfg.vocab_size:
            raise ValueError(f"DFlash mask_token_id {cfg.mask_token_id} outside the target vocabulary")
        if any(not 0 <= i < tcfg.num_layers for i in cfg.target_layer_ids):
            raise ValueError(f"DFlash target_layer_ids {cfg.target_layer_ids} outside the target's layers")
        self.cfg, self.target, self.model, self.device = cfg, target, model, device
        self.tap_layers = tuple(cfg.target_layer_ids)
        # room for the block past the longest context
        self.cache = KVCache(cfg.layers.num_layers, num_slots, context_length + self.block_size,
                             cfg.layers.num_kv_heads, cfg.layers.head_dim, dtype, device)
        self.rope = RotaryTable(cfg.layers.head_dim, cfg.layers.rope_theta, cfg.layers.rope_scaling,
                                context_length + self.block_size, device)
        self.pending: dict[str, tuple[torch.Tensor, int]] = {}  # rid -> (verify-row taps, rows committed)
        self.graphs: dict[int, _DraftGraph] = {}
        # topk > 1: the block's slots' top-k become a tree of block_size - 1 nodes (same verify width)
        k = self.num_proposals
        self.tree = TreeBuilder(topk, k, k, device) if topk > 1 else None
        # a tree takes prompt lookup's proposal as one more path (NgramAssistedDrafter hands it over)
        self.merges_hints = self.tree is not None

    @classmethod
    def from_pretrained(cls, path: str | Path, target: Transformer, num_slots: int, context_length: int,
                        device: torch.device, dtype: torch.dtype, block_size: int | None = None,
                        topk: int = 1) -> DFlashDrafter:
        path = Path(path)
        cfg = read_dflash_config(path)
        return cls(load_dflash_model(path, cfg, device, dtype), cfg, target, num_slots, context_length, device,
                   dtype, block_size, topk)

    # ---- protocol ---------------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, reqs: list[Request], prompt_taps: list[torch.Tensor | None]) -> None:
        """Prompt context is ragged and long: written eagerly, once."""
        feats = torch.cat(prompt_taps)
        positions = [p for t in prompt_taps for p in range(t.shape[0])]
        rows = [r.slot * self.cache.max_len + p for r, t in zip(reqs, prompt_taps) for p in range(t.shape[0])]
        self._write_context(feats, torch.tensor(positions, device=self.device), torch.tensor(rows, device=self.device))

    def commit(self, reqs: list[Request], committed: list[int], verify_taps: list[torch.Tensor | None]) -> None:
        for req, n, taps in zip(reqs, committed, verify_taps):
            self.pending[req.rid] = (taps, n)

    def release(self, req: Request) -> None:
        self.pending.pop(req.rid, None)

    @torch.inference_mode()
    def propose(self, reqs: list[Request], hint: torch.Tensor | None = None) -> Draft:
        """`hint` (tree drafts only): prompt lookup's proposal, [n, K + 1] on the device (a use flag, then
        K tokens per request), merged into each slot's top-k (draft_tree.merge_lookup)."""
        ctx_positions, ctx_rows, feats = self._context_rows(reqs)
        bucket = next((b for b in sorted(self.graphs) if b >= len(reqs)), 0)
        if bucket:
            out = self.graphs[bucket].replay(self, reqs, feats, ctx_positions, ctx_rows, hint)
        else:
            block = self._block_batch(reqs)
            dev = self.device
            out = self._draft_pass(feats, torch.tensor(ctx_positions, device=dev), torch.tensor(ctx_rows, device=dev),
                                   block, hint)
        n = len(reqs)
        if self.tree is None:
            return Draft(out[0][:n], out[1][:n])
        tree = TreeLayout(*(t[:n] for t in out))
        return Draft(tree.tokens, tree=tree)

    # ---- the pass -----------------------------------------------------------------------------
    def _context_rows(self, reqs: list[Request]) -> tuple[list[int], list[int], torch.Tensor]:
        """B context rows per request: the committed verify rows at their positions, the rest (and
        requests with nothing pending) aimed at the scratch slot."""
        B, L, scratch = self.block_size, self.cache.max_len, self.cache.scratch_slot
        positions, rows, feats = [], [], []
        width = len(self.tap_layers) * self.cfg.layers.hidden_size
        for req in reqs:
            taps, n = self.pending.pop(req.rid, (None, 0))
            start = req.cached_len - n
            for j in range(B):
                positions.append(start + j if j < n else j)
                rows.append(req.slot * L + start + j if j < n else scratch * L + j)
            if taps is None:
                taps = self.target.embed_tokens.weight.new_zeros(B, width)
            elif taps.shape[0] < B:  # a verify pass shorter than the block (e.g. requests near their end)
                taps = torch.cat([taps, taps.new_zeros(B - taps.shape[0], width)])
            feats.append(taps[:B])
        return positions, rows, torch.cat(feats)

    def _block_batch(self, reqs: list[Request]) -> ForwardBatch:
        block = [[r.output_ids[-1]] + [self.cfg.mask_token_id] * (self.block_size - 1) for r in reqs]
        return ForwardBatch.build([r.slot for r in reqs], [r.cached_len for r in reqs], block,
                                  self.cache.max_len, self.device, causal=False)

    def _write_context(self, feats: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        ctx = self.model.hidden_norm(self.model.fc(feats))
        for layer in self.model.layers:
            layer.write_context(ctx, positions, rows, self.cache, self.rope)

    def _draft_pass(self, feats: torch.Tensor, ctx_positions: torch.Tensor, ctx_rows: torch.Tensor,
                    block: ForwardBatch, hint: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Append context K/V, then draft: returns argmax tokens and their probabilities, [b, B-1], or
        with a tree builder the tree's tokens, parents, depths and ancestor sets (TreeLayout's fields)."""
        self._write_context(feats, ctx_positions, ctx_rows)
        x, residual = self.target.embed(block.input_ids), None
        for layer in self.model.layers:
            x, residual = layer(x, residual, block, self.cache, self.rope)
        b, B = block.batch_size, self.block_size
        h = self.model.norm.fused(x, residual)[0].view(b, B, -1)[:, 1:].reshape(b * (B - 1), -1)
        probs = torch.softmax(self.target.logits(h), dim=-1)
        if self.tree is not None:
            top, ids = (x.view(b, B - 1, -1) for x in probs.topk(self.tree.topk, dim=-1))
            if hint is not None:
                top, ids = merge_lookup(top, ids, hint, LOOKUP_PROB)
            t = self.tree.build(top, ids)
            return t.tokens, t.parents, t.depths, t.ancestors
        conf, tokens = probs.max(dim=-1)
        return tokens.view(b, B - 1), conf.view(b, B - 1)

    # ---- CUDA graphs --------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, batch_sizes: tuple[int, ...]) -> None:
        max_b = min(max(batch_sizes), self.cache.num_slots)
        pool = GraphBackend.pool(self.device)
        inputs = _StaticInputs(max_b, self.block_size, self.cache, self.device)
        width = len(self.tap_layers) * self.cfg.layers.hidden_size
        feats = torch.zeros(max_b * self.block_size, width, dtype=self.cache.k[0].dtype, device=self.device)
        for b in sorted({min(b, max_b) for b in batch_sizes}, reverse=True):
            self.graphs[b] = _DraftGraph.capture(self, inputs, feats, b, pool)
        GraphBackend.synchronize(self.device)


class _DraftGraph:
    def __init__(self, graph: CapturedPass | EagerReplay, inputs: _StaticInputs, feats: torch.Tensor, b: int) -> None:
        self.graph, self.inputs, self.feats, self.b = graph, inputs, feats, b
        self.outputs: tuple[torch.Tensor, ...] = graph.outputs

    @classmethod
    def capture(cls, drafter: DFlashDrafter, inputs: _StaticInputs, feats: torch.Tensor, b: int,
                pool: tuple) -> _DraftGraph:
        B = drafter.block_size
        block = inputs.batch(b, num_kv_splits=1)
        # context rows' positions and cache rows: one [2, b*B] buffer, one host-to-device copy per step
        ctx_meta = torch.zeros(2, b * B, dtype=torch.int64, device=drafter.device)
        ctx_meta[1] = drafter.cache.scratch_slot * drafter.cache.max_len
        # tree drafts: prompt lookup's hint rows (use flag + tokens), all unused unless a step fills them
        hint = torch.zeros(b, B, dtype=torch.int64, device=drafter.device) if drafter.merges_hints else None
        args = (feats[: b * B], ctx_meta[0], ctx_meta[1], block, hint)
        g = cls(GraphBackend.capture(lambda: drafter._draft_pass(*args), pool), inputs, feats, b)
        g.ctx_meta, g.hint, g.hinted = ctx_meta, hint, False
        return g

    def replay(self, drafter: DFlashDrafter, reqs: list[Request], feats: torch.Tensor, positions: list[int],
               rows: list[int], hint: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        B, n = drafter.block_size, len(reqs)
        block = [[r.output_ids[-1]] + [drafter.cfg.mask_token_id] * (B - 1) for r in reqs]
        self.inputs.fill([r.slot for r in reqs], [r.cached_len for r in reqs], block, self.b)
        scratch = drafter.cache.scratch_slot * drafter.cache.max_len
        pad = (self.b - n) * B
        self.feats[: n * B].copy_(feats)
        meta = torch.tensor([positions + list(range(pad)), rows + [scratch + j % B for j in range(pad)]])
        self.ctx_meta.copy_(meta, non_blocking=True)
        if hint is not None:  # rows past n are padding: their drafts are dropped, whatever they hold
            self.hint[:n].copy_(hint)
            self.hinted = True
        elif self.hinted:  # clear the last hint's use flags once, not every step
            self.hint.zero_()
            self.hinted = False
        self.graph.replay()
        return self.outputs
