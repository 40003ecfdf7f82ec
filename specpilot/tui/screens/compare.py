"""Two deployments' profiles side by side: each one's best accepted profile with its speedup and spread,
and the gaps of its latest round."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.table import Table
from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Select, Static

from specpilot.tui.data import speedup_text


class CompareScreen(ModalScreen[None]):
    BINDINGS = [("escape", "app.pop_screen", "Close")]

    def __init__(self, deployments: list[dict[str, Any]]) -> None:
        super().__init__()
        self.deployments = deployments

    def compose(self) -> ComposeResult:
        options = [(f"#{d['id']} {Path(d['target']).name} · {d['device']} {d['dtype']} · {d['load']}", d["id"])
                   for d in self.deployments]
        ids = [d["id"] for d in self.deployments]
        with Horizontal(id="compare"):
            for side, default in (("a", ids[0]), ("b", ids[min(1, len(ids) - 1)])):
                with Vertical(classes="compare-side"):
                    yield Select(options, value=default, allow_blank=False, id=f"dep-{side}")
                    yield Static(id=f"profile-{side}")
        yield Footer()

    def on_mount(self) -> None:
        for side in "ab":
            self.load(side, self.query_one(f"#dep-{side}", Select).value)

    @on(Select.Changed)
    def _changed(self, event: Select.Changed) -> None:
        self.load(event.select.id.removeprefix("dep-"), event.value)

    @work(thread=True, group="compare", exit_on_error=False)
    def load(self, side: str, deployment: int) -> None:
        try:
            profile = self.app.reader.profile(int(deployment))
        except Exception as err:
            self.app.call_from_thread(self.app.report, err, "compare")
            return
        self.app.call_from_thread(self.query_one(f"#profile-{side}", Static).update, _profile_table(profile))


def _profile_table(profile: dict[str, Any]) -> Table:
    table = Table(show_header=True, expand=True, title="best accepted profile, and the latest round's gaps")
    table.add_column("")
    table.add_column("")
    best = profile["best"]
    if best is None:
        table.add_row("profile", "nothing accepted yet (stock)")
    else:
        params = json.loads(best["params"]) if best["params"] else {}
        table.add_row("candidate", f"#{best['id']}")
        table.add_row("speedup", speedup_text(best))
        table.add_row("mechanisms", json.dumps(params.get("mechanisms")))
        for name, value in sorted((params.get("tunables") or {}).items()):
            table.add_row(f"  {name}", json.dumps(value))
    for gap in profile["gaps"]:
        table.add_row(f"gap {gap['rank']}. {gap['name']}", f"{gap['measured_ms'] - gap['floor_ms']:.3f} ms")
    return table
