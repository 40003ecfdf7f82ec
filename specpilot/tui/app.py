"""`specpilot tui`: one App with three modes (rounds, memory, server), a command palette of every action,
a help screen, light and dark themes. Slow work runs in worker threads; every error is a notification."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from textual.app import App
from textual.binding import Binding
from textual.worker import Worker, WorkerState

from specpilot.tui.commands import ActionsProvider
from specpilot.tui.data import MemoryReader
from specpilot.tui.runs import RunControl, StartSpec
from specpilot.tui.screens.compare import CompareScreen
from specpilot.tui.screens.dialogs import PathDialog, StartDialog
from specpilot.tui.screens.help import HelpScreen
from specpilot.tui.screens.memory import MemoryScreen
from specpilot.tui.screens.rounds import RoundsScreen
from specpilot.tui.screens.server import ServerScreen

DEFAULT_SERVER = "http://127.0.0.1:30000"


class SpecPilotApp(App[None]):
    CSS_PATH = "specpilot.tcss"
    TITLE = "SpecPilot"
    COMMANDS = App.COMMANDS | {ActionsProvider}
    MODES = {"rounds": RoundsScreen, "memory": MemoryScreen, "server": ServerScreen}
    BINDINGS = [
        Binding("1", "show_mode('rounds')", "Rounds"),
        Binding("2", "show_mode('memory')", "Memory"),
        Binding("3", "show_mode('server')", "Server"),
        Binding("question_mark", "help", "Help"),
        Binding("t", "toggle_dark", "Theme"),
        Binding("ctrl+s", "screenshot_svg", "Screenshot", show=False),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, db: str | Path, server: str = DEFAULT_SERVER, mode: str = "rounds") -> None:
        super().__init__()
        self.reader = MemoryReader(db)
        self.runs = RunControl(self.reader)
        self.server_url = server
        self.first_mode = mode
        self.SUB_TITLE = str(self.reader.path)

    def on_mount(self) -> None:
        self.theme = "textual-dark"
        if not self.reader.exists:
            self.notify(f"no memory file at {self.reader.path} yet: start a round (s) to make one",
                        severity="warning", title="memory")
        self.switch_mode(self.first_mode)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A worker's unexpected error: a notification, and the app goes on."""
        if event.state == WorkerState.ERROR and event.worker.error is not None:
            self.report(event.worker.error, event.worker.group or event.worker.name)

    def report(self, err: BaseException, where: str) -> None:
        """Every error the app meets, as a notification (never a traceback)."""
        self.notify(f"{type(err).__name__}: {err}", severity="error", title=where, timeout=8)

    # ---- modes, help, themes ------------------------------------------------------------------
    def action_show_mode(self, mode: str) -> None:
        self.switch_mode(mode)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.screen))

    def action_toggle_dark(self) -> None:
        self.theme = "textual-light" if self.theme == "textual-dark" else "textual-dark"

    def action_screenshot_svg(self) -> None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        path = self.save_screenshot(f"specpilot-{self.current_mode}-{stamp}.svg", str(self.reader.path.parent))
        self.notify(f"saved {path}", title="screenshot")

    # ---- rounds -------------------------------------------------------------------------------
    def action_start_round(self, resume: bool = False) -> None:
        if self.current_mode != "rounds":
            self.switch_mode("rounds")
        screen = self.screen
        spec = screen.start_spec() if isinstance(screen, RoundsScreen) else StartSpec()
        spec.resume = resume
        self.push_screen(StartDialog(spec), self._start)

    def _start(self, spec: StartSpec | None) -> None:
        if spec is None:
            return
        try:
            pid = self.runs.start(spec)
        except (OSError, RuntimeError, ValueError) as err:
            self.report(err, "start")
            return
        self.notify(f"specpilot optimize started (pid {pid}); it runs on if the app is closed", title="rounds")
        self._refresh_rounds()

    def _signal(self, what: str) -> None:
        try:
            run = getattr(self.runs, what)()
        except (OSError, RuntimeError) as err:
            self.report(err, what)
            return
        words = {"pause": "paused (SIGSTOP)", "resume": "resumed (SIGCONT)",
                 "stop": "asked to stop (SIGTERM): the candidate being judged finishes, then the round is paused"}
        self.notify(f"optimizer pid {run.pid} {words[what]}", title="rounds")
        self._refresh_rounds()

    def _refresh_rounds(self) -> None:
        if isinstance(self.screen, RoundsScreen):
            self.screen.poll()

    def action_pause_round(self) -> None:
        self._signal("pause")

    def action_resume_round(self) -> None:
        """SIGCONT where the run is paused; where it was stopped (its round paused), start it with --resume."""
        state = self.runs.state().state
        if state == "paused":
            self._signal("resume")
        elif state in ("gone", "none"):
            self.action_start_round(resume=True)
        else:
            self.notify("the round is running", title="rounds")

    def action_stop_round(self) -> None:
        self._signal("stop")

    # ---- memory -------------------------------------------------------------------------------
    def action_export(self) -> None:
        if self.current_mode != "memory":
            self.switch_mode("memory")
        default = str(self.reader.path.with_name(self.reader.path.stem + "-export.json"))
        self.push_screen(PathDialog("Export the marked (else the filtered) candidates to", default), self._export)

    def _export(self, path: str | None) -> None:
        screen = self.screen
        if path is None or not isinstance(screen, MemoryScreen):
            return
        self.run_worker(lambda: self._write_export(screen, Path(path)), thread=True, group="export",
                        exit_on_error=False)

    def _write_export(self, screen: MemoryScreen, path: Path) -> None:
        try:
            rows = self.reader.export(screen.selection())
            path.write_text(json.dumps({"db": str(self.reader.path), "candidates": rows}, indent=2))
        except (OSError, ValueError) as err:
            self.call_from_thread(self.report, err, "export")
            return
        self.call_from_thread(self.notify, f"{len(rows)} candidates written to {path}", title="export")

    def action_compare(self) -> None:
        try:
            deployments = self.reader.deployments()
        except (OSError, ValueError) as err:
            self.report(err, "compare")
            return
        if not deployments:
            self.notify("no deployments in memory yet", severity="warning", title="compare")
            return
        self.push_screen(CompareScreen(deployments))
