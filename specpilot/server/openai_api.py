"""OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions (streaming sends deltas)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from specpilot.server.context import ServerContext, bad_request, context
from specpilot.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAISampling,
)
from specpilot.server.scheduler import Submission
from specpilot.server.stream import Follower, Output, sse_stream

router = APIRouter(prefix="/v1")


@dataclass(frozen=True)
class Flavor:
    """How the two endpoints differ in their response shapes."""

    object: str
    chunk_object: str
    id_prefix: str
    wrap: Callable[[str], dict[str, Any]]  # a choice's text in a full response
    wrap_delta: Callable[[str], dict[str, Any]]  # a choice's new text in a stream chunk
    opening_delta: dict[str, Any] | None  # sent once per choice before any text


COMPLETION = Flavor("text_completion", "text_completion", "cmpl", lambda text: {"text": text},
                    lambda delta: {"text": delta}, None)
CHAT = Flavor("chat.completion", "chat.completion.chunk", "chatcmpl",
              lambda text: {"message": {"role": "assistant", "content": text}},
              lambda delta: {"delta": {"content": delta}}, {"delta": {"role": "assistant", "content": ""}})


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    ctx = context(request)
    return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "owned_by": "specpilot",
                                        "root": ctx.model_path, "max_model_len": ctx.engine.context_length}]}


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    ctx = context(request)
    try:
        prompts = body.prompts(ctx.tokenizer)
        params = [body.to_params(len(p), ctx.engine.context_length, ctx.vocab_size) for p in prompts]
    except ValueError as err:
        raise bad_request(err) from err
    sub = await ctx.submit(prompts, params, [None] * len(prompts), [body.n or 1] * len(prompts))
    return await _respond(ctx, sub, request, body, COMPLETION)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    ctx = context(request)
    try:
        prompt = body.prompt(ctx.tokenizer)
        params = body.to_params(len(prompt), ctx.engine.context_length, ctx.vocab_size)
    except ValueError as err:
        raise bad_request(err) from err
    sub = await ctx.submit([prompt], [params], [None], [body.n or 1])
    return await _respond(ctx, sub, request, body, CHAT)


async def _respond(ctx: ServerContext, sub: Submission, request: Request, body: OpenAISampling,
                   flavor: Flavor) -> Any:
    follower = Follower(ctx, sub, request)
    head = {"id": f"{flavor.id_prefix}-{sub.rids[0]}", "created": int(time.time()), "model": ctx.model_name}
    if body.stream:
        events = _events(follower, head | {"object": flavor.chunk_object}, flavor, body.include_usage)
        return StreamingResponse(sse_stream(events), media_type="text/event-stream")
    async with follower:
        outputs = await follower.finish()
    chat = flavor is CHAT
    choices = [_choice(o, flavor.wrap(o.text()), o.openai_logprobs(chat)) for o in outputs]
    return head | {"object": flavor.object, "choices": choices, "usage": _usage(outputs)}


async def _events(follower: Follower, chunk: dict[str, Any], flavor: Flavor,
                  include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    async with follower:
        if flavor.opening_delta is not None:
            for out in follower.outputs:
                yield chunk | {"choices": [_choice(out, flavor.opening_delta)]}
        async for changed in follower.changes():
            for out in changed:
                delta = out.delta()
                if delta or out.finished:
                    logprobs = out.openai_logprobs(flavor is CHAT, fresh_only=True)
                    yield chunk | {"choices": [_choice(out, flavor.wrap_delta(delta), logprobs)]}
        if include_usage:
            yield chunk | {"choices": [], "usage": _usage(follower.outputs)}


def _choice(out: Output, content: dict[str, Any], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": out.index, **content, "logprobs": logprobs, "finish_reason": out.finish_reason,
            "matched_stop": out.matched_stop}


def _usage(outputs: list[Output]) -> dict[str, int]:
    prompt = sum(len(o.item.prompt_ids) for o in outputs if o.item.sample == 0)  # once per prompt, whatever n
    completion = sum(len(o.ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
