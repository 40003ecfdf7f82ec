"""Output logprobs in each API's shape: SGLang's meta_info lists, OpenAI's completions and chat objects."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specpilot.config import SamplingParams
from specpilot.state.request import TokenLogprob

Decode = Callable[[int], str | None]  # one id's text (None: no tokenizer)


def sglang_meta(entries: list[TokenLogprob], ids: list[int], params: SamplingParams, decode: Decode,
                with_text: bool) -> dict[str, Any]:
    """meta_info's output_token_logprobs (and output_top_logprobs / output_token_ids_logprobs where asked):
    [logprob, id, text] triples, the text only with return_text_in_logprobs."""
    if not params.return_logprob:
        return {}

    def triple(logprob: float, token: int) -> list[Any]:
        return [logprob, token, decode(token) if with_text else None]

    meta: dict[str, Any] = {"output_token_logprobs": [triple(e.logprob, t) for e, t in zip(entries, ids)]}
    if params.top_logprobs_num:
        meta["output_top_logprobs"] = [[triple(lp, i) for lp, i in e.top] for e in entries]
    if params.token_ids_logprob:
        meta["output_token_ids_logprobs"] = [[triple(lp, i) for lp, i in e.named] for e in entries]
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
