"""What every drafter offers the speculative loop."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from specpilot.models.checkpoint import Checkpoint
from specpilot.models.transformer import Transformer
from specpilot.state.batch import ForwardBatch
from specpilot.state.draft import Accepted, Draft
from specpilot.state.pages import PageTable
from specpilot.state.request import Request

if TYPE_CHECKING:
    from specpilot.drafters.device_lookup import DeviceLookup

# what a drafter's graphs read of the engine's verify and acceptance graphs of one bucket
VerifySource = tuple[ForwardBatch, Accepted, torch.Tensor | None]


class DraftTarget(Protocol):
    """What a drafter that embeds and projects through the target's own vocabulary (DFlash) reads of it:
    our Transformer, or the head of a target another engine runs (specpilot.sglang_ext.session)."""

    @property
    def config(self) -> TargetShape: ...

    @property
    def embed_tokens(self) -> nn.Module: ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class TargetShape(Protocol):
    """The target's shapes a drafter checks itself against."""

    hidden_size: int
    vocab_size: int
    num_layers: int


@dataclass(frozen=True)
class Capabilities:
    """What a drafter offers beyond `propose` / `commit`, declared so the engine and the registry's
    preconditions (engine/registry.py) never probe for methods."""

    early_launch: bool = False  # `launch_next` / `cancel_launch`: the next draft starts before the host syncs
    trees: bool = False  # its drafts may carry a TreeLayout
    confidences: bool = False  # its drafts carry per-token confidences
    device_lookup: bool = False  # `attach_lookup`: takes prompt lookup on the device into its trees
    graphs: bool = False  # `capture`: its passes run as CUDA graphs


@dataclass(frozen=True)
class DrafterContext:
    """What a drafter is built against: the target's model and checkpoint, where it runs, the page table
    its own caches take their slots and pages from (the target's), and the context length they must hold."""

    model: Transformer
    checkpoint: Checkpoint
    device: torch.device
    dtype: torch.dtype
    pages: PageTable
    context_length: int


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
    capabilities = Capabilities()
    # a tree drafter's drafts carry node confidences (set by the engine where `two-level` reads them)
    tree_confidences = False

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

    # ---- declared by `capabilities` -----------------------------------------------------------------
    def launch_next(self, reqs: list[Request], verify: ForwardBatch, accepted: Accepted,
                    verify_taps: torch.Tensor | None) -> None:
        """early_launch: instead of `commit` after a device acceptance, start the next draft on the device
        before the host has seen this step's tokens. `verify`: the verify pass's batch (its first
        len(reqs) requests are `reqs`), `accepted` its acceptance, `verify_taps` its taps with accepted
        rows first. The next `propose` for these requests finishes this draft instead of drafting anew."""
        raise NotImplementedError(f"{self.name} does not launch early")

    def cancel_launch(self) -> None:
        """early_launch: the host committed other tokens than the launched draft assumed; draft anew."""
        raise NotImplementedError(f"{self.name} does not launch early")

    def attach_lookup(self, min_n: int, max_n: int) -> DeviceLookup:
        """device_lookup: look up n-grams of min_n..max_n tokens on the device and merge the lookup's
        proposal into the draft trees; returns the lookup (its owner releases requests from it)."""
        raise NotImplementedError(f"{self.name} takes no device lookup")

    def warm(self, max_batch: int) -> None:
        """Without graphs, on a device whose kernels compile on first use: compile now whatever the eager passes
        for 1..max_batch requests will launch, so that no step pays for a compile. Nothing by default (a drafter
        whose launches do not change with its batch)."""

    def capture(self, batch_sizes: tuple[int, ...], sources: dict[tuple[int, int], VerifySource]) -> None:
        """graphs: capture the drafter's passes per batch-size bucket; `sources` ((verify width, bucket) -> the
        static verify batch, acceptance and ordered taps of the engine's graphs) lets an early launch read them."""
        raise NotImplementedError(f"{self.name} has no CUDA graphs")

    def static_draft(self, bucket: int) -> Draft | None:
        """graphs: the outputs of a bucket's graph as a Draft of all its rows (the step's placement graph
        reads them), where its drafts are such outputs; None otherwise."""
        raise NotImplementedError(f"{self.name} has no CUDA graphs")
