"""`specpilot serve`: load the engine, then run the app under uvicorn with a graceful SIGTERM."""

from __future__ import annotations

import logging
import threading
from types import FrameType

import uvicorn

from specpilot.engine.engine import Engine, EngineConfig
from specpilot.progress import phase
from specpilot.server.app import create_app
from specpilot.server.context import ServerArgs
from specpilot.server.remote_scheduler import RemoteScheduler
from specpilot.server.scheduler import Scheduler

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """On the first SIGTERM or SIGINT the scheduler stops admitting (503s, /health included) and the
    in-flight requests get the grace period, while uvicorn keeps answering; those still running then
    end with finish_reason abort. Only once none is left does uvicorn stop listening and shut down.
    A second signal shuts down at once."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler | RemoteScheduler, grace_s: float) -> None:
        super().__init__(config)
        self.scheduler, self.grace_s = scheduler, grace_s
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self.scheduler.drain(self.grace_s)
        log.info("draining: %d requests in flight, %.1f s of grace", self.scheduler.outstanding, self.grace_s)

        def exit_when_idle() -> None:
            self.scheduler.wait_idle(self.grace_s + 5.0)
            super(_Server, self).handle_exit(sig, frame)

        threading.Thread(target=exit_when_idle, name="specpilot-drain", daemon=True).start()


def serve(engine_config: EngineConfig, args: ServerArgs) -> int:
    """Blocks until the server stops; returns the process exit code."""
    if args.engine_process:
        with phase("starting the engine in its own process"):
            try:
                scheduler = RemoteScheduler(engine_config, args.max_queued_requests)
            except RuntimeError as err:
                raise SystemExit(f"specpilot serve: the engine did not start: {err}") from None
        app = create_app(scheduler.engine, args, scheduler)
    else:
        engine = Engine.from_config(engine_config)
        with phase("warming up"):
            engine.warm_up()
        app = create_app(engine, args)
    # uvicorn's own grace is a backstop: the scheduler ends every request within shutdown_grace_period
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=int(args.shutdown_grace_period) + 5)
    server = _Server(config, app.state.ctx.scheduler, args.shutdown_grace_period)
    server.run()
    return 0 if server.started else 1
