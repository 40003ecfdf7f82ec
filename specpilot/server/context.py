"""What every handler shares: server arguments, the engine (read-only from the event loop; where it runs in a
process of its own, the facts of it the handlers read), the scheduler, and the HTTP errors handlers raise."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

from starlette.requests import Request

from specpilot.config import SamplingParams
from specpilot.engine.engine import Engine
from specpilot.engine.registry import in_effect
from specpilot.server.protocol import sample_params
from specpilot.server.remote_scheduler import RemoteEngine, RemoteScheduler
from specpilot.server.scheduler import (
    Item,
    NotAccepting,
    Overloaded,
    Scheduler,
    Submission,
    queue_limit,
)

RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def bad_request(err: Exception) -> APIError:
    return APIError(400, str(err))


@dataclass
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 30000
    max_queued_requests: int | None = None  # None: 4 x max_running_requests
    served_model_name: str | None = None
    shutdown_grace_period: float = 30.0  # seconds in-flight requests get to finish on shutdown
    engine_process: bool = True  # `specpilot serve`: the engine in a process of its own (server/engine_process.py)
    stream_interval: int = 1  # a stream's chunk after its first token: every this many new tokens (SGLang's flag)


class ServerContext:
    def __init__(self, engine: Engine | RemoteEngine, args: ServerArgs, scheduler: RemoteScheduler | None = None) -> None:
        """`engine`: the engine, or with `scheduler` the facts of the one in its own process."""
        self.engine = engine
        self.args = args
        if scheduler is None:
            self.max_queued_requests = queue_limit(args.max_queued_requests, engine.config.max_running_requests)
            self.scheduler: Scheduler | RemoteScheduler = Scheduler(engine, self.max_queued_requests)
        else:
            self.max_queued_requests, self.scheduler = scheduler.max_queued_requests, scheduler
        self.model_path = engine.checkpoint.source
        self.model_name = args.served_model_name or engine.config.model_path or Path(self.model_path).stem
        self.vocab_size = engine.checkpoint.config.vocab_size

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @functools.cache  # noqa: B019  (one context per app; a vocabulary's texts at most)
    def token_text(self, token: int) -> str:
        """One id's own text (a stream chunk's per-token texts, logprob entries), decoded once per id."""
        return self.engine.tokenizer.decode([token])

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams], rids: list[str | None],
                     samples: list[int] | None = None) -> Submission:
        """Hand the prompts to the scheduler and wait until the engine took them (or refused them). `samples`:
        n per prompt, as consecutive items (prompt-major) sharing the first one's prefill, their rids
        suffixed -0 .. -(n-1)."""
        items: list[Item] = []
        for p, sp, rid, n in zip(prompts, params, rids, samples or [1] * len(prompts), strict=True):
            rid, first = rid or uuid4().hex, len(items)
            items += [Item(p, sample_params(sp, j), rid if n == 1 else f"{rid}-{j}", j, first if j else None)
                      for j in range(n)]
        if len(items) > self.scheduler.capacity:  # it could never be admitted: the client's to change
            raise APIError(400, f"{len(items)} requests (prompts x n) exceed what the server holds at once "
                                f"({self.scheduler.capacity} running or queued)")
        try:
            sub = self.scheduler.submit(items)
        except Overloaded as err:
            raise APIError(503, str(err), {"Retry-After": str(RETRY_AFTER_S)}) from err
        except NotAccepting as err:
            raise APIError(503, str(err)) from err
        try:
            verdict = await sub.queue.get()
        except asyncio.CancelledError:
            self.scheduler.abort(sub.rids)
            raise
        if verdict.error is not None:
            raise APIError(400, verdict.error)
        return sub

    def server_args(self) -> dict[str, Any]:
        """The settings in effect (`dtype` as resolved, not `auto`); `speed`: the mechanisms on and every tunable's value
        (engine/registry.py)."""
        return asdict(self.engine.config) | asdict(self.args) | {"dtype": str(self.engine.dtype).removeprefix("torch."),
            "max_queued_requests": self.max_queued_requests, "kv_cache": self.engine.kv_plan.as_dict(),
            "kv_pool": self.scheduler.snapshot.kv_pool, "weights": self.engine.weights_info(),
            "speed": in_effect(self.engine.config, self.engine.mechanisms)}


def context(request: Request) -> ServerContext:
    return request.app.state.ctx
