"""SVG snapshots of the terminal app (pytest-textual-snapshot; `--snapshot-update` rewrites them after a
deliberate change), on the real memory and with a server that is not there. Only what is the same on every
run is pictured: a verdict's timings and a live server's figures vary, so those screens are checked by the
Pilot tests (test_tui.py) instead of by picture."""

from __future__ import annotations

import pytest
from textual.widgets import Input
from tui_support import copy_db

from specpilot.tui.app import SpecPilotApp

SIZE = (140, 40)
CLOSED = "http://127.0.0.1:9"


@pytest.fixture
def db(tui_db, tmp_path, monkeypatch):
    """A copy of the real memory, opened by a relative path (the header shows it as given)."""
    monkeypatch.chdir(tmp_path)
    copy_db(tui_db, tmp_path / "memory.db")
    return "memory.db"


async def _settle(pilot) -> None:
    await pilot.pause(0.5)
    await pilot.app.workers.wait_for_complete()
    for field in pilot.app.screen.query(Input):  # a blinking cursor is caught on or off at random
        field.cursor_blink = False
    await pilot.pause(0.1)


def test_memory_tree_and_an_empty_filter(snap_compare, db):
    async def run_before(pilot) -> None:
        await _settle(pilot)
        pilot.app.screen.query_one("#verdict").value = "pending"  # a finished run has none: no timings shown
        await _settle(pilot)

    assert snap_compare(SpecPilotApp(db, server=CLOSED, mode="memory"), terminal_size=SIZE, run_before=run_before)


def test_server_screen_without_a_server(snap_compare, db):
    assert snap_compare(SpecPilotApp(db, server=CLOSED, mode="server"), terminal_size=SIZE, run_before=_settle)


def test_help_screen_light_theme(snap_compare, db):
    async def run_before(pilot) -> None:
        await _settle(pilot)
        await pilot.press("t", "question_mark")
        await _settle(pilot)

    assert snap_compare(SpecPilotApp(db, server=CLOSED, mode="server"), terminal_size=SIZE, run_before=run_before)


def test_start_dialog(snap_compare, tmp_path, monkeypatch):
    async def run_before(pilot) -> None:
        await _settle(pilot)
        await pilot.press("s")
        await _settle(pilot)

    monkeypatch.chdir(tmp_path)
    app = SpecPilotApp("new.db", server=CLOSED)  # no memory yet: the embedded model's defaults
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
