"""Rounds: start, pause, resume or stop `specpilot optimize` on a deployment, and watch it: the run's
state, each agent's status, the ranked gaps before and after the round, the candidates with their
verdicts as they are judged, and the round's log. Everything is polled from the database and the run's
log in a worker thread, so a slow disk or a busy optimizer never freezes the screen."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Header, Label, RichLog, Select

from specpilot.tui.screens.closing import while_shown
from specpilot.tui.data import forcing_summary, speedup_text, verdict_text
from specpilot.tui.runs import RunState, StartSpec
from specpilot.tui.screens.dialogs import StartDialog
from specpilot.tui.widgets import GapChart

POLL_S = 1.0
STATE_STYLES = {"running": "green", "paused": "yellow", "gone": "red", "none": "dim"}


@dataclass
class RoundView:
    """One poll's worth of what the screen shows."""

    run: RunState
    deployments: list[dict[str, Any]] = field(default_factory=list)
    round: dict[str, Any] | None = None
    gaps_before: list[dict[str, Any]] = field(default_factory=list)
    gaps_after: list[dict[str, Any]] = field(default_factory=list)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    agents: int = 0
    log: list[str] = field(default_factory=list)


class RoundsScreen(Screen):
    AUTO_FOCUS = "#round-candidates"  # not the deployment Select: it would take printable keys
    BINDINGS = [("s", "app.start_round", "Start"), ("p", "app.pause_round", "Pause"),
                ("r", "app.resume_round", "Resume"), ("x", "app.stop_round", "Stop"),
                ("left_square_bracket", "older", "Older round"), ("right_square_bracket", "newer", "Newer round")]

    def __init__(self) -> None:
        super().__init__()
        self.deployment: int | None = None
        self.back = 0  # rounds back from the latest shown
        self.view: RoundView | None = None
        self._log_seen: list[str] = []
        self._options: list[tuple[str, int]] = []
        self._shown: list[dict[str, Any]] | None = None  # the candidates the tables were built from
        self.view_state: str | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="run-bar"):
            yield Select([], prompt="deployment", id="deployment", allow_blank=True)
            yield Label("", id="run-state")
            yield Button("Start", id="start", variant="success")
            yield Button("Pause", id="pause", variant="warning")
            yield Button("Resume", id="resume", variant="primary")
            yield Button("Stop", id="stop", variant="error")
        with Horizontal(id="rounds-body"):
            with Vertical(id="rounds-left"):
                yield Label("Agents", classes="section")
                yield DataTable(id="agents", cursor_type="row", zebra_stripes=True)
                yield Label("Gaps: before → after the round", classes="section")
                yield GapChart(id="gaps")
            with Vertical(id="rounds-right"):
                yield Label("Candidates", id="round-title", classes="section")
                yield DataTable(id="round-candidates", cursor_type="row", zebra_stripes=True)
                yield Label("Log", classes="section")
                yield RichLog(id="log", max_lines=2000, wrap=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#agents", DataTable).add_columns("agent", "status", "judged", "accepted", "best")
        self.query_one("#round-candidates", DataTable).add_columns(
            "id", "agent", "verdict", "forcing", "speedup ± spread", "reason / profile")
        self.poll()
        self.set_interval(POLL_S, self.poll)

    def on_select_changed(self, event: Select.Changed) -> None:
        self.deployment = None if event.value is Select.BLANK else int(event.value)
        self.back = 0
        self.poll()

    def action_older(self) -> None:
        self.back += 1
        self.poll()

    def action_newer(self) -> None:
        self.back = max(self.back - 1, 0)
        self.poll()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.app.run_action(f"{event.button.id}_round")

    @work(thread=True, exclusive=True, group="rounds-poll", exit_on_error=False)
    def poll(self) -> None:
        try:
            view = self._read()
        except Exception as err:  # a database being created or migrated: say so, poll again
            self.app.call_from_thread(self.app.report, err, "rounds")
            return
        self.app.call_from_thread(self._apply, view)

    def _read(self) -> RoundView:
        reader, control = self.app.reader, self.app.runs
        run = control.state()
        view = RoundView(run, log=control.log_tail())
        if not reader.exists:
            return view
        view.deployments = reader.deployments()
        dep = self.deployment if self.deployment is not None else run.deployment
        if dep is None and view.deployments:
            dep = view.deployments[-1]["id"]
        rounds = reader.rounds(dep) if dep is not None else []
        if rounds:
            # the chosen round (the latest by default) and the gaps measured after it (a memory from before
            # they were recorded: the next round's)
            at = max(len(rounds) - 1 - self.back, 0)
            view.round = rounds[at]
            view.gaps_before = reader.gaps(view.round["id"])
            view.gaps_after = reader.gaps_after(view.round["id"]) or (
                reader.gaps(rounds[at + 1]["id"]) if at + 1 < len(rounds) else [])
            view.candidates = reader.candidates_of_round(view.round["id"])
            if not view.log:  # a run started elsewhere: its log is not beside the database, its events are
                view.log = [f"{e['created_utc']}  {e['kind']}  {e['detail'] or ''}"[:300]
                            for e in reader.events(view.round["id"])]
        started = reader.last_event("optimizer started")
        view.agents = json.loads(started["detail"]).get("agents", 0) if started else 0
        return view

    @while_shown
    def _apply(self, view: RoundView) -> None:
        self.view = view
        options = [(f"#{d['id']} {Path(d['target']).name} · {d['drafter'].split(':')[0]} · {d['device']} {d['dtype']}",
                    d["id"])
                   for d in view.deployments]
        select = self.query_one("#deployment", Select)
        if options != self._options:
            self._options = options
            with self.prevent(Select.Changed):
                select.set_options(options)
                if view.round is not None:
                    select.value = view.round["deployment_id"]
        run = view.run
        style = STATE_STYLES[run.state]
        pid = f" (pid {run.pid})" if run.pid else ""
        words = {"none": "no optimizer has run on this database", "gone": "the optimizer is gone"}
        self.query_one("#run-state", Label).update(f"[{style}]● {words.get(run.state, run.state)}{pid}[/]")
        self.query_one("#start", Button).disabled = run.state in ("running", "paused")
        self.query_one("#pause", Button).disabled = run.state != "running"
        self.query_one("#resume", Button).disabled = run.state != "paused"
        self.query_one("#stop", Button).disabled = run.state not in ("running", "paused")
        if view.round is not None:
            r = view.round
            self.query_one("#round-title", Label).update(f"Round {r['number']} (id {r['id']}): {r['status']}")
        self.query_one(GapChart).show(view.gaps_before, view.gaps_after)
        if view.candidates != self._shown or view.run.state != (self.view_state or view.run.state):
            self._fill_candidates(view)  # rebuilt only on a change, so the cursor and scroll stay put
            self._fill_agents(view)
        self._shown, self.view_state = view.candidates, view.run.state
        self._fill_log(view.log)

    def _fill_candidates(self, view: RoundView) -> None:
        table = self.query_one("#round-candidates", DataTable)
        row = table.cursor_row
        table.clear()
        for c in view.candidates:
            verdict = verdict_text(c)
            style = {"accepted": "green", "rejected": "red"}.get(verdict, "yellow")
            table.add_row(str(c["id"]), c["agent"], f"[{style}]{verdict}[/]", forcing_summary(c["forcing"], c["exact"]),
                          speedup_text(c), (c["reason"] or c["params"] or "")[:80], key=str(c["id"]))
        if table.row_count:
            table.move_cursor(row=min(row, table.row_count - 1), animate=False)

    def _fill_agents(self, view: RoundView) -> None:
        table = self.query_one("#agents", DataTable)
        table.clear()
        names = [f"search-{i}" for i in range(view.agents)]
        names += sorted({c["agent"] for c in view.candidates} - set(names))
        live = view.run.state in ("running", "paused") and view.round is not None and view.round["status"] == "running"
        for name in names:
            mine = [c for c in view.candidates if c["agent"] == name]
            judged = [c for c in mine if c["accepted"] is not None]
            accepted = [c for c in judged if c["accepted"]]
            best = max((c["speedup_median"] for c in accepted), default=None)
            if any(c["accepted"] is None for c in mine) and live:
                status = f"evaluating #{next(c['id'] for c in mine if c['accepted'] is None)}"
            elif not mine:
                status = "proposing" if live else "—"
            else:
                status = "done"
            if view.run.state == "paused" and live:
                status += " (paused)"
            table.add_row(name, status, str(len(judged)), str(len(accepted)), "—" if best is None else f"{best:.3f}×")

    def _fill_log(self, lines: list[str]) -> None:
        log = self.query_one(RichLog)
        if lines[: len(self._log_seen)] != self._log_seen or not self._log_seen:
            log.clear()
            self._log_seen = []
        for line in lines[len(self._log_seen):]:
            log.write(line)
        self._log_seen = lines

    def start_spec(self) -> StartSpec:
        """The start dialog's defaults: the chosen deployment's flags (else the embedded model's)."""
        reader = self.app.reader
        try:  # read now (milliseconds): the first poll may not have come back yet
            deployments = reader.deployments() if reader.exists else []
        except (OSError, ValueError) as err:
            self.app.report(err, "start")
            deployments = []
        value = self.query_one("#deployment", Select).value
        if value is Select.BLANK:
            value = self.deployment if self.deployment is not None else self.app.runs.state().deployment
        if value is None and deployments:
            value = deployments[-1]["id"]
        chosen = [d for d in deployments if d["id"] == value]
        return StartSpec.of_deployment(chosen[0]) if chosen else StartSpec()

    def open_start(self, callback: Any) -> None:
        self.app.push_screen(StartDialog(self.start_spec()), callback)
