"""The terminal app through Textual's Pilot, against a memory a real `specpilot optimize` run wrote and a
real `specpilot serve` on loopback: every screen and action, a round started, paused, resumed and stopped
from the app and outliving the app's kill -9, paging and filtering, export, compare, the palette, help,
themes, and errors as notifications."""

from __future__ import annotations

import html
import json
import re
import signal
import sys
from pathlib import Path

import httpx
import pytest
from textual.coordinate import Coordinate
from textual.widgets import DataTable, Input, Select, Tree
from tui_support import app_started_round, copy_db, until

from specpilot.tui.app import SpecPilotApp
from specpilot.tui.data import MemoryReader
from specpilot.tui.runs import RunControl, _proc_state
from specpilot.tui.screens.compare import CompareScreen
from specpilot.tui.screens.dialogs import PathDialog, StartDialog
from specpilot.tui.screens.help import HelpScreen
from specpilot.tui.screens.memory import DETAIL_DELAY_S, MemoryScreen
from specpilot.tui.screens.rounds import RoundsScreen
from specpilot.tui.screens.server import ServerScreen
from specpilot.tui.widgets import Histogram, TokenView

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from tui_large_db import fill  # noqa: E402

SIZE = (160, 48)
CLOSED = "http://127.0.0.1:9"  # nothing listens there


pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def shown(app) -> str:
    """The screen's text as the terminal shows it."""
    svg = app.export_screenshot()
    return html.unescape(re.sub(r"<[^>]+>", "", svg)).replace("\xa0", " ")


def errors(app) -> list[str]:
    return [n.message for n in app._notifications if n.severity == "error"]


async def test_rounds_screen_shows_the_recorded_round(tui_db):
    app = SpecPilotApp(tui_db, server=CLOSED)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        assert isinstance(screen, RoundsScreen)
        table = screen.query_one("#round-candidates", DataTable)
        await until(pilot, lambda: table.row_count == 1, what="the round's candidate")
        row = table.get_row_at(0)
        assert row[1] == "search-0" and ("accepted" in row[2] or "rejected" in row[2]) and "/8" in row[3]
        assert "×" in row[4]
        agents = screen.query_one("#agents", DataTable)
        assert agents.get_row_at(0)[:3] == ["search-0", "done", "1"]
        # the gaps as the speedup each costs, in their own units, before and after the round
        await until(pilot, lambda: all(s in shown(app) for s in ("1. verify", " ms · ", "τ ", "   after")),
                    what="the gap chart")
        # the labels repaint on the next refresh, which a loaded machine may not have reached yet
        await until(pilot, lambda: "Round 1 (id 1): finished" in shown(app), what="the round's title")
        await until(pilot, lambda: "the optimizer is gone" in shown(app), what="the run's state")  # it has ended
        await pilot.press("left_square_bracket", "right_square_bracket")  # older / newer round: only one here
        assert not errors(app)


async def test_a_round_started_from_the_app_outlives_its_kill_pauses_resumes_and_stops_cleanly(tui_db, tmp_path):
    db = copy_db(tui_db, tmp_path / "m.db")
    model = Path(MemoryReader(db).deployments()[0]["target"])
    app = SpecPilotApp(db, server=CLOSED)
    async with app.run_test(size=SIZE) as pilot:  # the dialog starts from the selected deployment's flags
        await until(pilot, lambda: app.screen.query_one("#deployment", Select).value == 1, what="the deployment")
        await pilot.press("s")
        assert isinstance(app.screen, StartDialog)
        assert app.screen.query_one("#f-model_path", Input).value == str(model)
    process, pid = app_started_round(db)  # the same dialog, in an app of its own process
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    # the app was killed: the round goes on
    assert _proc_state(pid) not in (None, "T")
    app = SpecPilotApp(db, server=CLOSED)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: f"running (pid {pid})" in shown(app), what="the running round")
        await until(pilot, lambda: "Round 2" in shown(app))
        await pilot.press("p")
        await until(pilot, lambda: _proc_state(pid) == "T", what="SIGSTOP")
        await until(pilot, lambda: f"paused (pid {pid})" in shown(app))
    app = SpecPilotApp(db, server=CLOSED)  # reopened: still paused
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: f"paused (pid {pid})" in shown(app), what="the paused round")
        await pilot.press("r")
        await until(pilot, lambda: _proc_state(pid) not in (None, "T"), what="SIGCONT")
        await pilot.press("x")  # SIGTERM: the candidate being judged finishes, the round is marked paused
        await until(pilot, lambda: app.runs.state().state == "gone", timeout=120, what="the clean stop")
        await until(pilot, lambda: "the optimizer is gone" in shown(app))
        assert not errors(app)
    reader = MemoryReader(db)
    second = reader.rounds()[-1]
    assert second["status"] == "incomplete"
    assert [e["kind"] for e in reader.events(second["id"])][-1] == "round paused"
    assert reader.query("PRAGMA integrity_check")[0]["integrity_check"] == "ok"
    assert "paused (SIGTERM)" in "\n".join(RunControl(reader).log_tail())


async def test_memory_screen_pages_filters_shows_a_candidate_and_exports(tui_db, tmp_path):
    db = copy_db(tui_db, tmp_path / "big.db")
    fill(db, 260)
    app = SpecPilotApp(db, server=CLOSED, mode="memory")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        assert isinstance(screen, MemoryScreen)
        table = screen.query_one("#candidates", DataTable)
        await until(pilot, lambda: screen.loaded == 200 and screen.total == 260, what="the first page")
        await until(pilot, lambda: screen.current == 1, what="the first candidate's detail")
        await until(pilot, lambda: "#1 from search-0" in shown(app), what="the detail's repaint")
        tree = screen.query_one("#deployments", Tree)
        await until(pilot, lambda: len(tree.root.children) == 1)
        assert len(tree.root.children[0].children) == 4  # the real round and three filled ones
        # the cursor near the end of the page loads the next
        table.focus()
        table.move_cursor(row=199)
        await until(pilot, lambda: screen.loaded == 260, what="the second page")
        # the cursor's own choice lands first (its detail follows once it rests), so it cannot replace ours
        resting = int(table.coordinate_to_cell_key(Coordinate(199, 0)).row_key.value)
        await until(pilot, lambda: screen.current == resting, what="the resting cursor's candidate")
        await pilot.pause(4 * DETAIL_DELAY_S)
        # a candidate with a patch and a parent: highlighted patch, diff, lineage
        patched = MemoryReader(db).query("SELECT id FROM candidates WHERE patch IS NOT NULL AND parent_id IS NOT NULL "
                                         "ORDER BY id LIMIT 1")[0]["id"]
        screen.choose(patched)
        await until(pilot, lambda: screen.current == patched)
        seen = {}
        for tab in ("tab-patch", "tab-diff", "tab-lineage", "tab-mechanisms", "tab-verdict"):
            screen.query_one("#detail").active = tab
            await pilot.pause(0.1)
            seen[tab] = shown(app)
        assert "specpilot/engine/step.py" in seen["tab-patch"] and "x = " in seen["tab-patch"]
        assert f"+++ candidate {patched}" in seen["tab-diff"]
        assert "(child)" in seen["tab-lineage"] or "#" in seen["tab-lineage"]
        assert len(screen.query_one("#lineage", Tree).root.children) == 1
        # search and verdict filters
        await pilot.press("slash")
        await pilot.press(*'"block-size": 8')
        await until(pilot, lambda: screen.filter.text == '"block-size": 8' and 0 < screen.total < 260 and
                    screen.loaded == min(screen.total, 200), what="the search")
        await pilot.press("escape")
        screen.query_one("#verdict", Select).value = "accepted"
        await until(pilot, lambda: screen.filter.verdict == "accepted" and screen.loaded == min(screen.total, 200))
        accepted = screen.total
        assert accepted == MemoryReader(db).query(
            "SELECT COUNT(*) AS n FROM candidates c JOIN validations v ON v.candidate_id = c.id WHERE v.accepted = 1 "
            "AND c.params LIKE '%\"block-size\": 8%'")[0]["n"]
        # export the filtered selection, then two marked rows
        out = tmp_path / "filtered.json"
        await pilot.press("e")
        assert isinstance(app.screen, PathDialog)
        app.screen.query_one("#path", Input).value = str(out)
        await pilot.press("enter")
        await until(pilot, lambda: out.is_file(), what="the export")
        assert len(json.loads(out.read_text())["candidates"]) == accepted
        table.focus()
        table.move_cursor(row=0)
        await pilot.press("space", "down", "space")
        assert len(screen.marked) == 2
        out2 = tmp_path / "marked.json"
        await pilot.press("e")
        app.screen.query_one("#path", Input).value = str(out2)
        await pilot.click("#ok")
        await until(pilot, lambda: out2.is_file())
        assert sorted(c["id"] for c in json.loads(out2.read_text())["candidates"]) == sorted(screen.marked)
        # a round in the tree narrows the table to it
        tree.select_node(tree.root.children[0].children[0])
        await until(pilot, lambda: screen.filter.round_id is not None and screen.loaded == screen.total == 1 or
                    (screen.filter.round_id is not None and screen.total == 0))
        assert not errors(app)


async def test_compare_two_deployments(tui_db, tmp_path):
    db = copy_db(tui_db, tmp_path / "two.db")
    from specpilot.memory import Memory

    memory = Memory(db)  # a second deployment, as another dtype's run would record it
    dep = memory.deployment("tiny", "ngram:default", "cpu", "bfloat16", "B=1")
    rid = memory.start_round(dep)
    cid = memory.add_candidate(rid, "search-0", params={"mechanisms": None, "tunables": {"ngram-assist": 1}})
    memory.validate(cid, True, speedup={"median": 1.25, "min": 1.2, "max": 1.3})
    memory.finish_round(rid)
    app = SpecPilotApp(db, server=CLOSED, mode="memory")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("c")
        assert isinstance(app.screen, CompareScreen)
        await until(pilot, lambda: "1.250×" in shown(app), what="the second deployment's profile")
        assert "ngram-assist" in shown(app) and "gap 1." in shown(app)
        await pilot.press("escape")
        assert isinstance(app.screen, MemoryScreen)


async def test_server_screen_live_state_and_a_coloured_stream(tui_server):
    app = SpecPilotApp("missing.db", server=tui_server, mode="server")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        assert isinstance(screen, ServerScreen)
        await until(pilot, lambda: screen.connected is True, what="the server")
        await pilot.click("#prompt")
        await pilot.press(*"w5 w6 w7 w5 w6 w7 w5 w6", "enter")
        view = screen.query_one(TokenView)
        await until(pilot, lambda: "bonus" in view.origins and screen.series["throughput"] and
                    max(screen.series["throughput"]) > 0, timeout=60, what="the stream and a throughput sample")
        assert len(view.origins) == len(view.texts) > 1
        await until(pilot, lambda: " bonus " in shown(app) and " draft " in shown(app),
                    what="the legend, with each origin's count")
        await until(pilot, lambda: max(screen.series["accept"]) > 1.0, what="the accept length")
        histogram = screen.query_one(Histogram)
        assert sum(histogram.counts) > 0 and any(histogram.counts[2:])  # passes that accepted drafts
        assert not errors(app)
        # the server goes away (here: the app is pointed where nothing listens), then comes back
        screen.query_one("#url", Input).value = CLOSED
        await pilot.click("#connect")
        await until(pilot, lambda: screen.connected is False, what="the lost server")
        await until(pilot, lambda: "disconnected from" in shown(app), what="the disconnected state's repaint")
        # back by Enter in the address field (a second click this soon would land in the button's 0.2 s press
        # effect, which Textual ignores)
        await pilot.click("#url")
        screen.query_one("#url", Input).value = tui_server
        await pilot.press("enter")
        await until(pilot, lambda: screen.connected is True, what="the reconnect")


def test_stream_chunks_carry_token_origins_and_texts_without_changing_tokens(tui_server):
    body = {"text": "w5 w6 w7 w5 w6 w7 w5 w6", "sampling_params": {"max_new_tokens": 24, "temperature": 0.0}}
    plain = httpx.post(tui_server + "/generate", json=body, timeout=60, trust_env=False).json()
    origins = plain["meta_info"]["token_origins"]
    assert len(origins) == len(plain["output_ids"]) and origins[0] == "target"
    assert set(origins) <= {"target", "draft", "bonus", "ngram"} and "bonus" in origins
    last, streamed, texts = None, [], []
    with httpx.stream("POST", tui_server + "/generate", json=body | {"stream": True}, timeout=60,
                      trust_env=False) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
                meta = last["meta_info"]
                streamed += meta["new_token_origins"]  # each chunk describes its new ids only
                texts += meta["new_token_texts"]
                assert len(streamed) == len(texts) == len(last["output_ids"])
    assert last["output_ids"] == plain["output_ids"]  # the same tokens, streamed or not
    assert streamed == origins == last["meta_info"]["token_origins"]


async def test_palette_help_theme_and_errors_as_notifications(tmp_path):
    app = SpecPilotApp(tmp_path / "none.db", server=CLOSED)
    async with app.run_test(size=SIZE) as pilot:
        assert any("no memory file" in n.message for n in app._notifications)
        await pilot.press("p")  # nothing to pause: a notification, not a traceback
        await until(pilot, lambda: any("no round to signal" in m for m in errors(app)))
        await pilot.press("ctrl+p")
        await pilot.press(*"Memory")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await until(pilot, lambda: app.current_mode == "memory", what="the palette's action")
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.press("t")
        assert app.theme == "textual-light"
        await pilot.press("3")
        assert app.current_mode == "server"
        await pilot.press("1")
        assert app.current_mode == "rounds"
        await pilot.press("ctrl+s")
        await until(pilot, lambda: list(tmp_path.glob("specpilot-rounds-*.svg")), what="the screenshot")
        assert app.is_running


def test_tui_cli_parses():
    from specpilot.cli import build_parser

    args = build_parser().parse_args(["tui", "--db", "x.db", "--server", "http://h:1", "--mode", "memory"])
    assert (args.db, args.server, args.mode) == ("x.db", "http://h:1", "memory")
