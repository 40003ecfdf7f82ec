"""A model drafter whose block is replaced by prompt lookup where the context repeats itself.

Greedy output of small targets falls into repeated stretches (loops, echoed identifiers, restated
text) that a parallel drafter rarely continues past a few slots, while an n-gram lookup copies them
whole. Per request and step: if the context's last n tokens (n >= `min_match`) occurred before, the
tokens that followed them are the draft; otherwise the model drafter's block is (a host lookup, O(max n)
per request). A tree drafter (DFlash with --speculative-eagle-topk > 1) takes the lookup's continuation
into its tree as one more path instead of giving its block up, and looks it up on the device
(device_lookup.py), so its early-launched draft needs no host work. Verification is unchanged, so the
output is the target's own either way. The model drafter still sees every step (its context cache must
follow the committed tokens).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specpilot.drafters.base import Drafter, VerifySource
from specpilot.drafters.device_lookup import DeviceLookup
from specpilot.drafters.ngram import NgramDrafter
from specpilot.state.batch import ForwardBatch
from specpilot.state.draft import Accepted, Draft
from specpilot.state.request import Request
from specpilot.state.transfer import to_device


class NgramAssistedDrafter(Drafter):
    def __init__(self, model: Drafter, min_match: int, max_ngram: int = 4, on_device: bool = True) -> None:
        """`on_device`: a tree drafter that can (Capabilities.device_lookup) looks up on the device; without
        it a tree drafter is not assisted (a chain's tokens would not fit its tree)."""
        if not 1 <= min_match <= max_ngram:
            raise ValueError(f"--speculative-ngram-assist must be between 1 and {max_ngram}, got {min_match}")
        super().__init__(model.block_size)
        self.model, self.min_match = model, min_match
        self.lookup = NgramDrafter(model.block_size, max_ngram=max_ngram, min_ngram=min_match)
        self.name = f"{model.name}+ngram"
        self.tap_layers, self.source = model.tap_layers, model.source
        self.device_lookup: DeviceLookup | None = None
        if on_device and model.capabilities.device_lookup:
            self.device_lookup = model.attach_lookup(min_match, max_ngram)
        self.capabilities = replace(model.capabilities, device_lookup=self.device_lookup is not None)

    @property
    def tree_confidences(self) -> bool:
        return self.model.tree_confidences

    @tree_confidences.setter
    def tree_confidences(self, on: bool) -> None:
        self.model.tree_confidences = on

    def start(self, reqs: list[Request], prompt_taps: list[torch.Tensor | None]) -> None:
        self.model.start(reqs, prompt_taps)

    def propose(self, reqs: list[Request]) -> Draft:
        if self.device_lookup is not None or self.model.capabilities.trees:  # the device looks up, or nobody
            return self.model.propose(reqs)
        draft = self.model.propose(reqs)  # launched first: the lookup overlaps it
        rows, found = [], []
        for req in reqs:
            tokens, n = self.lookup.synced(req).match(self.num_proposals)
            rows.append(tokens)
            found.append(n >= self.min_match)
        if not any(found):
            return draft
        # one asynchronous copy (pinned), so the host does not wait for the model drafter's pass
        lookup = to_device([[int(f), *row] for f, row in zip(found, rows)], draft.tokens.device)
        use = lookup[:, :1].bool()
        tokens = torch.where(use, lookup[:, 1:], draft.tokens)
        confidences = None if draft.confidences is None else torch.where(use, 1.0, draft.confidences)
        return Draft(tokens, confidences, assisted=found)

    def commit(self, reqs: list[Request], committed: list[int], verify_taps: list[torch.Tensor | None]) -> None:
        self.model.commit(reqs, committed, verify_taps)

    def launch_next(self, reqs: list[Request], verify: ForwardBatch, accepted: Accepted,
                    verify_taps: torch.Tensor | None) -> None:
        self.model.launch_next(reqs, verify, accepted, verify_taps)  # the lookup joins when it is finished

    def cancel_launch(self) -> None:
        self.model.cancel_launch()

    def release(self, req: Request) -> None:
        self.model.release(req)
        self.lookup.release(req)
        if self.device_lookup is not None:
            self.device_lookup.release(req)

    def warm(self, max_batch: int) -> None:
        self.model.warm(max_batch)

    def capture(self, batch_sizes: tuple[int, ...], sources: dict[tuple[int, int], VerifySource]) -> None:
        self.model.capture(batch_sizes, sources)

    def static_draft(self, bucket: int) -> Draft | None:
        return self.model.static_draft(bucket)
