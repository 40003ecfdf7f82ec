"""Drafters: DFlash block drafter, PARD mask-token drafter, n-gram prompt lookup."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specpilot.drafters.base import Draft, Drafter

if TYPE_CHECKING:
    from specpilot.engine.engine import Engine, EngineConfig

ALGORITHMS = ("dflash", "pard", "ngram")
DEFAULT_BLOCK = {"pard": 9, "ngram": 8}


def build_drafter(config: EngineConfig, engine: Engine) -> Drafter:
    alg = (config.speculative_algorithm or "").lower()
    if alg not in ALGORITHMS:
        raise ValueError(f"--speculative-algorithm must be one of {', '.join(ALGORITHMS)}, got {alg!r}")
    block = config.speculative_num_draft_tokens
    if alg == "ngram":
        from specpilot.drafters.ngram import NgramDrafter

        return NgramDrafter(block or DEFAULT_BLOCK["ngram"])
    path = config.speculative_draft_model_path
    if path is None:
        raise ValueError(f"--speculative-algorithm {alg} needs --speculative-draft-model-path")
    if alg == "dflash":
        from specpilot.drafters.dflash import DFlashDrafter

        return DFlashDrafter.from_pretrained(path, engine.model, config.max_running_requests, engine.context_length, engine.device,
                             engine.dtype, block_size=block)
    from specpilot.drafters.pard import PardDrafter

    return PardDrafter(path, engine.checkpoint.config, config.max_running_requests, engine.context_length,
                       engine.device, engine.dtype, block_size=block or DEFAULT_BLOCK["pard"])


__all__ = ["ALGORITHMS", "Draft", "Drafter", "build_drafter"]
