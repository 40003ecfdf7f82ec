"""A trained drafter grown into a larger shape that drafts exactly as it did: more layers, a wider MLP, more
target taps. Training then starts at the smaller drafter's quality, so shapes compare on equal footing
(`train-drafter --init-from` with other shapes) without each one first relearning what the shipped drafter knows.

What is new starts silent: an added layer's attention output and MLP output projections are zero (the layer passes
its residual through), an added MLP unit's output column is zero, an added tap's input columns are zero. Everything
else new keeps the run's random initialisation, so gradients reach it once the zero projections move.
"""

from __future__ import annotations

import torch

from specpilot.drafters.dflash_model import DFlashConfig, DFlashModel

# The layer shapes a grown drafter shares with its source (besides the mask token and the block)
FIXED_SHAPES = ("hidden_size", "num_heads", "num_kv_heads", "head_dim")


def growth_mismatches(have: DFlashConfig, want: DFlashConfig) -> list[str]:
    """Why `have` cannot grow into `want` (empty when it can): each as 'what (have's against want's)'."""
    why = [f"{k} ({getattr(have.layers, k)} against {getattr(want.layers, k)})"
           for k in FIXED_SHAPES if getattr(have.layers, k) != getattr(want.layers, k)]
    why += [f"{k} ({getattr(have, k)} against {getattr(want, k)})"
            for k in ("mask_token_id", "block_size") if getattr(have, k) != getattr(want, k)]
    why += [f"{k} ({getattr(have.layers, k)} against {getattr(want.layers, k)}: a drafter only grows)"
            for k in ("num_layers", "intermediate_size") if getattr(have.layers, k) > getattr(want.layers, k)]
    missing = sorted(set(have.target_layer_ids) - set(want.target_layer_ids))
    if missing:
        why.append(f"target_layer_ids ({have.target_layer_ids} against {want.target_layer_ids}: "
                   f"{missing} not tapped by this run)")
    return why


@torch.no_grad()
def grow_drafter(model: DFlashModel, source: DFlashModel, have: DFlashConfig, want: DFlashConfig) -> None:
    """Write `source` (shaped `have`) into `model` (shaped `want`, freshly initialised) so that both draft the
    same logits (the same shapes: a copy); `growth_mismatches(have, want)` must be empty."""
    hidden = want.layers.hidden_size
    model.fc.weight.zero_()
    for i, layer_id in enumerate(have.target_layer_ids):
        j = want.target_layer_ids.index(layer_id)
        model.fc.weight[:, j * hidden:(j + 1) * hidden] = source.fc.weight[:, i * hidden:(i + 1) * hidden]
    model.hidden_norm.weight.copy_(source.hidden_norm.weight)
    model.norm.weight.copy_(source.norm.weight)
    width, have_width = want.layers.intermediate_size, have.layers.intermediate_size
    for grown, old in zip(model.layers, source.layers, strict=False):
        sizes = {name: t for name, t in old.state_dict().items() if not name.startswith("mlp.")}
        grown.load_state_dict(sizes, strict=False)
        gate, up = old.mlp.gate_up_proj.weight.split(have_width)  # fused rows: gate's units, then up's
        grown.mlp.gate_up_proj.weight[:have_width] = gate
        grown.mlp.gate_up_proj.weight[width:width + have_width] = up
        grown.mlp.down_proj.weight[:, have_width:] = 0
        grown.mlp.down_proj.weight[:, :have_width] = old.mlp.down_proj.weight
    for added in model.layers[have.layers.num_layers:]:
        added.self_attn.o_proj.weight.zero_()
        added.mlp.down_proj.weight.zero_()
