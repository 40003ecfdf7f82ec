"""Memory: deployments → rounds in a tree, their candidates in a paged table (filter by verdict, search
agent, profile, reason and patch), and the chosen candidate's verdict (forcing, speedup with its spread),
patch (highlighted), diff against its parent, lineage, and the mechanisms with their preconditions. Rows
load a page at a time as the cursor nears the end, so a database of any size opens and filters at once."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import DataTable, Footer, Header, Input, Label, Select, Static, TabbedContent, TabPane, Tree
from textual.widgets.data_table import RowDoesNotExist

from specpilot.tui.screens.closing import while_shown
from specpilot.tui.data import PAGE, CandidateFilter, forcing_summary, speedup_text, verdict_text

DETAIL_DELAY_S = 0.08
COLUMNS = (" ", "id", "dep", "round", "agent", "verdict", "forcing", "speedup ± spread", "reason / profile")
LINEAGE_DEPTH = 24  # ancestors shown nested; older ones are summed up in one line
LINEAGE_CHILDREN = 50
VERDICTS = [("all verdicts", "all"), ("accepted", "accepted"), ("rejected", "rejected"), ("pending", "pending")]


class MemoryScreen(Screen):
    AUTO_FOCUS = "#candidates"
    BINDINGS = [("slash", "focus_search", "Search"), ("escape", "focus_table", "Table"), ("space", "mark", "Mark"),
                ("e", "app.export", "Export"), ("c", "app.compare", "Compare")]

    def __init__(self) -> None:
        super().__init__()
        self.filter = CandidateFilter()
        self.total = 0
        self.loaded = 0
        self.marked: set[int] = set()
        self.current: int | None = None  # the candidate whose detail is shown
        self.wanted: int | None = None  # the one last chosen
        self._settle: Timer | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="memory-body"):
            yield Tree("memory", id="deployments")
            with Vertical(id="memory-center"):
                with Horizontal(id="filters"):
                    yield Input(placeholder="search agent, profile, reason, patch  (/)", id="search")
                    yield Select(VERDICTS, value="all", allow_blank=False, id="verdict")
                yield Label("", id="count")
                yield DataTable(id="candidates", cursor_type="row", zebra_stripes=True)
            with TabbedContent(id="detail"):
                with TabPane("Verdict", id="tab-verdict"):
                    yield VerticalScroll(Static(id="verdict-text"))
                with TabPane("Patch", id="tab-patch"):
                    yield VerticalScroll(Static(id="patch-text"))
                with TabPane("Diff", id="tab-diff"):
                    yield VerticalScroll(Static(id="diff-text"))
                with TabPane("Lineage", id="tab-lineage"):
                    yield Tree("lineage", id="lineage")
                with TabPane("Mechanisms", id="tab-mechanisms"):
                    yield DataTable(id="mechanisms", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#mechanisms", DataTable).add_columns("mechanism", "speedup", "preconditions", "description")
        self.load_tree()
        self.reload()

    # ---- the tree of deployments and rounds ---------------------------------------------------
    @work(thread=True, exclusive=True, group="memory-tree", exit_on_error=False)
    def load_tree(self) -> None:
        try:
            reader = self.app.reader
            deployments, rounds, mechanisms = reader.deployments(), reader.rounds(), reader.mechanisms()
        except Exception as err:
            self.app.call_from_thread(self.app.report, err, "memory")
            return
        self.app.call_from_thread(self._fill_tree, deployments, rounds, mechanisms)

    @while_shown
    def _fill_tree(self, deployments: list[dict[str, Any]], rounds: list[dict[str, Any]],
                   mechanisms: list[dict[str, Any]]) -> None:
        tree = self.query_one("#deployments", Tree)
        tree.clear()
        tree.root.data = ("all", None)
        tree.root.expand()
        for d in deployments:
            node = tree.root.add(f"#{d['id']} {Path(d['target']).name} · {d['drafter']} · {d['device']} {d['dtype']} · "
                                 f"{d['load']}",
                                 data=("deployment", d["id"]), expand=True)
            for r in rounds:
                if r["deployment_id"] == d["id"]:
                    node.add_leaf(f"round {r['number']} · {r['status']} · {r['candidates']} candidates",
                                  data=("round", r["id"]))
        table = self.query_one("#mechanisms", DataTable)
        table.clear()
        for m in mechanisms:
            table.add_row(m["name"], "—" if m["speedup"] is None else f"{m['speedup']:.3f}×", m["preconditions"],
                          m["description"])

    @on(Tree.NodeSelected, "#deployments")
    def _pick(self, event: Tree.NodeSelected) -> None:
        kind, value = event.node.data or ("all", None)
        dep = value if kind == "deployment" else None
        if kind == "round":
            dep = event.node.parent.data[1]
        self.filter = CandidateFilter(dep, value if kind == "round" else None, self.filter.verdict, self.filter.text)
        self.reload()

    # ---- the candidate table ------------------------------------------------------------------
    @on(Input.Changed, "#search")
    def _search(self, event: Input.Changed) -> None:
        self.filter = CandidateFilter(self.filter.deployment, self.filter.round_id, self.filter.verdict,
                                      event.value.strip())
        self.reload()

    @on(Select.Changed, "#verdict")
    def _verdict(self, event: Select.Changed) -> None:
        self.filter = CandidateFilter(self.filter.deployment, self.filter.round_id, str(event.value), self.filter.text)
        self.reload()

    def reload(self) -> None:
        self.loaded = 0
        table = self.query_one("#candidates", DataTable)
        table.clear(columns=True)  # the columns too: their widths then fit the rows this filter shows
        table.add_columns(*COLUMNS)
        self.load_page(self.filter, 0)

    @work(thread=True, exclusive=True, group="memory-page", exit_on_error=False)
    def load_page(self, flt: CandidateFilter, offset: int) -> None:
        try:
            reader = self.app.reader
            total = reader.count(flt) if offset == 0 else self.total
            rows = reader.candidates(flt, offset, PAGE)
        except Exception as err:
            self.app.call_from_thread(self.app.report, err, "memory")
            return
        self.app.call_from_thread(self._add_rows, flt, offset, total, rows)

    @while_shown
    def _add_rows(self, flt: CandidateFilter, offset: int, total: int, rows: list[dict[str, Any]]) -> None:
        if flt != self.filter or offset != self.loaded:  # a newer filter or page came first
            return
        table = self.query_one("#candidates", DataTable)
        for c in rows:
            verdict = verdict_text(c)
            style = {"accepted": "green", "rejected": "red"}.get(verdict, "yellow")
            table.add_row("●" if c["id"] in self.marked else " ", str(c["id"]), str(c["deployment_id"]),
                          str(c["round"]), c["agent"], Text(verdict, style=style),
                          forcing_summary(c["forcing"], c["exact"]), speedup_text(c),
                          (c["reason"] or c["params"] or "")[:70], key=str(c["id"]))
        self.total, self.loaded = total, offset + len(rows)
        self.query_one("#count", Label).update(
            f"{total} candidates ({self.loaded} loaded)" + (f", {len(self.marked)} marked" if self.marked else ""))
        if offset == 0 and rows:
            self.choose(rows[0]["id"])
        elif offset == 0:
            self._clear_detail()

    def _clear_detail(self) -> None:
        if self._settle is not None:
            self._settle.stop()
        self.current = self.wanted = None
        for pane in ("#verdict-text", "#patch-text", "#diff-text"):
            self.query_one(pane, Static).update(Text("no candidate matches the filter", style="dim"))
        self.query_one("#lineage", Tree).clear()

    @on(DataTable.RowHighlighted, "#candidates")
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.row_key.value is None:
            return
        if event.cursor_row >= self.loaded - 20 and self.loaded < self.total:
            self.load_page(self.filter, self.loaded)
        # the detail follows once the cursor rests, so holding a key scrolls at the table's own pace
        if self._settle is not None:
            self._settle.stop()
        cid = int(event.row_key.value)
        self._settle = self.set_timer(DETAIL_DELAY_S, lambda: self._rest_on(cid))

    def _rest_on(self, cid: int) -> None:
        """The cursor rested on this row: its detail, if the row is still in the table (a filter may have
        replaced the rows since)."""
        try:
            self.query_one("#candidates", DataTable).get_row_index(str(cid))
        except RowDoesNotExist:
            return
        self._show_candidate(cid)

    def action_focus_search(self) -> None:
        self.query_one("#search", Input).focus()

    def action_focus_table(self) -> None:
        self.query_one("#candidates", DataTable).focus()

    def action_mark(self) -> None:
        table = self.query_one("#candidates", DataTable)
        if not table.row_count:
            return
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        cid = int(key.value)
        self.marked ^= {cid}
        table.update_cell(key, table.ordered_columns[0].key, "●" if cid in self.marked else " ")
        self.query_one("#count", Label).update(f"{self.total} candidates ({self.loaded} loaded), "
                                               f"{len(self.marked)} marked")

    def selection(self) -> list[int]:
        """What export writes: the marked candidates, else every candidate the filter shows."""
        if self.marked:
            return sorted(self.marked)
        return [r["id"] for r in self.app.reader.candidates(self.filter, 0, max(self.total, 1))]

    # ---- the chosen candidate -----------------------------------------------------------------
    def choose(self, cid: int) -> None:
        """Show this candidate's detail (a slower answer for one chosen before is dropped, and a cursor's
        pending choice is cancelled)."""
        if self._settle is not None:
            self._settle.stop()
        self._show_candidate(cid)

    def _show_candidate(self, cid: int) -> None:
        self.wanted = cid
        self.show_candidate(cid)

    @work(thread=True, exclusive=True, group="memory-detail", exit_on_error=False)
    def show_candidate(self, cid: int) -> None:
        try:
            reader = self.app.reader
            cand = reader.candidate(cid)
            if cand is None:
                return
            parent = reader.candidate(cand["parent_id"]) if cand["parent_id"] else None
            lineage = reader.lineage(cid)
        except Exception as err:
            self.app.call_from_thread(self.app.report, err, "memory")
            return
        self.app.call_from_thread(self._show, cand, parent, lineage)

    @while_shown
    def _show(self, cand: dict[str, Any], parent: dict[str, Any] | None,
              lineage: tuple[list[dict[str, Any]], list[dict[str, Any]]]) -> None:
        if cand["id"] != self.wanted:
            return
        self.current = cand["id"]
        self.query_one("#verdict-text", Static).update(_verdict_table(cand))
        patch = cand["patch"]
        self.query_one("#patch-text", Static).update(
            Syntax(patch, "diff", line_numbers=True, word_wrap=False) if patch
            else Text(f"candidate {cand['id']} is a profile, not a patch:\n\n{_pretty(cand['params'])}"))
        self.query_one("#diff-text", Static).update(_diff(cand, parent))
        tree = self.query_one("#lineage", Tree)
        tree.clear()
        chain, children = lineage
        node = tree.root
        tree.root.set_label("lineage")
        if len(chain) > LINEAGE_DEPTH:  # a tree that deep is unreadable (and Textual's is recursive)
            node = node.add(f"… {len(chain) - LINEAGE_DEPTH} earlier ancestors, from #{chain[0]['id']}", expand=True)
            chain = chain[-LINEAGE_DEPTH:]
        for anc in chain:
            node = node.add(f"#{anc['id']} {anc['agent']}", expand=True)
        for child in children[:LINEAGE_CHILDREN]:
            node.add_leaf(f"#{child['id']} {child['agent']} (child)")
        if len(children) > LINEAGE_CHILDREN:
            node.add_leaf(f"… {len(children) - LINEAGE_CHILDREN} more children")
        tree.root.expand_all()


def _pretty(params: str | None) -> str:
    return json.dumps(json.loads(params), indent=2, sort_keys=True) if params else "(stock)"


def _verdict_table(c: dict[str, Any]) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    verdict = verdict_text(c)
    rows = [("candidate", f"#{c['id']} from {c['agent']} (round {c['round']}, deployment {c['deployment_id']})"),
            ("parent", f"#{c['parent_id']}" if c["parent_id"] else "—"),
            ("verdict", Text(verdict, style={"accepted": "green", "rejected": "red"}.get(verdict, "yellow"))),
            ("reason", c["reason"] or "—"), ("forcing", forcing_summary(c["forcing"], c["exact"])),
            ("speedup", speedup_text(c)),
            ("spread", "—" if c["speedup_min"] is None else f"{c['speedup_min']:.3f}× … {c['speedup_max']:.3f}×"),
            ("noise band", "—" if c["noise_band"] is None else f"{c['noise_band']:.3f}"),
            ("profile", _pretty(c["params"]))]
    if c["forcing"]:
        rows.append(("forcing detail", json.dumps(json.loads(c["forcing"]), indent=2, sort_keys=True)))
    for key, value in rows:
        table.add_row(key, value)
    return table


def _diff(cand: dict[str, Any], parent: dict[str, Any] | None) -> Syntax | Text:
    """The candidate against its parent: their patches where either has one, else their profiles."""
    if parent is None:
        return Text(f"candidate {cand['id']} has no parent", style="dim")
    use_patch = bool(cand["patch"] or parent["patch"])
    old = (parent["patch"] or "") if use_patch else _pretty(parent["params"])
    new = (cand["patch"] or "") if use_patch else _pretty(cand["params"])
    lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), f"candidate {parent['id']}",
                                      f"candidate {cand['id']}", lineterm=""))
    return Syntax("\n".join(lines), "diff") if lines else Text("identical to its parent", style="dim")
