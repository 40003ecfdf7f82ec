"""A `specpilot serve` in a process of its own, from the installed package or from a candidate's source tree,
and timed requests to it: how the sealed evaluator runs code it must not import."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

START_TIMEOUT_S = 900.0  # a cold CUDA start loads the model and captures graphs
REQUEST_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# No current directory or user site on the path: a process started in a candidate's work directory imports
# nothing from it. The caller's PYTHONPATH is kept (it is how a package is installed by path, the device's
# ferry for one); a candidate's tree goes before it.
PYTHON_FLAGS = ("-P", "-s")


def source_env(tree: Path | None) -> dict[str, str]:
    """The environment of a process that imports `specpilot` from `tree` (None: what this process imports)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    return env


def imported_from(tree: Path | None, cwd: Path) -> Path:
    """Where a process with source_env(tree) imports the package from (the evaluator checks it is the tree)."""
    out = subprocess.run([sys.executable, *PYTHON_FLAGS, "-c", "import specpilot; print(specpilot.__file__)"],
                         cwd=cwd, env=source_env(tree), capture_output=True, text=True, check=True, timeout=120)
    return Path(out.stdout.strip()).resolve().parent


@dataclass
class Server:
    """A running server; `close()` stops it."""

    proc: subprocess.Popen
    port: int
    log: Path
    client: httpx.Client | None = None

    @classmethod
    def launch(cls, flags: list[str], log: Path, tree: Path | None = None, cwd: Path | None = None) -> Server:
        """`specpilot serve FLAGS` on a free loopback port, importing the package from `tree` (None: the one
        this process imports); `ready()` waits for it."""
        port = free_port()
        cmd = [sys.executable, *PYTHON_FLAGS, "-m", "specpilot", "serve", "--host", "127.0.0.1", "--port", str(port),
               *flags]
        log.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=source_env(tree),
                                cwd=cwd or log.parent)
        return cls(proc, port, log)

    @classmethod
    def with_config(cls, config: dict[str, Any], workdir: Path, name: str, tree: Path | None = None) -> Server:
        """A server of an EngineConfig given as JSON fields (`serve --engine-config`), launched."""
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / f"{name}.engine.json"
        path.write_text(json.dumps(config))
        return cls.launch(["--engine-config", str(path)], workdir / f"{name}.log", tree, cwd=workdir)

    def ready(self, timeout_s: float = START_TIMEOUT_S) -> Server:
        """Waits until /health answers."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.tail()}")
            try:
                if self.http().get("/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.close()
        raise TimeoutError(f"the server did not answer /health within {timeout_s:.0f} s: {self.tail()}")

    def http(self) -> httpx.Client:
        """One client for every request: none is timed with a new connection's set-up, and a client's making
        (its TLS context, even for plain HTTP) is not paid at each poll of /health."""
        if self.client is None:
            self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=REQUEST_TIMEOUT_S,
                                       trust_env=False)
        return self.client

    def tail(self, chars: int = 1500) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.is_file() else ""

    def generate(self, input_ids: list[int], sampling: dict[str, Any]) -> tuple[list[int], float]:
        """One /generate of token ids: (output ids, seconds from sending it to the whole answer)."""
        start = time.perf_counter()
        response = self.http().post("/generate", json={"input_ids": input_ids, "sampling_params": sampling})
        seconds = time.perf_counter() - start
        response.raise_for_status()
        return response.json()["output_ids"], seconds

    def stop(self) -> None:
        """Asks the server to shut down (SIGTERM) without waiting for it."""
        if self.client is not None:
            self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()

    def close(self) -> None:
        """Shuts the server down and waits for it (a minute, then SIGKILL)."""
        self.stop()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def close_all(servers: Iterable[Server]) -> None:
    """Shuts several servers down at once: each is asked before any is waited for, so their shutdowns overlap."""
    servers = list(servers)
    for server in servers:
        server.stop()
    for server in servers:
        server.close()
