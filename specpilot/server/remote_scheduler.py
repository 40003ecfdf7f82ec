"""The HTTP process's side of an engine in its own process (server/engine_process.py): `RemoteEngine`, what the
handlers read of the engine, and `RemoteScheduler`, the scheduler's interface (submit, abort, drain, snapshot,
shutdown) over the pipe. A reader thread hands each batch of messages to the event loop in one wake-up and
counts the requests that ended, as the scheduler itself does in one process."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import threading

from specpilot.engine.config import EngineConfig
from specpilot.engine.stops import StopChecker
from specpilot.server.engine_process import EngineFacts, run
from specpilot.server.scheduler import (
    EventLoopSink,
    Item,
    Submission,
    Update,
    Verdict,
    hand_over,
    loop_sink,
    reserve,
)
from specpilot.state.request import Request

log = logging.getLogger(__name__)


class RemoteEngine:
    """The engine's facts as the handlers read them (ServerContext's `engine`)."""

    def __init__(self, facts: EngineFacts) -> None:
        self.config, self.tokenizer, self.context_length = facts.config, facts.tokenizer, facts.context_length
        self.kv_plan, self.checkpoint, self.mechanisms = facts.kv_plan, facts.checkpoint, facts.mechanisms
        self._weights, self.dtype = facts.weights, facts.dtype
        self._stops = StopChecker(facts.tokenizer, facts.checkpoint.config.eos_token_ids, facts.context_length)

    def weights_info(self) -> dict[str, int | str]:
        return self._weights

    def output_text(self, req: Request) -> str:
        return self._stops.output_text(req)


class RemoteScheduler:
    def __init__(self, config: EngineConfig, max_queued_requests: int | None) -> None:
        """Starts the engine process and waits until its engine is built (RuntimeError with its reason if not).
        `max_queued_requests`: None for 4 x the running requests the engine resolves."""
        ctx = multiprocessing.get_context("spawn")  # CUDA needs a fresh interpreter
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=run, args=(config, max_queued_requests, child, logging.getLogger().level),
                                   name="specpilot-engine", daemon=True)
        self.process.start()
        child.close()
        try:
            kind, *payload = self.conn.recv()
        except EOFError:
            self.process.join()
            kind, payload = "failed", [f"the engine process exited (code {self.process.exitcode})"]
        if kind != "ready":
            self.process.join()
            raise RuntimeError(payload[0])
        facts, self.max_queued_requests, self.snapshot = payload
        self.engine = RemoteEngine(facts)
        self.capacity = facts.config.max_running_requests + self.max_queued_requests
        self._cv = threading.Condition(threading.RLock())
        self._subs: dict[int, Submission] = {}
        self._left: dict[int, int] = {}  # per submission, its items not ended yet
        self._sinks: dict[asyncio.AbstractEventLoop, EventLoopSink] = {}
        self._keys = itertools.count(1)
        self._outstanding = 0
        self._accepting = True
        self._send_lock = threading.Lock()
        self._stopped = threading.Event()
        self._reader = threading.Thread(target=self._read, name="specpilot-engine-reader", daemon=True)

    # ---- the Scheduler's interface ---------------------------------------------------------------
    def start(self) -> None:
        self._reader.start()

    @property
    def accepting(self) -> bool:
        return self._accepting and not self._stopped.is_set()

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def submit(self, items: list[Item]) -> Submission:
        sub = Submission(items, loop_sink(self._sinks), queue=asyncio.Queue())
        with self._cv:
            self._outstanding = reserve(self.accepting, self._outstanding, len(items), self.capacity)
            sub.key = next(self._keys)
            self._subs[sub.key] = sub
            self._left[sub.key] = len(items)
        self._send(("submit", sub.key, items))
        return sub

    def abort(self, rids: list[str]) -> None:
        self._send(("abort", rids))

    def abort_all(self) -> None:
        self._send(("abort_all",))

    def drain(self, grace_s: float) -> None:
        with self._cv:
            if not self._accepting:
                return
            self._accepting = False
        self._send(("drain", grace_s))

    def wait_idle(self, timeout: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._outstanding or self._stopped.is_set(), timeout=timeout)

    def shutdown(self, grace_s: float) -> None:
        """Drain, wait for the live requests to end, then stop the engine process. Blocking."""
        self.drain(grace_s)
        self.wait_idle(grace_s + 5.0)
        self._send(("stop", 0.0))
        self._stopped.wait(timeout=grace_s + 10.0)
        self.process.join(timeout=10.0)
        if self.process.is_alive():
            self.process.terminate()

    # ---- the pipe ----------------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self.conn.send(message)
            except (BrokenPipeError, OSError):  # the engine process is gone: the reader tells the clients
                pass

    def _read(self) -> None:
        try:
            while True:
                message = self.conn.recv()
                if message[0] == "stopped":
                    break
                _, batch, self.snapshot = message
                self._deliver(batch)
        except (EOFError, OSError):
            self.process.join(timeout=1.0)
            log.error("the engine process stopped (exit code %s)", self.process.exitcode)
            self._fail_all("the engine process stopped")
        finally:
            self._stopped.set()
            with self._cv:
                self._cv.notify_all()

    def _deliver(self, batch: list[tuple[int, Verdict | Update]]) -> None:
        """The batch to its submissions' queues in one event-loop wake-up per loop; requests that ended are
        released (refused submissions whole, finished or failed items one by one)."""
        messages, ended = [], 0
        with self._cv:
            for key, message in batch:
                sub = self._subs.get(key)
                if sub is None:
                    continue
                messages.append((sub, message))
                if isinstance(message, Verdict):
                    over = self._left[key] if message.error is not None else 0
                else:
                    over = int(message.req is not None or message.error is not None)
                ended += over
                self._left[key] -= over
                if not self._left[key]:
                    del self._subs[key], self._left[key]
            self._outstanding -= ended
            if ended:
                self._cv.notify_all()
        hand_over(messages)

    def _fail_all(self, reason: str) -> None:
        with self._cv:
            failed = [(sub, Update(i, [], error=reason)) for sub in self._subs.values() for i in range(len(sub.items))]
            self._subs.clear()
            self._left.clear()
            self._outstanding = 0
            self._cv.notify_all()
        hand_over(failed)
