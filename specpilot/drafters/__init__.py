"""Drafters: DFlash block drafter, PARD mask-token drafter, n-gram prompt lookup."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from specpilot.drafters.base import Drafter, DrafterContext
from specpilot.state.draft import Draft

if TYPE_CHECKING:
    from specpilot.engine.config import EngineConfig

ALGORITHMS = ("dflash", "pard", "ngram")
DEFAULT_BLOCK = {"pard": 9, "ngram": 8}
# DFlash's default block is the checkpoint's, except for chains on CPU, where a verify pass of many
# tokens costs about two decode steps and the shipped drafter's chain is fastest at 4 (docs/RESULTS.md).
DFLASH_CPU_BLOCK = 4
# The DFlash drafter trained for the embedded SmolLM2-135M-Instruct (`specpilot train-drafter`, README),
# shipped with the package: --speculative-algorithm dflash on the embedded model needs no draft path.
EMBEDDED_DRAFTER = Path(__file__).parent / "assets" / "smollm2-135m-dflash"
SHIPPED_DRAFTER = "shipped"  # the name tools give EMBEDDED_DRAFTER (train-drafter --init-from, tau_sweep.py --draft)


def default_draft_model_path(config: EngineConfig, engine: DrafterContext, alg: str) -> str:
    """--speculative-draft-model-path, else the shipped drafter when the target is the embedded model."""
    if config.speculative_draft_model_path is not None:
        return config.speculative_draft_model_path
    if alg == "dflash" and _is_embedded(engine):
        if not (EMBEDDED_DRAFTER / "model.safetensors").is_file():
            raise ValueError(f"the embedded model's DFlash drafter is missing from the package ({EMBEDDED_DRAFTER}); "
                             f"reinstall specpilot or pass --speculative-draft-model-path")
        return str(EMBEDDED_DRAFTER)
    embedded = " (only the embedded model has a shipped DFlash drafter)" if alg == "dflash" else ""
    raise ValueError(f"--speculative-algorithm {alg} needs --speculative-draft-model-path{embedded}")


def _is_embedded(engine: DrafterContext) -> bool:
    from specpilot.models.checkpoint import embedded_default_path

    try:
        return Path(engine.checkpoint.source) == embedded_default_path()
    except FileNotFoundError:
        return False


def build_drafter(config: EngineConfig, engine: DrafterContext) -> Drafter:
    alg = (config.speculative_algorithm or "").lower()
    if alg not in ALGORITHMS:
        raise ValueError(f"--speculative-algorithm must be one of {', '.join(ALGORITHMS)}, got {alg!r}")
    block = config.speculative_num_draft_tokens
    # the tunables' domains and preconditions (tree top-k, n-gram assist) are the registry's, checked
    # by the engine before it builds the drafter (engine/registry.py check_tunables)
    if alg == "ngram":
        from specpilot.drafters.ngram import NgramDrafter

        return NgramDrafter(block or DEFAULT_BLOCK["ngram"])
    drafter = _model_drafter(config, engine, alg, block)
    if config.speculative_ngram_assist:
        from specpilot.drafters.ngram_assist import NgramAssistedDrafter

        # a tree drafter looks prompt lookup up on the device unless the mechanisms asked for leave it out
        on_device = config.leaves_open("device-lookup")
        return NgramAssistedDrafter(drafter, config.speculative_ngram_assist, on_device=on_device)
    return drafter


def _model_drafter(config: EngineConfig, engine: DrafterContext, alg: str, block: int | None) -> Drafter:
    path = default_draft_model_path(config, engine, alg)
    if alg == "dflash":
        from specpilot.drafters.dflash import DFlashDrafter
        from specpilot.drafters.dflash_model import read_dflash_config

        if block is None and engine.device.type == "cpu" and config.speculative_eagle_topk == 1:
            block = min(DFLASH_CPU_BLOCK, read_dflash_config(Path(path)).block_size)
        drafter = DFlashDrafter.from_pretrained(path, engine.model, engine.pages, engine.context_length,
                                                engine.device, engine.dtype, block_size=block,
                                                topk=config.speculative_eagle_topk,
                                                lookup_prob=config.speculative_lookup_prob,
                                                num_kv_splits=config.attention_kv_splits)
    else:
        from specpilot.drafters.pard import PardDrafter

        drafter = PardDrafter(path, engine.checkpoint.config, engine.pages, engine.context_length,
                              engine.device, engine.dtype, block_size=block or DEFAULT_BLOCK["pard"])
    drafter.source = str(path)
    return drafter


__all__ = ["ALGORITHMS", "DFLASH_CPU_BLOCK", "EMBEDDED_DRAFTER", "Draft", "Drafter", "build_drafter",
           "default_draft_model_path"]
