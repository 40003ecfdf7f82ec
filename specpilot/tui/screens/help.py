"""The key bindings of the app and of the screen it was opened from."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Static


NAMES = {"question_mark": "?", "slash": "/", "left_square_bracket": "[", "right_square_bracket": "]"}


def _keys(key: str) -> str:
    return " / ".join(NAMES.get(k, k) for k in key.split(","))


class HelpScreen(ModalScreen[None]):
    BINDINGS = [("escape,question_mark,q", "app.pop_screen", "Close")]

    def __init__(self, under: Screen) -> None:
        super().__init__()
        self.under = under

    def compose(self) -> ComposeResult:
        table = Table(title="SpecPilot: keys (ctrl+p: every action by name; the mouse works everywhere)",
                      expand=True)
        table.add_column("key", style="bold cyan", no_wrap=True)
        table.add_column("action")
        table.add_column("where", style="dim")
        seen = set()
        for where, bindings in (("everywhere", self.app.BINDINGS), (type(self.under).__name__, self.under.BINDINGS)):
            for binding in bindings:
                key, action, description = (binding.key, binding.action, binding.description) if isinstance(
                    binding, Binding) else binding
                if (key, action) not in seen:
                    seen.add((key, action))
                    table.add_row(_keys(key), description, where)
        yield VerticalScroll(Static(table), id="help")
        yield Footer()
