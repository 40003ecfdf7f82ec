"""Shared by the server tests (no tests here): a tiny model directory with a chat template, and a real
uvicorn server on a free loopback port in a background thread."""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn

from specpilot.engine.engine import Engine, EngineConfig
from specpilot.server import ServerArgs, create_app
from specpilot.server.context import ServerContext
from specpilot.server.remote_scheduler import RemoteScheduler


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    """Until a `specpilot serve` process answers /health (its stderr in the failure if it exits first)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError((err.decode() if isinstance(err, bytes) else err)[-2000:])
        assert time.monotonic() < deadline, "specpilot serve did not come up"
        try:
            if httpx.get(url + "/health", trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)


class LiveServer:
    """The app under uvicorn in a daemon thread, listening on a socket bound before start (no port race)."""

    def __init__(self, model_dir: pathlib.Path, args: ServerArgs | None = None, engine_process: bool = False,
                 **engine: Any) -> None:
        """`engine_process`: the engine in a process of its own, as `specpilot serve` runs it."""
        config = EngineConfig(model_path=str(model_dir), device="cpu", **engine)
        args = args or ServerArgs()
        if engine_process:
            scheduler = RemoteScheduler(config, args.max_queued_requests)
            self.app = create_app(scheduler.engine, args, scheduler)
        else:
            self.app = create_app(Engine.from_config(config), args)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def ctx(self) -> ServerContext:
        return self.app.state.ctx

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def info(self) -> dict[str, Any]:
        return httpx.get(self.url + "/get_server_info", trust_env=False).json()

    def wait_for(self, predicate: Any, timeout: float = 10.0) -> dict[str, Any]:
        """Polls /get_server_info until predicate(info) holds; returns that info."""
        deadline = time.monotonic() + timeout
        while not predicate(info := self.info()):
            assert time.monotonic() < deadline, f"timed out; last server info: {info}"
            time.sleep(0.01)
        return info


def serve(model_dir: pathlib.Path, args: ServerArgs | None = None, **engine: Any) -> Iterator[LiveServer]:
    """Body of a server fixture."""
    with LiveServer(model_dir, args, **engine) as server:
        yield server


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    """Decoded `data:` payloads of a server-sent event stream; "[DONE]" stays a string."""
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)
