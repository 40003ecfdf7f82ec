"""What every drafter offers the speculative loop."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from specpilot.state.draft import Draft
from specpilot.state.request import Request


class Drafter(ABC):
    """A drafter proposes `block_size - 1` tokens per request in one pass; the target then verifies a
    block of `block_size` tokens (the newest committed token and the drafts).

    Protocol, per request: `start` after the target's prefill (with the prompt's taps), then each step
    `propose` and, after verification, `commit` with the number of tokens committed and the taps of the
    target's verify rows (the newest committed token first). `release` when the request ends.
    """

    name: str = "drafter"
    tap_layers: tuple[int, ...] = ()  # target layers whose outputs the drafter consumes
    source: str | None = None  # the checkpoint directory it was loaded from, if any
    # True: offers `launch_next(reqs, verify_batch, accepted, verify_taps)` (the next draft launched on
    # the device after a greedy verify, in place of `commit`) and `cancel_launch()` (DFlashDrafter's)
    launches_early: bool = False

    def __init__(self, block_size: int) -> None:
        if block_size < 2:
            raise ValueError(f"--speculative-num-draft-tokens (block size) must be >= 2, got {block_size}")
        self.block_size = block_size

    @property
    def num_proposals(self) -> int:
        return self.block_size - 1

    def start(self, reqs: list[Request], prompt_taps: list[torch.Tensor | None]) -> None:
        """Called once per request after prefill; prompt_taps[i]: [prompt_len, n_taps * H] or None."""

    @abstractmethod
    def propose(self, reqs: list[Request]) -> Draft: ...

    def commit(self, reqs: list[Request], committed: list[int], verify_taps: list[torch.Tensor | None]) -> None:
        """`committed[i]` tokens of request i were accepted this step (the newest one last in
        req.output_ids); verify_taps[i]: the taps of all of request i's verify rows, of which the first
        committed[i] belong to tokens now in the target's cache. Graph outputs: use before the next pass."""

    def release(self, req: Request) -> None:
        """Free whatever the drafter holds for this request."""
