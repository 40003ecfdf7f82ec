"""Our DFlash drafter beside a target that another engine runs (SGLang's scheduler: worker.py).

That engine owns the requests, the target and the target's KV cache. Per step it hands the drafter, keyed
by request id, what it needs:

- after a prefill (or a chunk of one): the target's taps of the tokens it ran, and the position they start at;
- before a verify: each request's tokens so far (the engine's own, copied into the request's mirror, never changed);
- after the verify: the acceptance over the verify's rows (state.draft.Accepted) and those rows' taps.

The drafter keeps its context K/V in a slot of its own page table per request, with pages for as many positions
as the request may reach (the engine says how many). A request the engine has finished gives its slot back
(`release`); where slots or pages run out, the requests least recently seen give theirs up. Drafts never decide
a token, so a lost context costs acceptance, never correctness.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.config import SamplingParams
from specpilot.drafters.base import Drafter
from specpilot.drafters.dflash import DFlashDrafter
from specpilot.drafters.ngram_assist import NgramAssistedDrafter
from specpilot.state.draft import Accepted, Draft
from specpilot.state.pages import PageTable
from specpilot.state.request import Request

# slots beyond the engine's running requests: room for those it finished without telling (a request that ended
# at its prefill), until the least recently seen gives its slot up
SPARE_SLOTS = 8


@dataclass(frozen=True)
class HeadShape:
    hidden_size: int
    vocab_size: int
    num_layers: int


@dataclass(frozen=True)
class TargetHead:
    """The target's embedding and LM head as the drafter reads them (drafters.base.DraftTarget).

    `gather`: under tensor parallelism, what joins the ranks' vocabulary shards of a logits row (each rank
    holds a slice of the LM head); the joined row may be padded past the vocabulary, which is cut off."""

    config: HeadShape
    embed_tokens: nn.Module
    lm_head_weight: torch.Tensor
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def of_causal_lm(cls, model: nn.Module, gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> TargetHead:
        """From a causal LM laid out as `model.model.embed_tokens` and `model.lm_head` (SGLang's and
        transformers' Llama and Qwen classes), whose config gives the shapes."""
        config = model.config
        shape = HeadShape(config.hidden_size, config.vocab_size, config.num_hidden_layers)
        return cls(shape, model.model.embed_tokens, model.lm_head.weight, gather)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.lm_head_weight)
        if self.gather is not None:
            logits = self.gather(logits)
        return logits[:, : self.config.vocab_size].float()


class DraftSession:
    def __init__(self, drafter: Drafter, dflash: DFlashDrafter, pages: PageTable) -> None:
        """`drafter` proposes and commits (the DFlash drafter, or it with n-gram assist); `dflash` is the
        model drafter inside it, whose context the prefills write."""
        self.drafter, self.dflash, self.pages = drafter, dflash, pages
        self.requests: OrderedDict[str, Request] = OrderedDict()  # least recently seen first

    @classmethod
    def load(cls, path: str | Path, target: TargetHead, max_requests: int, context_length: int,
             device: torch.device, dtype: torch.dtype, block_size: int, topk: int, ngram_assist: int,
             pool_tokens: int | None = None) -> DraftSession:
        """`pool_tokens`: positions the drafter's cache holds over all requests (None: every slot's whole
        context; the engine's own KV pool bounds what its requests reach at once)."""
        pages = PageTable(max_requests + SPARE_SLOTS, context_length + block_size, pool_tokens, device)
        dflash = DFlashDrafter.from_pretrained(path, target, pages, context_length, device, dtype,
                                               block_size=block_size, topk=topk)
        drafter: Drafter = NgramAssistedDrafter(dflash, ngram_assist) if ngram_assist else dflash
        return cls(drafter, dflash, pages)

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.dflash.tap_layers

    def prefill(self, rids: Sequence[str], prompts: Sequence[list[int]], outputs: Sequence[list[int]],
                starts: Sequence[int], lengths: Sequence[int], taps: torch.Tensor, reach: Sequence[int]) -> None:
        """The target ran `lengths[i]` tokens of request i from position `starts[i]` (its prompt, a chunk of
        it, or after a retraction its prompt and outputs again); `taps` [sum(lengths), width] in that order.
        `reach[i]`: the positions request i may reach (its prompt, its new tokens and a block)."""
        reqs = []
        for rid, prompt, output, start, positions in zip(rids, prompts, outputs, starts, reach):
            req = self._request(rid, prompt, output, positions, rids)
            if start == 0:  # a new request, or one prefilled again: nothing drafted for it before holds
                self.drafter.release(req)
            reqs.append(req)
        self.dflash.extend_context(reqs, list(taps.split(list(lengths))), list(starts))

    def propose(self, rids: Sequence[str], prompts: Sequence[list[int]], outputs: Sequence[list[int]],
                reach: Sequence[int]) -> Draft:
        """The drafts of the next verify: `outputs[i]`'s last token is the block's first."""
        return self.drafter.propose([self._request(rid, p, o, n, rids)
                                     for rid, p, o, n in zip(rids, prompts, outputs, reach)])

    def commit(self, rids: Sequence[str], accepted: Accepted, verify_taps: torch.Tensor) -> list[list[int]]:
        """After the verify of `propose`'s drafts: `accepted` over its rows, `verify_taps` [n * rows, width]
        in row order. Returns each request's committed tokens."""
        n, rows = accepted.nodes.shape
        counts = accepted.counts.tolist()
        tokens = [t[:c] for t, c in zip(accepted.tokens.tolist(), counts)]
        # the committed rows first: the drafter writes context from a request's first `count` rows
        order = (accepted.nodes + rows * torch.arange(n, device=accepted.nodes.device)[:, None]).flatten()
        ordered = verify_taps.index_select(0, order.to(verify_taps.device)).view(n, rows, -1)
        reqs = [self.requests[rid] for rid in rids]
        for req, new in zip(reqs, tokens):
            req.output_ids.extend(new)  # the mirror's own copy (_request): SGLang appends to its ids after the step
        self.drafter.commit(reqs, counts, list(ordered.unbind(0)))
        return tokens

    def release(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is not None:
            self.drafter.release(req)
            self.pages.free(req.slot)

    def _request(self, rid: str, prompt: list[int], output: list[int], reach: int, busy: Sequence[str]) -> Request:
        """The mirror of request `rid`, given a slot with pages for `reach` positions where it has none: the
        least recently seen requests not among `busy` (this call's) give theirs up while they are short."""
        req = self.requests.get(rid)
        if req is None:
            idle = [r for r in self.requests if r not in busy]
            while not self.pages.can_hold(reach) and idle:
                self.release(idle.pop(0))
            # SGLang's Req holds its ids as array("q"): the mirror keeps lists, which the drafters concatenate
            req = self.requests[rid] = Request(prompt_ids=list(prompt), params=SamplingParams(), rid=rid,
                                               slot=self.pages.allocate(reach))
        self.requests.move_to_end(rid)
        req.output_ids = list(output)
        return req
