"""One generation request's state as it moves through the engine."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from specpilot.config import SamplingParams

_ids = itertools.count()


@dataclass(frozen=True)
class TokenLogprob:
    """One output position's logprobs: of the token committed there, of the most likely ids (most likely
    first) and of the ids the request named, each as (logprob, id)."""

    logprob: float
    top: list[tuple[float, int]]
    named: list[tuple[float, int]]


# eq=False: a request is itself, not its fields (finding one among the running compared prompts token by token)
@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: dict[str, Any] | None = None
    # keyed sampling's seed (engine/sampling.py): the request's, or one drawn for it (meta_info reports it)
    sampling_seed: int = 0
    created: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finished_time: float | None = None
    # speculative decoding statistics: tokens committed per verify pass
    accept_lengths: list[int] = field(default_factory=list)
    # how each output token came, parallel to output_ids (metadata only: it never changes a token):
    # "target" (prefill or plain decode), "draft" (an accepted draft), "ngram" (an accepted draft that
    # n-gram assist's lookup supplied), "bonus" (the target's own token that ends a verify pass)
    token_origins: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # parallel to output_ids, with return_logprob
    # the prompt's, from params.logprob_start_len on (None at position 0, which nothing predicts)
    input_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # a request of the same prompt whose prefill this one copies where both are admitted in one step (n > 1)
    prefill_from: Request | None = field(default=None, repr=False)
    # its structured-output constraint's state (engine/grammar.py RequestGrammar), advanced with each token
    grammar: Any = field(default=None, repr=False)
    stop_ids: frozenset[int] | None = field(default=None, repr=False)  # StopChecker's, on first use

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cached_len(self) -> int:
        """Tokens whose K/V are in the cache: everything but the newest sampled token."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def e2e_latency(self) -> float:
        end = self.finished_time if self.finished_time is not None else time.perf_counter()
        return end - self.created

    def meta_info(self) -> dict[str, Any]:
        """SGLang's meta_info, with the speculative fields when the request speculated."""
        info = {"id": self.rid, "prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.output_ids),
                "finish_reason": self.finish_reason, "e2e_latency": round(self.e2e_latency, 6),
                "token_origins": list(self.token_origins)}
        if not self.params.greedy:
            info["sampling_seed"] = self.sampling_seed
        if self.accept_lengths:
            hist = [0] * (max(self.accept_lengths) + 1)
            for n in self.accept_lengths:
                hist[n] += 1
            info |= {"spec_verify_ct": len(self.accept_lengths),
                     "spec_accept_length": len(self.output_ids) / len(self.accept_lengths),
                     "spec_accept_histogram": hist}
        return info
