"""Modal dialogs: the flags a round starts with, and the file an export goes to."""

from __future__ import annotations

from dataclasses import replace

from textual.app import ComposeResult
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label

from specpilot.tui.runs import StartSpec


class StartDialog(ModalScreen[StartSpec | None]):
    """The deployment's flags, filled in from memory, and the optimizer's; dismissed with the spec or None."""

    BINDINGS = [("escape", "cancel", "Cancel"), ("ctrl+s", "start", "Start")]  # Enter in a field starts too
    FIELDS = (("model_path", "model path (empty: embedded)"), ("algorithm", "speculative algorithm"),
              ("draft_path", "draft model path"), ("device", "device"), ("dtype", "dtype"),
              ("rounds", "rounds"), ("agents", "agents"), ("max_new_tokens", "max new tokens"),
              ("extra", "more optimize flags"))

    def __init__(self, spec: StartSpec) -> None:
        super().__init__()
        self.spec = spec

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Start a round of specpilot optimize", classes="title")
            with Grid(id="start-fields"):
                for name, label in self.FIELDS:
                    yield Label(label)
                    yield Input(str(getattr(self.spec, name)), id=f"f-{name}",
                                type="integer" if isinstance(getattr(self.spec, name), int) else "text")
            yield Checkbox("--resume: go on after the last candidate judged", self.spec.resume, id="f-resume")
            with Horizontal(classes="buttons"):
                yield Button("Start", variant="primary", id="start")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
        else:
            self.action_start()

    def on_input_submitted(self) -> None:
        self.action_start()

    def action_start(self) -> None:
        values = {}
        for name, _ in self.FIELDS:
            raw = self.query_one(f"#f-{name}", Input).value.strip()
            if isinstance(getattr(self.spec, name), int):
                if not raw.isdigit() or int(raw) < 1:
                    self.notify(f"{name.replace('_', ' ')}: a positive whole number", severity="error")
                    return
                values[name] = int(raw)
            else:
                values[name] = raw
        self.dismiss(replace(self.spec, **values, resume=self.query_one("#f-resume", Checkbox).value))

    def action_cancel(self) -> None:
        self.dismiss(None)


class PathDialog(ModalScreen[str | None]):
    """One path, e.g. where an export is written."""

    BINDINGS = [("escape", "cancel", "Cancel")]

    def __init__(self, title: str, default: str) -> None:
        super().__init__()
        self.title_text, self.default = title, default

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.title_text, classes="title")
            yield Input(self.default, id="path")
            with Horizontal(classes="buttons"):
                yield Button("OK", variant="primary", id="ok")
                yield Button("Cancel", id="cancel")

    def on_input_submitted(self) -> None:
        self.dismiss(self.query_one("#path", Input).value.strip() or None)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(self.query_one("#path", Input).value.strip() or None if event.button.id == "ok" else None)

    def action_cancel(self) -> None:
        self.dismiss(None)
