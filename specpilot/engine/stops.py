"""When a request is done: stop ids, stop strings, a finished grammar, lengths (SGLang's finish_reason)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from specpilot.state.request import Request


class StopChecker:
    """Decides after each appended token whether a request is done (SGLang's finish_reason)."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_len = max_len

    def stop_ids(self, req: Request) -> frozenset[int]:
        if req.stop_ids is None:  # computed once: every appended token and every verify row asks
            ids = frozenset(req.params.stop_token_ids)
            req.stop_ids = ids if req.params.ignore_eos else ids | self.eos_token_ids
        return req.stop_ids

    def bans(self, reqs: Iterable[Request]) -> bool:
        """Whether some request bans an id at its next position (stop ids, min_new_tokens not reached): else every
        `banned` row is empty, which a batch learns without a list per request."""
        return any(r.params.min_new_tokens > len(r.output_ids) and self.stop_ids(r) for r in reqs)

    def banned(self, req: Request, rows: int) -> list[list[int]]:
        """For output positions len(output) + j, j < rows: the ids that may not be chosen there (the stop
        ids, until min_new_tokens)."""
        short = req.params.min_new_tokens - len(req.output_ids)
        if short <= 0:
            return [[]] * rows
        stop = sorted(self.stop_ids(req))
        return [stop if j < short else [] for j in range(rows)]

    def extend(self, req: Request, tokens: list[int]) -> tuple[int, bool]:
        """Append tokens until the request finishes; returns (appended, finished) as `append` token by token
        would. Without a grammar or stop strings (what needs each prefix) the finishing token is found with
        set and length arithmetic instead of a Python step per token."""
        if req.grammar is not None or (req.params.stop and self.tokenizer is not None):
            for n, token in enumerate(tokens, start=1):
                if self.append(req, token):
                    return n, True
            return len(tokens), False
        out, params = req.output_ids, req.params
        before, reason = len(out), None
        # tokens[j] makes the output before + j + 1 long: the first j that reaches a length limit ends it, unless
        # a stop id (counted from min_new_tokens on) ends it first or there
        end = max(min(params.max_new_tokens, self.max_len - len(req.prompt_ids)) - before - 1, 0)
        if end < len(tokens):
            reason = {"type": "length", "length": before + end + 1}
            tokens = tokens[: end + 1]
        stop_ids = self.stop_ids(req)
        if stop_ids and not stop_ids.isdisjoint(tokens):
            for j in range(max(params.min_new_tokens - before - 1, 0), len(tokens)):
                if tokens[j] in stop_ids:
                    reason, tokens = {"type": "stop", "matched": tokens[j]}, tokens[: j + 1]
                    break
        out += tokens
        if req.first_token_time is None and tokens:
            req.first_token_time = time.perf_counter()
        if reason is not None:
            req.finish_reason = reason
            req.finished_time = time.perf_counter()
        return len(tokens), reason is not None

    def append(self, req: Request, token: int) -> bool:
        """Append one token; returns True (and sets finish_reason) when the request is finished."""
        req.output_ids.append(token)
        if req.grammar is not None:
            req.grammar.accept(token)
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        n = len(req.output_ids)
        reason: dict[str, Any] | None = None
        if n >= req.params.min_new_tokens and token in self.stop_ids(req):
            reason = {"type": "stop", "matched": token}
        elif n >= req.params.min_new_tokens and (matched := self._stop_string(req)) is not None:
            reason = {"type": "stop", "matched": matched}
        elif req.grammar is not None and req.grammar.terminated:  # the grammar took its stop token
            reason = {"type": "stop", "matched": token}
        elif n >= req.params.max_new_tokens or len(req.prompt_ids) + n >= self.max_len:
            reason = {"type": "length", "length": n}
        if reason is not None:
            req.finish_reason = reason
            req.finished_time = time.perf_counter()
        return reason is not None

    def _stop_string(self, req: Request) -> str | None:
        if not req.params.stop or self.tokenizer is None:
            return None
        window = max(len(s) for s in req.params.stop) + 8
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=True)
        return next((s for s in req.params.stop if s in tail), None)

    def output_text(self, req: Request) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        matched = (req.finish_reason or {}).get("matched")
        if isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]
        return text
