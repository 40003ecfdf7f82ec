"""The FastAPI application: routers, the scheduler's lifetime, and errors as JSON with the right status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from specpilot.engine.engine import Engine
from specpilot.server import native, openai_api
from specpilot.server.context import APIError, ServerArgs, ServerContext
from specpilot.server.remote_scheduler import RemoteEngine, RemoteScheduler
from specpilot.server.stream import ClientDisconnected, EngineFailure

MAX_LISTED_ERRORS = 5
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it


def create_app(engine: Engine | RemoteEngine, args: ServerArgs, scheduler: RemoteScheduler | None = None) -> FastAPI:
    """`engine` runs in this process, or with `scheduler` in its own (server/engine_process.py)."""
    ctx = ServerContext(engine, args, scheduler)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ctx.scheduler.start()
        yield
        await asyncio.to_thread(ctx.scheduler.shutdown, args.shutdown_grace_period)

    app = FastAPI(title="SpecPilot", summary="Lossless speculative decoding server (SGLang and OpenAI APIs)",
                  lifespan=lifespan)
    app.state.ctx = ctx
    app.add_middleware(JSONBodyDefault)
    app.include_router(native.router)
    app.include_router(openai_api.router)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(EngineFailure, _engine_failure)
    app.add_exception_handler(ClientDisconnected, _client_disconnected)
    return app


class JSONBodyDefault:
    """Treat request bodies as JSON unless they say otherwise: `curl -d '{...}'` labels its JSON as a form."""

    FORM = b"application/x-www-form-urlencoded"

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type" or v != self.FORM]
            if all(k != b"content-type" for k, _ in headers):
                scope = scope | {"headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "BadRequestError" if status < 500 else "ServiceUnavailableError" if status == 503 else "InternalServerError"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


async def _api_error(_: Request, err: APIError) -> JSONResponse:
    return error_response(err.status, err.message, err.headers)


async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
    """A client's malformed request is a 400 naming each offending field (FastAPI's default is a 422)."""
    errors = err.errors()
    parts = []
    for e in errors[:MAX_LISTED_ERRORS]:
        if e["type"] == "json_invalid":  # loc is (body, character offset)
            parts.append(f"malformed JSON at character {e['loc'][-1]}: {e.get('ctx', {}).get('error', e['msg'])}")
            continue
        loc = ".".join(str(p) for p in e["loc"] if p != "body")
        parts.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    if len(errors) > MAX_LISTED_ERRORS:
        parts.append(f"and {len(errors) - MAX_LISTED_ERRORS} more")
    return error_response(400, "invalid request: " + "; ".join(parts))


async def _engine_failure(_: Request, err: EngineFailure) -> JSONResponse:
    return error_response(500, str(err))


async def _client_disconnected(_: Request, __: ClientDisconnected) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)
