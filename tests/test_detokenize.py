"""Incremental detokenization (server/detokenize.py): fed a growing output in chunks of any size, the text is
always a prefix of the whole output's decode and ends equal to it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.models.checkpoint import load_checkpoint
from specpilot.server.detokenize import IncrementalText


@pytest.fixture(scope="module")
def tokenizers(tiny_dir, embedded_checkpoint):
    return {"embedded (byte-level BPE)": embedded_checkpoint.tokenizer,
            "word-level": load_checkpoint(tiny_dir).tokenizer}


def _check(tokenizer, ids: list[int], cuts: list[int]) -> None:
    inc = IncrementalText(tokenizer)
    seen: list[int] = []
    for cut in sorted(set(cuts)) + [len(ids)]:
        seen.extend(ids[len(seen) : cut])
        whole = tokenizer.decode(seen, skip_special_tokens=True)
        text = inc.update(seen)
        assert whole.startswith(text)
        if not whole.endswith("\ufffd"):
            assert text == whole


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_text_is_always_the_output_s_own_decode(tokenizers, data):
    for tokenizer in tokenizers.values():
        vocab = len(tokenizer)
        ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=60))
        cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=12))
        _check(tokenizer, ids, cuts)


def test_a_character_split_across_tokens_waits_for_its_end(tokenizers):
    tokenizer = tokenizers["embedded (byte-level BPE)"]
    ids = tokenizer.encode("café 海 ok", add_special_tokens=False)
    _check(tokenizer, ids, list(range(len(ids))))  # one id at a time


def test_special_tokens_between_words_keep_their_space(tokenizers):
    """Found by hypothesis: a context of only skipped special tokens decoded the next word as a text's start."""
    _check(tokenizers["word-level"], [0, 0, 1, 0, 1], [3, 4])
