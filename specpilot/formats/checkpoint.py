"""B12 checkpoints: a Hugging Face model directory whose projection and LM-head matrices are stored as B12
planes (specpilot/formats/b12.py) in its safetensors, with a format note in config.json naming them. Norms,
biases and embeddings stay as they were (the model reads only a few embedding rows a step). Loading decodes
the planes back to the exact bf16 tensors; models/convert.py writes them.
"""

from __future__ import annotations

from typing import Any

import torch

from specpilot.formats.b12 import FORMAT_VERSION, B12Tensor, decode

FORMAT_KEY = "specpilot_weight_format"


def is_b12_matrix(name: str, t: torch.Tensor) -> bool:
    """What B12 stores: the 2-D projection weights and the LM head."""
    return t.dim() == 2 and name.endswith(".weight") and ("proj" in name or name.startswith("lm_head"))


def format_note(config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's B12 note, if the checkpoint is one (None for plain weights)."""
    note = config.get(FORMAT_KEY)
    if note is None:
        return None
    if note.get("format") != "b12" or note.get("version") != FORMAT_VERSION:
        raise ValueError(f"unknown weight format {note!r} in config.json (this build reads b12 version "
                         f"{FORMAT_VERSION}; convert the bf16 checkpoint again)")
    return note


def decode_state(tensors: dict[str, torch.Tensor], note: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state dict with every B12 tensor the note names decoded to bf16 (its planes dropped)."""
    out = {k: v for k, v in tensors.items() if ".b12_" not in k}
    for name in note["tensors"]:
        out[name] = decode(B12Tensor.from_tensors(tensors, name))
    return out
