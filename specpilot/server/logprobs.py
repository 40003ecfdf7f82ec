"""Output logprobs in each API's shape: SGLang's meta_info lists, OpenAI's completions and chat objects."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specpilot.config import SamplingParams
from specpilot.state.request import TokenLogprob

Decode = Callable[[int], str | None]  # one id's text (None: no tokenizer)


def sglang_meta(entries: list[TokenLogprob], ids: list[int], prompt_entries: list[TokenLogprob | None],
                prompt_ids: list[int], params: SamplingParams, decode: Decode, with_text: bool) -> dict[str, Any]:
    """meta_info's output_token_logprobs (and output_top_logprobs / output_token_ids_logprobs where asked),
    and the input_* lists of the prompt from logprob_start_len on (`prompt_ids`, once known):
    [logprob, id, text] triples, the text only with return_text_in_logprobs; the prompt's first token has
    logprob None (nothing predicts it)."""
    if not params.return_logprob:
        return {}

    def triple(logprob: float | None, token: int) -> list[Any]:
        return [logprob, token, decode(token) if with_text else None]

    def lists(kind: str, scored: list[TokenLogprob | None], tokens: list[int]) -> dict[str, Any]:
        part = {f"{kind}_token_logprobs": [triple(e and e.logprob, t) for e, t in zip(scored, tokens)]}
        if params.top_logprobs_num:
            part[f"{kind}_top_logprobs"] = [e and [triple(lp, i) for lp, i in e.top] for e in scored]
        if params.token_ids_logprob:
            part[f"{kind}_token_ids_logprobs"] = [e and [triple(lp, i) for lp, i in e.named] for e in scored]
        return part

    meta = lists("output", list(entries), ids)
    if params.logprob_start_len >= 0 and len(prompt_entries) == len(prompt_ids):
        meta |= lists("input", prompt_entries, prompt_ids)
    return meta


def completion_logprobs(entries: list[TokenLogprob], ids: list[int], decode: Decode, offset: int = 0) -> dict[str, Any]:
    """/v1/completions' logprobs object; `offset`: the text length before these tokens (text_offset)."""
    tokens = [decode(t) or "" for t in ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{decode(i) or "": lp for lp, i in e.top} for e in entries], "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], ids: list[int], decode: Decode) -> dict[str, Any]:
    """/v1/chat/completions' logprobs object: one entry per token, with its UTF-8 bytes."""
    def item(logprob: float, token: int) -> dict[str, Any]:
        text = decode(token) or ""
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [item(e.logprob, t) | {"top_logprobs": [item(lp, i) for lp, i in e.top]}
                        for e, t in zip(entries, ids)], "refusal": None}
