"""User-facing configuration objects."""

from __future__ import annotations

import math
import os
import pathlib
from dataclasses import dataclass, field


def cache_root() -> pathlib.Path:
    """Where SpecPilot keeps what it computes once per machine: $SPECPILOT_CACHE_DIR, else
    $XDG_CACHE_HOME/specpilot (default ~/.cache/specpilot)."""
    if os.environ.get("SPECPILOT_CACHE_DIR"):
        return pathlib.Path(os.environ["SPECPILOT_CACHE_DIR"])
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "specpilot"


CONSTRAINTS = ("json_schema", "regex", "ebnf")


@dataclass
class SamplingParams:
    """SGLang's sampling keys. temperature 0 (or top_k 1) is greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    # logprobs of the target's distribution at each output position (after the request's bans); they never
    # change a token
    return_logprob: bool = False
    top_logprobs_num: int = 0  # the most likely ids per position, with return_logprob
    token_ids_logprob: list[int] = field(default_factory=list)  # these ids' logprobs per position, likewise
    logprob_start_len: int = -1  # >= 0: the prompt's own logprobs too, from this position on (-1: none)
    # structured output (at most one): the output follows a JSON schema, a regex or an EBNF grammar
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        checks = [
            ("max_new_tokens", isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0, "an integer >= 0"),
            ("temperature", _finite(self.temperature) and self.temperature >= 0, "a number >= 0"),
            ("top_p", _finite(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, int), "an integer (<= 0 disables it)"),
            ("min_p", _finite(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
            ("seed", self.seed is None or isinstance(self.seed, int), "an integer"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "a list of non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "a list of token ids >= 0"),
            ("min_new_tokens", isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens,
             "an integer >= 0"),
            ("top_logprobs_num", isinstance(self.top_logprobs_num, int) and self.top_logprobs_num >= 0,
             "an integer >= 0"),
            ("token_ids_logprob", all(isinstance(t, int) and t >= 0 for t in self.token_ids_logprob),
             "a list of token ids >= 0"),
            ("logprob_start_len", isinstance(self.logprob_start_len, int) and self.logprob_start_len >= -1,
             "an integer >= -1"),
        ]
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"sampling param {name} must be {what}, got {getattr(self, name)!r}")
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of json_schema, regex and ebnf, got {' and '.join(given)}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})")

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, spec) of the structured-output constraint, if any."""
        return next(((name, getattr(self, name)) for name in CONSTRAINTS if getattr(self, name) is not None), None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
