"""Shared by the terminal app's tests (no tests here): a memory database made by a real `specpilot optimize`
run on the tiny model, a real `specpilot serve` on loopback, the app in a process of its own, and a helper
that waits on the app."""

from __future__ import annotations

import os
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


APP_STARTS_A_ROUND = '''
import asyncio, json, sys
from textual.widgets import Input, Select
from tui_support import until
from specpilot.tui.app import SpecPilotApp
from specpilot.tui.data import MemoryReader

db = sys.argv[1]

async def drive(pilot):
    app = pilot.app
    await until(pilot, lambda: app.screen.query_one("#deployment", Select).value == 1, what="the deployment")
    await pilot.press("s")
    for field, value in (("rounds", "2"), ("agents", "1"), ("max_new_tokens", "8"),
                         ("extra", "--dataset math --num-prompts 1 --repeats 5")):
        app.screen.query_one(f"#f-{field}", Input).value = value
    await pilot.press("ctrl+s")  # the dialog's Start, from the keyboard
    def started():
        event = MemoryReader(db).last_event("optimizer started")
        return (event is not None and app.runs.state().state == "running" and len(MemoryReader(db).rounds()) == 2
                and app.runs.state().pid == json.loads(event["detail"])["pid"])
    await until(pilot, started, timeout=90, what="the new round")
    print(app.runs.state().pid, flush=True)
    await asyncio.sleep(3600)  # until killed

SpecPilotApp(db, server="http://127.0.0.1:9").run(headless=True, size=(160, 48), auto_pilot=drive)
'''


def app_started_round(db: Path) -> tuple[subprocess.Popen[str], int]:
    """The app in a process of its own (headless), which starts a 2-round optimize on `db`; it and the round's pid."""
    app = subprocess.Popen([sys.executable, "-c", APP_STARTS_A_ROUND, str(db)], stdout=subprocess.PIPE, text=True,
                           cwd=Path(__file__).parent, env=os.environ | {"PYTHONPATH": str(Path(__file__).parent)})
    line = app.stdout.readline()
    assert line.strip().isdigit(), f"the app did not start a round (exit {app.poll()})"
    return app, int(line)
