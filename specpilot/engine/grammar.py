"""Structured output: a request's JSON schema, regex or EBNF grammar (xgrammar) masks the target's
distribution at every position it decides: a prefill's or decode's row, and each verify row from the
grammar state its draft path leads to, so a constrained speculative decode equals constrained AR token
for token and a draft that breaks the grammar is rejected like any other mismatch."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, lru_cache
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from specpilot.config import SamplingParams

if TYPE_CHECKING:
    import xgrammar

MAX_DRAFT_DEPTH = 64  # the matcher keeps this many tokens to roll back (a verify path's length)


@cache  # on every mask's path: imported once
def _xgrammar() -> ModuleType:
    """xgrammar, imported on first use: the engine imports this module where only its GPU paths are wanted (a bare
    GPU image without it runs the engine's benchmarks); structured output alone needs it."""
    try:
        import xgrammar
    except ModuleNotFoundError as err:
        raise ValueError("structured output needs xgrammar, which is not installed here") from err
    return xgrammar


class GrammarCompiler:
    """Compiles constraints against the target's tokenizer, each distinct one once."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer")
        self.vocab_size = vocab_size
        xgr = _xgrammar()
        self._compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
        self._compiled = lru_cache(maxsize=64)(self._compile)

    def _compile(self, kind: str, spec: str) -> xgrammar.CompiledGrammar:
        if kind == "json_schema":
            return self._compiler.compile_json_schema(spec)
        if kind == "regex":
            return self._compiler.compile_regex(spec)
        return self._compiler.compile_grammar(spec)

    def matcher(self, params: SamplingParams) -> RequestGrammar:
        kind, spec = params.constraint
        try:
            compiled = self._compiled(kind, spec)
        except Exception as err:  # xgrammar's parse errors carry no common type
            raise ValueError(f"{kind}: {err}") from err
        grammar = RequestGrammar(_xgrammar().GrammarMatcher(compiled, max_rollback_tokens=MAX_DRAFT_DEPTH),
                                 self.vocab_size)
        if not grammar.can_start():
            raise ValueError(f"{kind}: no token of this model's vocabulary can start it")
        return grammar


class RequestGrammar:
    """One request's grammar state, at its committed tokens."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} breaks the request's grammar")  # a mask was not applied

    def reset(self, tokens: list[int]) -> None:
        """Back to the state after `tokens` (a rollback)."""
        self.matcher.reset()
        for token in tokens:
            self.accept(token)

    def can_start(self) -> bool:
        """Whether some token of the vocabulary is allowed first."""
        words = self.bitmask([])[0]
        ids = torch.arange(self.vocab_size)
        return bool(((words[ids // 32] >> (ids % 32)) & 1).any())

    def bitmask(self, drafts: list[int], parents: list[int] | None = None) -> torch.Tensor:
        """xgrammar's token bitmask [1 + len(drafts), ceil(V / 32)] int32 (CPU) of a verify's rows: row 0 the
        ids allowed at the committed state, row j + 1 those after the path down to draft j (its parent's row:
        a chain's j, a tree's parents[j], 0 being the committed token's). Walked depth first, one accept and one rollback per draft. A draft the grammar
        refuses cannot be reached (its parent's row excludes it), nor can a path past the grammar's end:
        their rows decide nothing, and allow everything."""
        mask = _xgrammar().allocate_token_bitmask(1 + len(drafts), self.vocab_size)
        mask.fill_(-1)
        children: list[list[int]] = [[] for _ in range(1 + len(drafts))]
        for j in range(len(drafts)):
            children[j if parents is None else parents[j]].append(j + 1)

        def visit(row: int) -> None:
            if self.matcher.is_terminated():
                return
            self.matcher.fill_next_token_bitmask(mask, row)
            for child in children[row]:
                if self.matcher.accept_token(drafts[child - 1]):
                    visit(child)
                    self.matcher.rollback(1)

        visit(0)
        return mask

    def recheck(self, tokens: list[int], rows: list[int], children: Callable[[], dict[tuple[int, int], int]],
                decide: Callable[[int, torch.Tensor | None], int]) -> tuple[list[int], list[int]] | None:
        """A greedy decision made without masks (`tokens`, decided by verify `rows`) checked from this state:
        None when the grammar takes every token (or ends first, where the request stops). Else the decision
        redone from the first token it refuses: that row decided again under the grammar's mask (`decide(row,
        mask)`: the row's argmax, masked where a mask is given), then on down the drafts (`children()`: (row,
        token) -> row, asked for only here) while a decided token has one, each row's plain argmax kept where the grammar allows
        it. Returns the new (tokens, rows); the state is left as it was."""
        advanced = 0
        try:
            for j, token in enumerate(tokens):
                if self.matcher.is_terminated():
                    return None
                if not self.matcher.accept_token(token):
                    break
                advanced += 1
            else:
                return None
            tokens, rows, row, mask = tokens[:j], rows[: j + 1], rows[j], self._allowed()
            drafted = children()
            while True:
                token = decide(row, mask)
                if not self.matcher.accept_token(token):
                    if mask is not None:  # a masked argmax is always allowed
                        raise RuntimeError(f"token {token} breaks the request's grammar under its own mask")
                    mask = self._allowed()
                    continue
                advanced += 1
                tokens.append(token)
                child = drafted.get((row, token))
                if child is None or self.matcher.is_terminated():
                    return tokens, rows
                rows.append(child)
                row, mask = child, None
        finally:
            if advanced:
                self.matcher.rollback(advanced)

    def _allowed(self) -> torch.Tensor:
        mask = _xgrammar().allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(mask, 0)
        return mask

    def masks_along(self, tokens: list[int]) -> torch.Tensor:
        """Bitmask rows [len(tokens), ceil(V / 32)]: row j allows the ids the grammar allows after tokens[:j]
        from this state, which it returns to."""
        mask = _xgrammar().allocate_token_bitmask(len(tokens), self.vocab_size)
        mask.fill_(-1)
        taken = 0
        for row, token in enumerate(tokens):
            if self.matcher.is_terminated():
                break
            self.matcher.fill_next_token_bitmask(mask, row)
            if not self.matcher.accept_token(token):
                break
            taken += 1
        if taken:
            self.matcher.rollback(taken)
        return mask


def constrain(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf where the grammar forbids (in place, like the stop bans): logits [rows, V], `bitmask` from
    RequestGrammar.bitmask (the compiler knows V, ids past the tokenizer's own included)."""
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
    return logits
