"""SGLang's native API: /generate, /abort_request, /flush_cache, health and info endpoints."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from specpilot.config import SamplingParams
from specpilot.server.context import APIError, bad_request, context
from specpilot.server.protocol import GenerateRequest
from specpilot.server.stream import EngineFailure, Follower, Output, sse_stream

router = APIRouter()

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's: a probe slower than this reports the server unhealthy


def _result(out: Output, batch: bool, text_in_logprobs: bool) -> dict[str, Any]:
    result = {"text": out.text(), "output_ids": list(out.ids), "meta_info": out.meta_info(text_in_logprobs)}
    return result | {"index": out.index} if batch else result


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Any:
    ctx = context(request)
    try:
        prompts = body.prompts(ctx.tokenizer)
        params = body.params(prompts, ctx.engine.context_length, ctx.vocab_size)
    except ValueError as err:
        raise bad_request(err) from err
    sub = await ctx.submit(prompts, params, body.rids(), body.samples())
    follower = Follower(ctx, sub, request)
    listed = body.is_batch or len(sub.items) > 1  # a batch, or n > 1: a list of results tagged with `index`
    if body.stream:
        return StreamingResponse(sse_stream(_generate_events(follower, listed, body.return_text_in_logprobs)),
                                 media_type="text/event-stream")
    async with follower:
        outputs = await follower.finish()
    results = [_result(o, listed, body.return_text_in_logprobs) for o in outputs]
    return results if listed else results[0]


async def _generate_events(follower: Follower, batch: bool, text_in_logprobs: bool) -> AsyncIterator[dict[str, Any]]:
    """SGLang streams the cumulative text and ids of an item in each chunk; a batch tags chunks with `index`.
    Each chunk's meta_info also says how its new ids came and their texts: those ids only, so a long stream
    does not resend what it said (the last chunk's token_origins, like a plain response's, lists all)."""
    async with follower:
        async for changed in follower.changes():
            for out in changed:
                result = _result(out, batch, text_in_logprobs)
                result["meta_info"] |= out.new_tokens()
                yield result


class AbortRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    rid: str = ""
    abort_all: bool = False


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> dict[str, Any]:
    ctx = context(request)
    if body.abort_all:
        ctx.scheduler.abort_all()
    elif body.rid:
        ctx.scheduler.abort([body.rid])
    else:
        raise APIError(400, "give a rid or abort_all: true")
    return {"success": True}


@router.get("/flush_cache")
@router.post("/flush_cache")
async def flush_cache(request: Request) -> JSONResponse:
    # Slots are fixed per request and freed when it ends; there is no prefix cache to drop.
    snap = context(request).scheduler.snapshot
    if snap.running or snap.waiting:
        return JSONResponse({"success": False, "message": "cannot flush the cache while requests run "
                                                          f"({snap.running} running, {snap.waiting} waiting)"},
                            status_code=400)
    return JSONResponse({"success": True, "message": "nothing to flush: KV slots are freed as requests end "
                                                     "(no prefix cache)"})


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    ok = context(request).scheduler.accepting
    return JSONResponse({"status": "ok" if ok else "shutting down"}, status_code=200 if ok else 503)


@router.get("/health_generate")
async def health_generate(request: Request) -> JSONResponse:
    """Runs a one-token generation through the scheduler and engine."""
    ctx = context(request)
    probe = [ctx.engine.checkpoint.config.bos_token_id or 0]
    try:
        sub = await ctx.submit([probe], [SamplingParams(max_new_tokens=1)], [None])
        async with Follower(ctx, sub, request) as follower:
            await asyncio.wait_for(follower.finish(), HEALTH_GENERATE_TIMEOUT_S)
    except (APIError, EngineFailure, TimeoutError) as err:
        return JSONResponse({"status": f"unhealthy: {str(err) or 'timed out'}"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    ctx = context(request)
    tokenizer = ctx.tokenizer
    return {"model_path": ctx.model_path, "tokenizer_path": getattr(tokenizer, "name_or_path", None),
            "served_model_name": ctx.model_name, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": None, "context_length": ctx.engine.context_length,
            "vocab_size": ctx.vocab_size, "architecture": ctx.engine.checkpoint.config.architecture}


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    ctx = context(request)
    snap = ctx.scheduler.snapshot
    state = {"avg_spec_accept_length": snap.avg_spec_accept_length,
             "last_gen_throughput": snap.last_gen_throughput, "spec_stats": snap.spec_stats,
             "step_time": snap.step_time}
    return ctx.server_args() | {"internal_states": [state], "running_requests": snap.running,
                                "waiting_requests": snap.waiting, "rids": list(snap.rids),
                                "version": _version()}


def _version() -> str:
    try:
        return version("specpilot")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"
