"""`specpilot serve`: load the engine, then run the app under uvicorn with a graceful SIGTERM."""

from __future__ import annotations

import logging
from types import FrameType

import uvicorn

from specpilot.engine.engine import Engine, EngineConfig
from specpilot.server.app import create_app
from specpilot.server.context import ServerArgs
from specpilot.server.scheduler import Scheduler


class _Server(uvicorn.Server):
    """uvicorn waits for open connections before the app's shutdown runs. So on the first SIGTERM or
    SIGINT the scheduler stops admitting at once (503s) and gives in-flight requests the grace period;
    those still running then end with finish_reason abort, which lets their connections close."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, grace_s: float) -> None:
        super().__init__(config)
        self.scheduler, self.grace_s = scheduler, grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.scheduler.drain(self.grace_s)
        super().handle_exit(sig, frame)


def serve(engine_config: EngineConfig, args: ServerArgs) -> int:
    """Blocks until the server stops; returns the process exit code."""
    engine = Engine.from_config(engine_config)
    engine.warm_up()
    app = create_app(engine, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn's own grace is a backstop: the scheduler ends every request within shutdown_grace_period
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=int(args.shutdown_grace_period) + 5)
    server = _Server(config, app.state.ctx.scheduler, args.shutdown_grace_period)
    server.run()
    return 0 if server.started else 1
