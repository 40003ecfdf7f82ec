"""Tiny drafter checkpoints in the published formats, and an oracle drafter for exact acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny_models import tiny_hf_model

from specpilot.drafters.base import Drafter
from specpilot.state.draft import Draft
from specpilot.state.request import Request
from specpilot.state.tree import TreeLayout


def write_random_dflash(path: Path, hidden: int, num_target_layers: int, mask_token_id: int,
                        num_layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                        intermediate: int = 128, block_size: int = 8, taps: list[int] | None = None,
                        seed: int = 0) -> Path:
    """A DFlash checkpoint as z-lab publishes them: config.json + model.safetensors, no prefix."""
    taps = taps or sorted({1, num_target_layers // 2, max(num_target_layers - 2, 0)})
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    t = {"fc.weight": w(hidden, len(taps) * hidden), "hidden_norm.weight": norm(hidden), "norm.weight": norm(hidden)}
    for i in range(num_layers):
        p = f"layers.{i}."
        t |= {
            p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim),
            p + "mlp.gate_proj.weight": w(intermediate, hidden), p + "mlp.up_proj.weight": w(intermediate, hidden),
            p + "mlp.down_proj.weight": w(hidden, intermediate),
        }
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": num_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "num_target_layers": num_target_layers, "block_size": block_size, "hidden_act": "silu",
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": taps},
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_random_pard(path: Path, pard_token: int, seed: int = 1, vocab_size: int | None = None) -> Path:
    """A PARD drafter: an HF causal LM of the target's family whose config carries pard_token."""
    model = tiny_hf_model("llama", seed=seed, vocab_size=vocab_size)
    model.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["pard_token"] = pard_token
    cfg["spd_type"] = "pard"
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


class OracleDrafter(Drafter):
    """Proposes the target's own continuation (known from a stock run), wrong from draft position
    `first_error` on (counting from 0), so every step accepts exactly min(first_error, K) drafts. `tree`: a
    draft tree of a decoy child of the root (node 1) beside the chain of K - 1 (nodes 2..K, each a row below its
    depth), so accepting any of the chain moves its K/V (min(first_error, K - 1) accepted a step)."""

    name = "oracle"

    def __init__(self, block_size: int, stock: dict[str, list[int]], first_error: int, vocab: int,
                 tree: bool = False, device: torch.device | str = "cpu") -> None:
        super().__init__(block_size)
        self.stock, self.first_error, self.vocab, self.tree = stock, first_error, vocab, tree
        self.device = torch.device(device)  # where its drafts are made, as a drafter on the engine's device does

    def propose(self, reqs: list[Request]) -> Draft:
        drafts = []
        for r in reqs:
            ref = self.stock[r.rid]
            n = len(r.output_ids)
            cont = ref[n : n + self.num_proposals]
            cont = cont + [0] * (self.num_proposals - len(cont))
            drafts.append([t if j < self.first_error else (t + 1) % self.vocab for j, t in enumerate(cont)])
        tokens = torch.tensor(drafts, dtype=torch.int64, device=self.device)
        if not self.tree:
            return Draft(tokens)
        n, k = tokens.shape
        tokens = torch.cat([(tokens[:, :1] + 1) % self.vocab, tokens[:, :-1]], dim=1)
        parents = torch.tensor([0, 0, *range(2, k)], device=self.device)
        nodes = torch.arange(k + 1, device=self.device)
        ancestors = torch.where(nodes < 2, (1 << (nodes + 1)) - 1, (1 << (nodes + 1)) - 1 - 2)  # node j: 0, 2..j
        depths = torch.tensor([1, *range(1, k)], device=self.device)
        return Draft(tokens, tree=TreeLayout(tokens, parents.expand(n, k), depths.expand(n, k),
                                             ancestors.expand(n, k + 1)))
