"""A streamed request's text, decoding each new id about once instead of the whole output every step.

Decoding the whole output on each step costs O(n) per step and O(n^2) per request, on the event loop, which
shares the interpreter with the scheduler thread: at 32 streams it was most of a step. Here only the ids since
the last stable point are decoded again, beside the few before them as context (a decoder may render a
token differently at the start of a text, e.g. SentencePiece's leading space): the new text is what the
window decodes to past what its context decoded to; a context always holds some rendered text. A window ending in U+FFFD (a multi-byte character cut
between tokens) waits for the next ids. Where a decoder's text of the window does not extend its context's,
the whole output is decoded again, so the text is always the output's own decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalText:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = ""  # the text of ids[:self._read]
        self._context = 0  # ids[_context:_read] are decoded again as context for the next ones
        self._read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, ids: Sequence[int]) -> str:
        """The stable text of `ids` (the list the last call saw, grown): complete characters only."""
        if len(ids) <= self._read:
            return self.text
        before = self._decode(ids[self._context : self._read])
        window = self._decode(ids[self._context :])
        if window.endswith("\ufffd"):
            return self.text
        if window.startswith(before):
            new = window[len(before) :]
            self.text += new
        else:  # this decoder revises text across the window's start: take the whole output's
            new = self.text = self._decode(ids)
        # the next context starts at the ids just read, unless they render nothing (special tokens): a context
        # must hold text, or the next word would decode as the start of a text (no separating space)
        if new:
            self._context = self._read
        self._read = len(ids)
        return self.text
