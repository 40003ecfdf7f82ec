"""Rounds as processes: `specpilot optimize` runs detached in its own session, so the app only watches and
signals it and closing the app never ends a round. The run says where it is (an `optimizer started` event
with its pid and process group); pause and resume are SIGSTOP / SIGCONT to that group (the orchestrator,
its agents and its evaluator together), stop is SIGTERM to the orchestrator, which finishes the candidate
being judged and marks the round paused for `--resume`."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specpilot.tui.data import MemoryReader


@dataclass(frozen=True)
class RunState:
    pid: int | None
    pgid: int | None
    state: str  # "running", "paused" (stopped by SIGSTOP), "gone" (no live process), "none" (never started)
    deployment: int | None = None


@dataclass
class StartSpec:
    """What a round is started with: the deployment's engine flags and the optimizer's own."""

    model_path: str = ""  # "" or "embedded": the embedded default model
    algorithm: str = "ngram"
    draft_path: str = ""
    device: str = "cpu"
    dtype: str = ""
    rounds: int = 1
    agents: int = 2
    max_new_tokens: int = 32
    extra: str = ""  # more optimize flags, shell-quoted
    resume: bool = False

    @classmethod
    def of_deployment(cls, row: dict[str, Any]) -> StartSpec:
        """Flags that reproduce a deployment recorded in memory."""
        algorithm, _, draft = (row.get("drafter") or "ngram:default").partition(":")
        return cls(model_path="" if row["target"] == "embedded" else row["target"], algorithm=algorithm,
                   draft_path="" if draft in ("", "default") else draft, device=row["device"], dtype=row["dtype"])

    def argv(self, db: Path) -> list[str]:
        argv = [sys.executable, "-m", "specpilot", "optimize", "--db", str(db), "--rounds", str(self.rounds),
                "--agents", str(self.agents), "--max-new-tokens", str(self.max_new_tokens),
                "--speculative-algorithm", self.algorithm, "--device", self.device,
                "--output-dir", str(db.parent / f"{db.stem}-optimize")]
        if self.model_path and self.model_path != "embedded":
            argv += ["--model-path", self.model_path]
        if self.draft_path:
            argv += ["--speculative-draft-model-path", self.draft_path]
        if self.dtype:
            argv += ["--dtype", self.dtype]
        if self.resume:
            argv.append("--resume")
        return argv + shlex.split(self.extra)


def log_path(db: Path) -> Path:
    """Where the app sends a run's output: beside the database, so a reopened app shows it."""
    return db.with_name(db.name + ".optimize.log")


def _proc_state(pid: int) -> str | None:
    """'T' (stopped), another state letter, or None where no such process is (or it is a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return None
        return "R"
    state = stat.rsplit(")", 1)[1].split()[0]
    return None if state in ("Z", "X") else state


def _is_optimizer(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # no /proc: trust the recorded pid
    return b"optimize" in argv


class RunControl:
    def __init__(self, reader: MemoryReader) -> None:
        self.reader = reader
        self._child: subprocess.Popen[bytes] | None = None  # the run this app started (reaped on poll)

    def state(self) -> RunState:
        if self._child is not None and self._child.poll() is not None:
            self._child = None
        event = self.reader.last_event("optimizer started") if self.reader.exists else None
        if event is None:
            if self._child is not None:  # started, still loading: it has not written its event yet
                return RunState(self._child.pid, self._child.pid, "running")
            return RunState(None, None, "none")
        detail = json.loads(event["detail"])
        pid, pgid = detail["pid"], detail.get("pgid", detail["pid"])
        if self._child is not None and self._child.pid != pid:  # ours is newer than the event
            return RunState(self._child.pid, self._child.pid, "running")
        proc = _proc_state(pid)
        if proc is None or not _is_optimizer(pid):
            return RunState(pid, pgid, "gone", detail.get("deployment"))
        return RunState(pid, pgid, "paused" if proc == "T" else "running", detail.get("deployment"))

    def start(self, spec: StartSpec) -> int:
        if self.state().state in ("running", "paused"):
            raise RuntimeError("a round is already running on this database: stop it first")
        db = self.reader.path.resolve()
        db.parent.mkdir(parents=True, exist_ok=True)
        with log_path(db).open("ab") as log:
            log.write(f"$ {shlex.join(spec.argv(db))}\n".encode())
            log.flush()
            self._child = subprocess.Popen(spec.argv(db), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                           start_new_session=True, cwd=db.parent)
        return self._child.pid

    def _signal(self, group: bool, sig: signal.Signals, want: tuple[str, ...]) -> RunState:
        run = self.state()
        if run.state not in want or run.pid is None:
            raise RuntimeError(f"no round to signal: the optimizer is {run.state}")
        if group:
            os.killpg(run.pgid or run.pid, sig)
        else:
            os.kill(run.pid, sig)
        return run

    def pause(self) -> RunState:
        return self._signal(True, signal.SIGSTOP, ("running",))

    def resume(self) -> RunState:
        return self._signal(True, signal.SIGCONT, ("paused",))

    def stop(self) -> RunState:
        """A clean stop: the candidate being judged finishes, the round is marked paused (continue with resume)."""
        run = self.state()
        if run.state == "paused":  # a stopped group must run again to act on SIGTERM
            os.killpg(run.pgid or run.pid, signal.SIGCONT)
        return self._signal(False, signal.SIGTERM, ("running", "paused"))

    def log_tail(self, lines: int = 200) -> list[str]:
        path = log_path(self.reader.path.resolve())
        if not path.is_file():
            return []
        with path.open("rb") as f:
            f.seek(max(path.stat().st_size - 64_000, 0))
            return f.read().decode(errors="replace").splitlines()[-lines:]
