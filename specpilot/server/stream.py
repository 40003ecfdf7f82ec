"""The event-loop side of a submission: following its updates, aborting it when the client goes away,
each item's output as text, and server-sent events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest

from specpilot.server.context import ServerContext
from specpilot.server.detokenize import IncrementalText
from specpilot.server.logprobs import chat_logprobs, completion_logprobs, sglang_meta
from specpilot.server.scheduler import Item, Submission, Update
from specpilot.state.request import Request, TokenLogprob

SSE_DONE = "data: [DONE]\n\n"
DISCONNECTED = object()  # queued by a follower's disconnect watcher


class ClientDisconnected(Exception):
    pass


class EngineFailure(Exception):
    pass


class Output:
    """One item's output as the event loop knows it: the ids received so far, the Request once done."""

    def __init__(self, ctx: ServerContext, item: Item, index: int) -> None:
        self.ctx = ctx
        self.item = item
        self.index = index  # position in the submission (the choice index in OpenAI responses)
        self.ids: list[int] = []
        self.origins: list[str] = []  # how each id came (Request.token_origins)
        self.logprobs: list[TokenLogprob] = []  # each id's, where the request asked (Request.logprobs)
        self.input_logprobs: list[TokenLogprob | None] = []  # the prompt's (Request.input_logprobs)
        self._described = 0  # ids whose origin and text a streamed chunk already carried
        self.streamed = 0  # ids a stream's chunks covered (Follower.changes)
        self._scored = 0  # ids whose logprobs an OpenAI stream chunk already carried
        self.req: Request | None = None
        # a partial text may not show a tail that could still grow into a stop string (trimmed later)
        self._holdback = max((len(s) for s in item.params.stop), default=1) - 1
        self._sent = ""
        self._text = IncrementalText(ctx.tokenizer)

    @property
    def finished(self) -> bool:
        return self.req is not None

    def apply(self, update: Update) -> None:
        self.ids.extend(update.new_ids)
        self.origins.extend(update.new_origins)
        self.logprobs.extend(update.new_logprobs)
        if update.input_logprobs is not None:
            self.input_logprobs = update.input_logprobs
        if update.req is not None:
            self.req = update.req

    def text(self) -> str:
        """The final text once finished; before, the decoded prefix without what may still change."""
        if self.req is not None:
            return self.ctx.engine.output_text(self.req)
        if self.ctx.tokenizer is None:
            return ""
        text = self._text.update(self.ids)
        return text[: max(len(text) - self._holdback, 0)]

    def new_tokens(self) -> dict[str, list[str]]:
        """How each id since the last call came and its own text (a streamed chunk's metadata, so a client can
        show tokens apart without each chunk resending the whole list); a piece of a multi-byte character
        decodes as U+FFFD."""
        fresh = self.ids[self._described:]
        texts = [self.ctx.token_text(i) for i in fresh] if self.ctx.tokenizer is not None else []
        origins = self.origins[self._described:len(self.ids)]
        self._described = len(self.ids)
        return {"new_token_origins": origins, "new_token_texts": texts}

    def delta(self) -> str:
        """Text not yet returned by delta() (OpenAI streaming)."""
        text = self.text()
        if not text.startswith(self._sent):  # the decoder revised earlier text: nothing safe to add
            return ""
        new, self._sent = text[len(self._sent):], text
        return new

    def _decode(self, token: int) -> str | None:
        return None if self.ctx.tokenizer is None else self.ctx.token_text(token)

    def meta_info(self, text_in_logprobs: bool = False) -> dict[str, Any]:
        if self.req is not None:
            info = self.req.meta_info()
        else:
            info = {"id": self.item.rid, "finish_reason": None, "prompt_tokens": len(self.item.prompt_ids),
                    "completion_tokens": len(self.ids)}
        prompt = self.item.prompt_ids[max(self.item.params.logprob_start_len, 0):]
        return info | sglang_meta(self.logprobs, self.ids, self.input_logprobs, prompt, self.item.params,
                                  self._decode, text_in_logprobs)

    def openai_logprobs(self, chat: bool, fresh_only: bool = False) -> dict[str, Any] | None:
        """The choice's logprobs object (None where not asked for); `fresh_only`: of the ids no earlier call
        covered (a stream chunk's)."""
        if not self.item.params.return_logprob:
            return None
        start = self._scored if fresh_only else 0
        entries, ids = self.logprobs[start:], self.ids[start : len(self.logprobs)]
        self._scored = len(self.logprobs)
        if chat:
            return chat_logprobs(entries, ids, self._decode)
        offset = len(self.ctx.tokenizer.decode(self.ids[:start])) if start and self.ctx.tokenizer is not None else 0
        return completion_logprobs(entries, ids, self._decode, offset)

    @property
    def finish_reason(self) -> str | None:
        return None if self.req is None else self.req.finish_reason["type"]

    @property
    def matched_stop(self) -> int | str | None:
        return None if self.req is None else self.req.finish_reason.get("matched")


class Follower:
    """Follows a submission until every item finished. Leaving the `async with` block early (client
    disconnected, response cancelled, error) aborts the unfinished items, freeing their KV slots."""

    def __init__(self, ctx: ServerContext, sub: Submission, request: HTTPRequest) -> None:
        self.ctx, self.sub, self.request = ctx, sub, request
        self.outputs = [Output(ctx, item, i) for i, item in enumerate(sub.items)]
        self._gone: asyncio.Future[None] | None = None

    async def __aenter__(self) -> Follower:
        self._gone = asyncio.ensure_future(_disconnected(self.request))
        # the disconnect arrives through the update queue: a wake-up then costs one queue get, not a new task
        # raced against this future (per update and request)
        self._gone.add_done_callback(lambda gone: gone.cancelled() or self.sub.queue.put_nowait(DISCONNECTED))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._gone.cancel()
        unfinished = [o.item.rid for o in self.outputs if not o.finished]
        if unfinished:
            self.ctx.scheduler.abort(unfinished)

    async def changes(self) -> AsyncIterator[list[Output]]:
        """The outputs that changed, one list per wake-up (updates that queued up meanwhile are merged): each
        output once it has its first token, then once `--stream-interval` more have come, and when it ends."""
        interval = self.ctx.args.stream_interval
        while not all(o.finished for o in self.outputs):
            updates = [await self.sub.queue.get()]
            while not self.sub.queue.empty():
                updates.append(self.sub.queue.get_nowait())
            if any(u is DISCONNECTED for u in updates):
                raise ClientDisconnected()
            changed: dict[int, Output] = {}
            for update in updates:
                if update.error is not None:
                    raise EngineFailure(update.error)
                self.outputs[update.index].apply(update)
                changed[update.index] = self.outputs[update.index]
            due = [o for o in changed.values()
                   if o.finished or (o.ids and (not o.streamed or len(o.ids) - o.streamed >= interval))]
            for o in due:
                o.streamed = len(o.ids)
            if due:
                yield due

    async def finish(self) -> list[Output]:
        async for _ in self.changes():
            pass
        return self.outputs


async def _disconnected(request: HTTPRequest) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or the response completed).
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def sse_stream(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events of `events`, then [DONE]; an engine failure becomes an error event."""
    try:
        async for event in events:
            yield sse(event)
    except ClientDisconnected:
        return
    except EngineFailure as err:
        yield sse({"error": {"message": str(err), "type": "InternalServerError", "code": 500}})
    yield SSE_DONE
