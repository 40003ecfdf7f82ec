"""`specpilot convert --format b12`: a Hugging Face model directory rewritten as a B12 checkpoint
(specpilot/formats/checkpoint.py says what one is)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specpilot.formats.b12 import FORMAT_VERSION, TooManyEscapes, encode
from specpilot.formats.checkpoint import FORMAT_KEY, format_note, is_b12_matrix
from specpilot.models.hf_loader import WEIGHTS_INDEX, weight_files


def convert_to_b12(model_dir: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Writes `out_dir`: the model's files, its projection and LM-head matrices as B12 (one safetensors
    file), config.json with the note. A matrix that is not bf16 is converted only when bf16 holds it exactly
    (else a B12Error naming it); one whose escapes would overflow a segment stays bf16 (the note lists it).
    Returns the note, with per-tensor stats."""
    src, dst = Path(model_dir), Path(out_dir)
    config_file = src / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{src}: no config.json (convert takes a Hugging Face model directory)")
    config = json.loads(config_file.read_text())
    if format_note(config) is not None:
        raise ValueError(f"{src} is a B12 checkpoint already")
    if dst.resolve() == src.resolve():
        raise ValueError("--out must be another directory than --model-path")
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(src):
        with safe_open(str(file), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    stored: dict[str, torch.Tensor] = {}
    stats: dict[str, dict[str, float | int]] = {}
    kept: dict[str, str] = {}
    for name, t in tensors.items():
        if not is_b12_matrix(name, t):
            stored[name] = t
            continue
        try:
            b = encode(t, name)
        except TooManyEscapes as err:
            kept[name] = str(err)
            stored[name] = t
            continue
        stored.update(b.tensors(name))
        stats[name] = b.stats()
    weights = sum(s["weights"] for s in stats.values())
    note = {"format": "b12", "version": FORMAT_VERSION, "tensors": sorted(stats),
            "bits_per_weight": sum(s["bits_per_weight"] * s["weights"] for s in stats.values()) / max(weights, 1),
            "escape_rate": sum(s["escapes"] for s in stats.values()) / max(weights, 1), "kept_bf16": kept}
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name not in ("config.json", WEIGHTS_INDEX):
            shutil.copy2(file, dst / file.name)
    save_file(stored, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**config, FORMAT_KEY: note}, indent=2))
    return {**note, "per_tensor": stats}
