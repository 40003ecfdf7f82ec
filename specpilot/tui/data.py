"""Read-only access to the optimizer's memory. The optimizer writes the file (WAL) while the app watches it,
so the app opens it read-only, runs short queries on a fresh connection per poll (a reader never blocks
the writer) and pages candidates with LIMIT/OFFSET so a database of any size opens at once."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAGE = 200  # candidate rows fetched per page


@dataclass(frozen=True)
class CandidateFilter:
    """What the candidate table shows: a deployment, a round, a verdict, and free text over agent, params,
    reason and patch."""

    deployment: int | None = None
    round_id: int | None = None
    verdict: str = "all"  # "all", "accepted", "rejected", "pending"
    text: str = ""

    def where(self) -> tuple[str, list[Any]]:
        clauses, args = [], []
        if self.deployment is not None:
            clauses.append("r.deployment_id = ?")
            args.append(self.deployment)
        if self.round_id is not None:
            clauses.append("c.round_id = ?")
            args.append(self.round_id)
        if self.verdict == "accepted":
            clauses.append("v.accepted = 1")
        elif self.verdict == "rejected":
            clauses.append("v.accepted = 0")
        elif self.verdict == "pending":
            clauses.append("v.id IS NULL")
        if self.text:
            clauses.append("(c.agent LIKE ? OR c.params LIKE ? OR v.reason LIKE ? OR c.patch LIKE ?)")
            args += [f"%{self.text}%"] * 4
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", args


_CANDIDATES = ("SELECT c.id, c.round_id, r.number AS round, r.deployment_id, c.agent, c.parent_id, c.params, "
               "c.patch IS NOT NULL AS has_patch, v.accepted, v.reason, v.forcing, v.exact, v.speedup_median, "
               "v.speedup_min, v.speedup_max, v.noise_band FROM candidates c JOIN rounds r ON r.id = c.round_id "
               "LEFT JOIN validations v ON v.candidate_id = c.id")


class MemoryReader:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def exists(self) -> bool:
        return self.path.is_file()

    @contextmanager
    def _conn(self) -> Iterator[sqlite3.Connection]:
        if not self.exists:
            raise FileNotFoundError(f"no memory file at {self.path} (run `specpilot optimize --db {self.path}`)")
        conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=2.0)
        conn.row_factory = sqlite3.Row
        try:
            yield conn
        finally:
            conn.close()

    def query(self, sql: str, args: list[Any] | tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with self._conn() as conn:
            return [dict(r) for r in conn.execute(sql, args)]

    def deployments(self) -> list[dict[str, Any]]:
        return self.query("SELECT d.*, (SELECT COUNT(*) FROM rounds r WHERE r.deployment_id = d.id) AS rounds "
                          "FROM deployments d ORDER BY d.id")

    def rounds(self, deployment: int | None = None) -> list[dict[str, Any]]:
        sql = ("SELECT r.*, (SELECT COUNT(*) FROM candidates c WHERE c.round_id = r.id) AS candidates FROM rounds r")
        if deployment is None:
            return self.query(sql + " ORDER BY r.id")
        return self.query(sql + " WHERE r.deployment_id = ? ORDER BY r.number", [deployment])

    def gaps(self, round_id: int) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM gaps WHERE round_id = ? ORDER BY rank", [round_id])

    def gaps_after(self, round_id: int) -> list[dict[str, Any]]:
        """The gaps the optimizer measured when the round ended (an event; none while it runs)."""
        rows = self.query("SELECT detail FROM events WHERE round_id = ? AND kind = 'gaps after' ORDER BY id DESC "
                          "LIMIT 1", [round_id])
        return json.loads(rows[0]["detail"])["gaps"] if rows else []

    def events(self, round_id: int | None = None, after: int = 0) -> list[dict[str, Any]]:
        if round_id is None:
            return self.query("SELECT * FROM events WHERE id > ? ORDER BY id", [after])
        return self.query("SELECT * FROM events WHERE round_id = ? AND id > ? ORDER BY id", [round_id, after])

    def last_event(self, kind: str) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM events WHERE kind = ? ORDER BY id DESC LIMIT 1", [kind])
        return rows[0] if rows else None

    def count(self, flt: CandidateFilter) -> int:
        where, args = flt.where()
        return self.query("SELECT COUNT(*) AS n FROM candidates c JOIN rounds r ON r.id = c.round_id "
                          "LEFT JOIN validations v ON v.candidate_id = c.id" + where, args)[0]["n"]

    def candidates(self, flt: CandidateFilter, offset: int = 0, limit: int = PAGE) -> list[dict[str, Any]]:
        where, args = flt.where()
        return self.query(_CANDIDATES + where + " ORDER BY c.id LIMIT ? OFFSET ?", [*args, limit, offset])

    def candidates_of_round(self, round_id: int) -> list[dict[str, Any]]:
        return self.query(_CANDIDATES + " WHERE c.round_id = ? ORDER BY c.id", [round_id])

    def candidate(self, cid: int) -> dict[str, Any] | None:
        rows = self.query("SELECT c.*, r.number AS round, r.deployment_id, v.accepted, v.reason, v.forcing, v.exact, "
                          "v.speedup_median, v.speedup_min, v.speedup_max, v.noise_band, v.commit_sha "
                          "FROM candidates c JOIN rounds r ON r.id = c.round_id "
                          "LEFT JOIN validations v ON v.candidate_id = c.id WHERE c.id = ?", [cid])
        return rows[0] if rows else None

    def lineage(self, cid: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The candidate's ancestors (root first, itself last) and its children."""
        chain = self.query("WITH RECURSIVE up(id, parent_id, agent, depth) AS ("
                           "SELECT id, parent_id, agent, 0 FROM candidates WHERE id = ? UNION ALL "
                           "SELECT c.id, c.parent_id, c.agent, up.depth + 1 FROM candidates c JOIN up "
                           "ON c.id = up.parent_id) SELECT id, agent FROM up ORDER BY depth DESC", [cid])
        children = self.query("SELECT id, agent FROM candidates WHERE parent_id = ? ORDER BY id", [cid])
        return chain, children

    def mechanisms(self) -> list[dict[str, Any]]:
        return self.query("SELECT m.*, (SELECT v.speedup_median FROM validations v WHERE v.candidate_id = "
                          "m.first_candidate_id AND v.accepted = 1) AS speedup FROM mechanisms m ORDER BY m.name")

    def profile(self, deployment: int) -> dict[str, Any]:
        """A deployment's best accepted profile and the gaps of its latest round (what compare shows)."""
        best = self.query("SELECT c.id, c.params, v.speedup_median, v.speedup_min, v.speedup_max FROM candidates c "
                          "JOIN validations v ON v.candidate_id = c.id JOIN rounds r ON r.id = c.round_id "
                          "WHERE r.deployment_id = ? AND v.accepted = 1 ORDER BY v.speedup_median DESC LIMIT 1",
                          [deployment])
        last = self.query("SELECT id FROM rounds WHERE deployment_id = ? ORDER BY number DESC LIMIT 1", [deployment])
        return {"best": best[0] if best else None, "gaps": self.gaps(last[0]["id"]) if last else []}

    def export(self, ids: list[int]) -> list[dict[str, Any]]:
        """The candidates with their verdicts, params and forcing decoded (what export writes)."""
        out = []
        for start in range(0, len(ids), 500):  # SQLite's parameter limit
            chunk = ids[start:start + 500]
            marks = ",".join("?" * len(chunk))
            out += self.query(f"SELECT c.*, v.accepted, v.reason, v.forcing, v.exact, v.speedup_median, v.speedup_min, "
                              f"v.speedup_max, v.noise_band FROM candidates c LEFT JOIN validations v "
                              f"ON v.candidate_id = c.id WHERE c.id IN ({marks}) ORDER BY c.id", chunk)
        for row in out:
            for key in ("params", "forcing"):
                row[key] = json.loads(row[key]) if row[key] else None
        return out


def forcing_summary(forcing: str | None, exact: int | None) -> str:
    """A verdict's forcing in a few words: exact or statistical, passed, mismatches of positions checked."""
    if not forcing:
        return "—"
    data = json.loads(forcing)
    kind = "exact" if exact else "stat"
    passed = "pass" if data.get("passed") else "FAIL"
    return f"{kind} {passed} {data.get('non_tie_mismatches', 0)}/{data.get('positions_checked', '?')}"


def speedup_text(row: dict[str, Any]) -> str:
    """Median speedup ± half its min–max spread."""
    med = row.get("speedup_median")
    if med is None:
        return "—"
    lo, hi = row.get("speedup_min"), row.get("speedup_max")
    if lo is None or hi is None:
        return f"{med:.3f}×"
    return f"{med:.3f}× ±{(hi - lo) / 2:.3f}"


def verdict_text(row: dict[str, Any]) -> str:
    if row.get("accepted") is None:
        return "pending"
    return "accepted" if row["accepted"] else "rejected"
