"""Shared by the terminal app's tests (no tests here): a memory database made by a real `specpilot optimize`
run on the tiny model, a real `specpilot serve` on loopback, and a helper that waits on the app."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from test_server_support import free_port, wait_healthy
from tiny_models import make_tiny_model_dir

OPTIMIZE_FLAGS = ["--device", "cpu", "--speculative-algorithm", "ngram", "--dataset", "math", "--num-prompts", "1",
                  "--max-new-tokens", "8", "--repeats", "5", "--agents", "1"]


def tiny_model(base: Path) -> Path:
    """The tiny model in a directory named `tiny` (the app shows a target by its name: snapshots stay put)."""
    path = base / "tiny"
    path.mkdir()
    return make_tiny_model_dir(path)


def optimized_db(base: Path, model: Path) -> Path:
    """A memory written by one real round of `specpilot optimize` (one agent, one candidate)."""
    db = base / "memory.db"
    subprocess.run([sys.executable, "-m", "specpilot", "optimize", "--model-path", str(model), *OPTIMIZE_FLAGS,
                    "--rounds", "1", "--db", str(db), "--output-dir", str(base / "optimize-out")],
                   check=True, capture_output=True, timeout=300)
    return db


def copy_db(db: Path, to: Path) -> Path:
    """A copy with the WAL's contents (the optimizer's last writes may still be there)."""
    to.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(db) as src, sqlite3.connect(to) as dst:
        src.backup(dst)
    return to


def serve(model: Path) -> Iterator[str]:
    """`specpilot serve` on the tiny model (n-gram speculation) on a free loopback port; its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specpilot", "serve", "--model-path", str(model), "--host",
                             "127.0.0.1", "--port", str(port), "--speculative-algorithm", "ngram",
                             "--speculative-num-draft-tokens", "4", "--max-running-requests", "2",
                             "--device", "cpu", "--dtype", "float32"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 90)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def until(pilot, predicate: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    """Lets the app run until predicate() holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        await pilot.pause(0.05)
