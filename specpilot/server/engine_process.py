"""The engine in a process of its own (`specpilot serve`'s default), so the HTTP process's event loop (request
parsing, detokenizing, server-sent events) and the engine's steps never wait for each other's interpreter lock.

The engine process builds the engine, warms it up and reports what the HTTP side reads of it (`EngineFacts`, the
tokenizer included); then the scheduler thread (server/scheduler.py) runs its steps there as in one process,
while the main thread turns commands from the pipe into scheduler calls. The scheduler's messages go back
through the pipe, one batch a step with the newest snapshot (`PipeSink`); the HTTP process's side is
server/remote_scheduler.py.

Pipe messages, HTTP process → engine: ("submit", key, items), ("abort", rids), ("abort_all",), ("drain",
grace_s), ("stop", grace_s). Engine → HTTP process: ("ready", facts, max_queued_requests, snapshot) or
("failed", message) once, then
("batch", [(key, message), ...], snapshot), and ("stopped",) last.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import torch

from specpilot.engine.config import EngineConfig
from specpilot.engine.engine import Engine
from specpilot.engine.memory import KVPlan
from specpilot.models.config import ModelConfig
from specpilot.server.scheduler import NotAccepting, Overloaded, Scheduler, Submission, Update, Verdict, queue_limit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointFacts:
    source: str
    config: ModelConfig


@dataclass(frozen=True)
class EngineFacts:
    """What the HTTP process reads of the engine (ServerContext's `engine`), fixed once it is built."""

    config: EngineConfig
    tokenizer: Any
    context_length: int
    kv_plan: KVPlan
    checkpoint: CheckpointFacts
    mechanisms: frozenset[str]
    weights: dict[str, int | str]
    dtype: torch.dtype

    @classmethod
    def of(cls, engine: Engine) -> EngineFacts:
        return cls(engine.config, engine.tokenizer, engine.context_length, engine.kv_plan,
                   CheckpointFacts(engine.checkpoint.source, engine.checkpoint.config), engine.mechanisms,
                   engine.weights_info(), engine.dtype)


class PipeSink:
    """A step's messages to the HTTP process in one send, with the scheduler's newest snapshot; a finished
    request goes without what stays in this process (its grammar state, the request it copied a prefill from)."""

    def __init__(self, conn: Connection, scheduler: Scheduler) -> None:
        self.conn, self.scheduler = conn, scheduler
        self.lock = threading.Lock()  # the scheduler thread and the main thread (refusals) both send

    def send(self, messages: list[tuple[Submission, Verdict | Update]]) -> None:
        batch = [(sub.key, _portable(message)) for sub, message in messages]
        with self.lock:
            self.conn.send(("batch", batch, self.scheduler.snapshot))


def _portable(message: Verdict | Update) -> Verdict | Update:
    if isinstance(message, Update) and message.req is not None:
        return replace(message, req=replace(message.req, grammar=None, prefill_from=None, stop_ids=None))
    return message


def run(config: EngineConfig, max_queued_requests: int | None, conn: Connection, log_level: int = logging.INFO) -> None:
    """The engine process's main: build, report, then serve the pipe's commands until told to stop. `log_level`:
    the HTTP process's."""
    # the HTTP process owns the signals: it drains, then tells this process to stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    try:
        engine = Engine.from_config(config)
        engine.warm_up()
    except Exception as err:  # a bad flag or checkpoint: the HTTP process reports it and exits
        log.exception("the engine could not start")
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    queued = queue_limit(max_queued_requests, engine.config.max_running_requests)
    scheduler = Scheduler(engine, queued)
    sink = PipeSink(conn, scheduler)
    conn.send(("ready", EngineFacts.of(engine), queued, scheduler.snapshot))
    scheduler.start()
    try:
        while True:
            command, *args = conn.recv()
            if command == "submit":
                key, items = args
                try:
                    scheduler.enqueue(Submission(items, sink, key=key))
                except (NotAccepting, Overloaded) as err:  # the HTTP side checked first: a race with a drain
                    sink.send([(Submission(items, sink, key=key), Verdict(str(err)))])
            elif command == "abort":
                scheduler.abort(args[0])
            elif command == "abort_all":
                scheduler.abort_all()
            elif command == "drain":
                scheduler.drain(args[0])
            elif command == "stop":
                scheduler.shutdown(args[0])
                break
    except EOFError:  # the HTTP process is gone
        scheduler.shutdown(0.0)
        return
    with sink.lock:
        conn.send(("stopped",))
