"""The scheduler thread: the one thread that owns the (not thread-safe) Engine.

HTTP handlers run on the asyncio event loop. They never touch the engine: they post commands
(submit, abort) into an inbox guarded by a condition variable, and receive their tokens through
an asyncio.Queue that this thread fills through the submission's sink (`EventLoopSink`: with
`loop.call_soon_threadsafe`; in the engine's own process, server/engine_process.py, a pipe to the HTTP
process). Between engine steps the thread drains the inbox, so requests join and leave the running batch
between steps (continuous batching; the engine admits waiting requests into free KV slots on its own).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from specpilot.config import SamplingParams
from specpilot.engine.engine import Engine
from specpilot.state.request import Request, TokenLogprob

log = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 1.0  # last_gen_throughput is measured over windows of this length


class Overloaded(Exception):
    """Running slots and waiting queue are full: the client should retry later (503)."""


class NotAccepting(Exception):
    """The server is shutting down (503)."""


@dataclass(frozen=True)
class Item:
    prompt_ids: list[int]
    params: SamplingParams
    rid: str
    sample: int = 0  # which of its prompt's n samples
    shares_with: int | None = None  # the submission's item of the same prompt whose prefill this one copies


@dataclass(frozen=True)
class Verdict:
    """First message of every submission: accepted (error None) or refused by the engine."""

    error: str | None = None


@dataclass(frozen=True)
class Update:
    """New tokens of item `index`. `req` is set once it finished; from then on the scheduler no longer
    touches the Request, so the event loop may read it. `error` reports an engine failure."""

    index: int
    new_ids: list[int]
    req: Request | None = None
    new_origins: list[str] = field(default_factory=list)  # how each new id came (Request.token_origins)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, where the request asked
    input_logprobs: list[TokenLogprob | None] | None = None  # the prompt's, with the first update
    error: str | None = None


class Sink(Protocol):
    """Where the scheduler thread hands its submissions' messages, a step's for every request together."""

    def send(self, messages: list[tuple[Submission, Verdict | Update]]) -> None: ...


@dataclass(eq=False)
class Submission:
    """One HTTP request's engine requests (several for a batch), where their messages go, and (on the event
    loop's side) the queue they arrive on."""

    items: list[Item]
    sink: Sink
    key: int = 0  # its number between the HTTP process and the engine's (server/engine_process.py)
    queue: asyncio.Queue[Verdict | Update] | None = None

    @property
    def rids(self) -> list[str]:
        return [item.rid for item in self.items]

    def push(self, message: Verdict | Update) -> None:
        """Called from the scheduler thread."""
        self.sink.send([(self, message)])


class EventLoopSink:
    """Messages into their submissions' queues with one wake-up of the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def send(self, messages: list[tuple[Submission, Verdict | Update]]) -> None:
        def put_all() -> None:
            for sub, message in messages:
                sub.queue.put_nowait(message)

        try:
            self.loop.call_soon_threadsafe(put_all)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def reserve(accepting: bool, outstanding: int, wanted: int, capacity: int) -> int:
    """The outstanding count once `wanted` more requests are taken; NotAccepting or Overloaded if they cannot be."""
    if not accepting:
        raise NotAccepting("the server is shutting down")
    if outstanding + wanted > capacity:
        raise Overloaded(f"the server is at capacity ({capacity} requests running or queued); retry later")
    return outstanding + wanted


def hand_over(messages: list[tuple[Submission, Verdict | Update]]) -> None:
    """Messages to their submissions' sinks, one send per sink (one wake-up per event loop)."""
    for sink in {id(sub.sink): sub.sink for sub, _ in messages}.values():
        sink.send([m for m in messages if m[0].sink is sink])


def queue_limit(asked: int | None, running: int) -> int:
    """Requests that may wait for a running slot: as asked, else four times the running ones."""
    return 4 * running if asked is None else asked


def loop_sink(sinks: dict[asyncio.AbstractEventLoop, EventLoopSink]) -> EventLoopSink:
    """The running event loop's sink, made once per loop and kept in `sinks`."""
    loop = asyncio.get_running_loop()
    return sinks.get(loop) or sinks.setdefault(loop, EventLoopSink(loop))


@dataclass(frozen=True)
class Snapshot:
    """What /get_server_info reports; rebuilt by the scheduler thread, read by handlers as a whole."""

    running: int = 0
    waiting: int = 0
    rids: tuple[str, ...] = ()
    avg_spec_accept_length: float = 0.0
    last_gen_throughput: float = 0.0
    spec_stats: dict[str, Any] = field(default_factory=dict)
    # the scheduler thread's time since start, by what it did: {"prefill" | "decode" | "publish": {count, seconds}}
    step_time: dict[str, dict[str, float]] = field(default_factory=dict)
    kv_pool: dict[str, int | bool] = field(default_factory=dict)  # PageTable.info()


@dataclass
class _Live:
    req: Request
    sub: Submission
    index: int
    sent: int = 0  # output ids already pushed to the submission


class Scheduler:
    def __init__(self, engine: Engine, max_queued_requests: int) -> None:
        self.engine = engine
        # Outstanding requests (queued, waiting or running) allowed before 503: the running slots plus
        # the waiting queue. Counted at submission so that the bound holds before the thread sees them.
        self.capacity = engine.config.max_running_requests + max_queued_requests
        self._clock: dict[str, list[float]] = {"prefill": [0, 0.0], "decode": [0, 0.0], "publish": [0, 0.0]}
        self.snapshot = Snapshot(step_time=self._step_time(), kv_pool=engine.pages.info())
        # An RLock: drain() may run in a signal handler that interrupted the main thread inside a locked section.
        self._cv = threading.Condition(threading.RLock())
        self._inbox: list[Callable[[], None]] = []
        self._outstanding = 0
        self._accepting = True
        self._deadline: float | None = None  # while draining: abort whatever is still live at this time
        self._stop = False
        self._live: dict[str, _Live] = {}
        self._window_start: float | None = None
        self._window_tokens = 0
        self._throughput = 0.0
        self._thread = threading.Thread(target=self._run, name="specpilot-scheduler", daemon=True)
        self._sinks: dict[asyncio.AbstractEventLoop, EventLoopSink] = {}

    # ---- called from the event loop (or a signal handler) -----------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def accepting(self) -> bool:
        return self._accepting and self._thread.is_alive()

    def submit(self, items: list[Item]) -> Submission:
        """Queue a submission (from the event loop); all of its items are admitted or none. Raises
        NotAccepting or Overloaded."""
        return self.enqueue(Submission(items, loop_sink(self._sinks), queue=asyncio.Queue()))

    def enqueue(self, sub: Submission) -> Submission:
        """Queue a submission whose messages go to its sink. Raises NotAccepting or Overloaded."""
        with self._cv:
            self._outstanding = reserve(self.accepting, self._outstanding, len(sub.items), self.capacity)
            self._post(partial(self._admit, sub))
        return sub

    def abort(self, rids: list[str]) -> None:
        with self._cv:
            self._post(partial(self._abort, rids))

    def abort_all(self) -> None:
        with self._cv:
            self._post(lambda: self._abort(list(self._live)))

    def drain(self, grace_s: float) -> None:
        """Stop admitting; requests still live after `grace_s` seconds end with finish_reason abort."""
        with self._cv:
            if self._accepting:
                self._accepting = False
                self._deadline = time.monotonic() + grace_s
                self._cv.notify()

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request is queued, waiting or running (or `timeout` passed)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._outstanding, timeout=timeout)

    def shutdown(self, grace_s: float) -> None:
        """Drain, wait for the live requests to end, then stop the thread. Blocking."""
        self.drain(grace_s)
        self.wait_idle(grace_s + 5.0)
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _post(self, command: Callable[[], None]) -> None:
        self._inbox.append(command)
        self._cv.notify()

    # ---- the scheduler thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._loop_once():
                pass
        finally:  # normally nothing is live here; after a crash, tell the clients instead of hanging them
            for live in self._live.values():
                live.sub.push(Update(live.index, [], live.req, error="the scheduler stopped"))

    def _loop_once(self) -> bool:
        """Apply commands, run one engine step, publish. Returns True when the thread should end."""
        with self._cv:
            # Sleep while there is nothing to do; wake up for commands, stop, or the drain deadline.
            while not (self._inbox or self.engine.has_work or self._stop or self._deadline_passed()):
                self._cv.wait(timeout=None if self._deadline is None else self._deadline - time.monotonic())
            inbox, self._inbox = self._inbox, []
            stop = self._stop
        for command in inbox:
            command()
        if stop or self._deadline_passed():
            self._deadline = None
            self._abort(list(self._live))
        if self.engine.has_work:
            self._step()
        start = time.perf_counter()
        self._publish()
        self._tick("publish", start)
        return stop

    def _step_time(self) -> dict[str, dict[str, float]]:
        return {kind: {"count": int(n), "seconds": t} for kind, (n, t) in self._clock.items()}

    def _tick(self, kind: str, start: float) -> None:
        entry = self._clock[kind]
        entry[0] += 1
        entry[1] += time.perf_counter() - start

    def _deadline_passed(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _admit(self, sub: Submission) -> None:
        added: list[Request] = []
        try:
            for item in sub.items:
                if item.rid in self._live or item.rid in (r.rid for r in added):
                    raise ValueError(f"rid {item.rid!r} is already in use")
                source = None if item.shares_with is None else added[item.shares_with]
                added.append(self.engine.add_request(item.prompt_ids, item.params, rid=item.rid, prefill_from=source))
        except ValueError as err:
            for req in added:
                self.engine.abort(req.rid)
            prefix = f"item {len(added)}: " if len(sub.items) > 1 else ""
            sub.push(Verdict(prefix + str(err)))
            self._release(len(sub.items))
            return
        sub.push(Verdict())
        for index, req in enumerate(added):
            self._live[req.rid] = _Live(req, sub, index)

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            if rid in self._live:
                self.engine.abort(rid)

    def _step(self) -> None:
        if self._window_start is None:
            self._window_start, self._window_tokens = time.perf_counter(), 0
        start = time.perf_counter()
        try:
            self.engine.step()
            if self.engine.last_step is not None:
                self._tick(self.engine.last_step, start)
        except Exception as err:  # an engine bug: fail the live requests instead of hanging them
            log.exception("engine step failed; aborting %d live requests", len(self._live))
            for live in self._live.values():
                self.engine.abort(live.req.rid)
                live.sub.push(Update(live.index, [], live.req, error=f"engine error: {err}"))
            self._release(len(self._live))
            self._live.clear()

    def _publish(self) -> None:
        """Push what each live request gained since the last step; retire the finished ones."""
        done, messages = [], []
        for rid, live in self._live.items():
            req = live.req
            new = req.output_ids[live.sent:]
            if new or req.finished:
                first = live.sent == 0
                live.sent += len(new)
                self._window_tokens += len(new)
                fresh = slice(live.sent - len(new), live.sent)
                messages.append((live.sub, Update(live.index, new, req if req.finished else None,
                                                  new_origins=req.token_origins[fresh],
                                                  new_logprobs=req.logprobs[fresh],
                                                  input_logprobs=req.input_logprobs if first else None)))
            if req.finished:
                done.append(rid)
        for rid in done:
            del self._live[rid]
        self._measure()
        stats, budget, lengths = self.engine.spec_stats, self.engine.budget, self.engine.verify_lengths
        self.snapshot = Snapshot(
            running=len(self.engine.running), waiting=len(self.engine.waiting), rids=tuple(self._live),
            avg_spec_accept_length=stats.tau, last_gen_throughput=self._throughput,
            spec_stats=(stats.as_dict() if stats.steps else {}) | ({"budget": budget.as_dict()} if budget else {})
            | ({"two_level": lengths.as_dict()} if lengths else {}),
            step_time=self._step_time(), kv_pool=self.engine.pages.info())
        # after the snapshot (a sink to another process sends it with them), before the release (which may let
        # a shutdown go on)
        hand_over(messages)
        self._release(len(done))

    def _measure(self) -> None:
        if self._window_start is None:
            return
        elapsed = time.perf_counter() - self._window_start
        if elapsed >= THROUGHPUT_WINDOW_S or not self.engine.has_work:
            if self._window_tokens:
                self._throughput = self._window_tokens / elapsed
            # idle: the next window starts with the next step, so idle time is not averaged in
            self._window_start = time.perf_counter() if self.engine.has_work else None
            self._window_tokens = 0

    def _release(self, n: int) -> None:
        if n:
            with self._cv:
                self._outstanding -= n
                self._cv.notify_all()
