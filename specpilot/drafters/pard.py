"""PARD mask-token drafter: a small causal LM of the target's family whose config names a
`pard_token`. One forward over [tokens committed since its last pass, mask x (K-1)] yields K drafts
(the last K positions' argmax). Its cache keeps committed tokens only: mask positions lie past its
length and are overwritten next pass."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specpilot.drafters.base import Capabilities, Drafter
from specpilot.kernels.softmax_topk import softmax_topk
from specpilot.models.build import build_model
from specpilot.models.checkpoint import load_checkpoint
from specpilot.models.config import ModelConfig
from specpilot.models.runner import ModelRunner
from specpilot.state.cache import KVCache
from specpilot.state.pages import PageTable
from specpilot.state.draft import Draft
from specpilot.state.request import Request


def read_pard_token(path: Path) -> int:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"PARD drafter {path}: no config.json")
    raw = json.loads(cfg_file.read_text())
    if "pard_token" not in raw:
        raise ValueError(f"{cfg_file}: no 'pard_token' key; not a PARD drafter")
    return int(raw["pard_token"])


class PardDrafter(Drafter):
    name = "pard"
    capabilities = Capabilities(confidences=True)

    def __init__(self, path: str | Path, target_config: ModelConfig, pages: PageTable, context_length: int,
                 device: torch.device, dtype: torch.dtype, block_size: int = 9) -> None:
        super().__init__(block_size)
        path = Path(path)
        self.pard_token = read_pard_token(path)
        ckpt = load_checkpoint(path, dtype=dtype)
        if ckpt.config.vocab_size > target_config.vocab_size + 1024 or not 0 <= self.pard_token < ckpt.config.vocab_size:
            raise ValueError(f"PARD drafter {path}: vocabulary {ckpt.config.vocab_size} does not fit the target's "
                             f"{target_config.vocab_size} (pard_token {self.pard_token})")
        self.target_vocab = target_config.vocab_size
        self.model = build_model(ckpt, device, dtype)
        length = context_length + block_size
        self.model.setup_rope(length)
        cfg = ckpt.config
        self.cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, pages)  # the target's slots and pages
        self.runner = ModelRunner(self.model, self.cache, device)
        self.draft_len: dict[str, int] = {}

    def propose(self, reqs: list[Request]) -> Draft:
        k = self.num_proposals
        starts = [self.draft_len.get(r.rid, 0) for r in reqs]
        inputs = [r.all_ids[s:] + [self.pard_token] * (k - 1) for r, s in zip(reqs, starts)]
        out = self.runner.forward([r.slot for r in reqs], starts, inputs)
        rows, offset = [], 0
        for r, toks in zip(reqs, inputs):
            offset += len(toks)
            rows.append(torch.arange(offset - k, offset))
            self.draft_len[r.rid] = len(r.all_ids)
        logits = out.logits[torch.cat(rows).to(out.logits.device)][:, : self.target_vocab]
        conf, tokens = softmax_topk(logits, 1)
        return Draft(tokens.view(len(reqs), k), conf.view(len(reqs), k))

    def release(self, req: Request) -> None:
        self.draft_len.pop(req.rid, None)
