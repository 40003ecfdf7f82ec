"""The memory's one SQLite file, on sqlite-utils: versioned migrations from schema/, WAL, and every write
one transaction, so a process killed mid-round leaves a database that opens cleanly."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlite_utils

SCHEMA_DIR = Path(__file__).resolve().parent / "schema"
DEFAULT_PATH = "specpilot-memory.db"


class MemoryStoreError(ValueError):
    """A memory file this version cannot use, or a reference to a row that does not exist."""


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def migrations() -> list[tuple[int, Path]]:
    """(version, file) of every schema/NNN_name.sql, in order."""
    found = sorted((int(p.name.split("_", 1)[0]), p) for p in SCHEMA_DIR.glob("[0-9]*_*.sql"))
    versions = [v for v, _ in found]
    if versions != list(range(1, len(found) + 1)):
        raise MemoryStoreError(f"schema migrations must be numbered 1..n without gaps, found {versions}")
    return found


class Memory:
    def __init__(self, path: str | Path = DEFAULT_PATH) -> None:
        self.path = Path(path)
        self.db = sqlite_utils.Database(self.path)
        self.db.enable_wal()
        self.db.execute("PRAGMA foreign_keys = ON")
        self._migrate()

    # ---- schema ---------------------------------------------------------------------------------
    def _migrate(self) -> None:
        with self.transaction():
            self.db.execute("CREATE TABLE IF NOT EXISTS schema_migrations "
                            "(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_utc TEXT NOT NULL)")
        applied = {row["version"] for row in self.db["schema_migrations"].rows}
        known = migrations()
        if applied - {v for v, _ in known}:
            raise MemoryStoreError(f"{self.path} was written by a newer specpilot (schema {max(applied)}); upgrade")
        for version, file in known:
            if version in applied:
                continue
            with self.transaction():  # a migration and its record commit together or not at all
                # another process opening the same new file may have applied it while this one waited
                if self.db.execute("SELECT 1 FROM schema_migrations WHERE version = ?", [version]).fetchone():
                    continue
                for statement in _statements(file.read_text()):
                    self.db.execute(statement)
                self.db["schema_migrations"].insert({"version": version, "name": file.stem, "applied_utc": _now()})

    @property
    def version(self) -> int:
        return max((row["version"] for row in self.db["schema_migrations"].rows), default=0)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        conn = self.db.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _insert(self, table: str, row: dict[str, Any]) -> int:
        with self.transaction():
            return self.db[table].insert(row).last_pk

    def _get(self, table: str, pk: int) -> dict[str, Any]:
        try:
            return self.db[table].get(pk)
        except sqlite_utils.db.NotFoundError:
            raise MemoryStoreError(f"no {table[:-1]} with id {pk} in {self.path}") from None

    # ---- writes ---------------------------------------------------------------------------------
    def deployment(self, target: str, drafter: str | None, device: str, dtype: str, load: str) -> int:
        """The id of this deployment, recorded on first sight."""
        key = {"target": target, "drafter": drafter, "device": device, "dtype": dtype, "load": load}
        where = " AND ".join(f"{k} IS ?" for k in key)
        found = list(self.db["deployments"].rows_where(where, list(key.values())))
        if found:
            return found[0]["id"]
        return self._insert("deployments", key | {"created_utc": _now()})

    def start_round(self, deployment_id: int) -> int:
        self._get("deployments", deployment_id)
        with self.transaction():
            number = self.db.execute("SELECT COALESCE(MAX(number), 0) + 1 FROM rounds WHERE deployment_id = ?",
                                     [deployment_id]).fetchone()[0]
            round_id = self.db["rounds"].insert({"deployment_id": deployment_id, "number": number,
                                                 "status": "running", "started_utc": _now()}).last_pk
            self.db["events"].insert({"round_id": round_id, "kind": "round started", "detail": None,
                                      "created_utc": _now()})
        return round_id

    def finish_round(self, round_id: int) -> None:
        self._get("rounds", round_id)
        with self.transaction():
            self.db["rounds"].update(round_id, {"status": "finished", "finished_utc": _now()})
            self.db["events"].insert({"round_id": round_id, "kind": "round finished", "detail": None,
                                      "created_utc": _now()})

    def pause_round(self, round_id: int) -> None:
        """A round its process stopped cleanly (SIGTERM): 'incomplete', for `--resume` to go on after it."""
        self._get("rounds", round_id)
        with self.transaction():
            self.db["rounds"].update(round_id, {"status": "incomplete"})
            self.db["events"].insert({"round_id": round_id, "kind": "round paused", "detail": None,
                                      "created_utc": _now()})

    def mark_interrupted(self) -> list[int]:
        """Rounds left 'running' by a process that died: marked 'incomplete' (call before a new run)."""
        with self.transaction():
            ids = [r["id"] for r in self.db["rounds"].rows_where("status = 'running'")]
            for round_id in ids:
                self.db["rounds"].update(round_id, {"status": "incomplete"})
                self.db["events"].insert({"round_id": round_id, "kind": "round interrupted", "detail": None,
                                          "created_utc": _now()})
        return ids

    def add_gaps(self, round_id: int, gaps: list[dict[str, Any]]) -> list[int]:
        """`gaps`: {name, measured_ms, floor_ms[, lost_speedup]}, ranked by what they cost (first = largest)."""
        self._get("rounds", round_id)
        with self.transaction():
            return [self.db["gaps"].insert({"round_id": round_id, "rank": rank, "lost_speedup": None} | g).last_pk
                    for rank, g in enumerate(gaps, start=1)]

    def add_direction(self, round_id: int, description: str, source: str, gap_id: int | None = None) -> int:
        return self._insert("directions", {"round_id": round_id, "gap_id": gap_id, "description": description,
                                           "source": source})

    def add_candidate(self, round_id: int, agent: str, params: dict | None = None, patch: str | None = None,
                      parent_id: int | None = None, direction_id: int | None = None) -> int:
        self._get("rounds", round_id)
        if parent_id is not None:
            self._get("candidates", parent_id)
        return self._insert("candidates", {"round_id": round_id, "direction_id": direction_id, "parent_id": parent_id,
                                           "agent": agent, "params": _json(params), "patch": patch,
                                           "created_utc": _now()})

    def validate(self, candidate_id: int, accepted: bool, reason: str | None = None, forcing: dict | None = None,
                 speedup: dict | None = None, noise_band: float | None = None, commit: str | None = None) -> int:
        """The evaluator's verdict; `speedup`: {median, min, max, lower, p, pairs}; a rejection needs its reason."""
        self._get("candidates", candidate_id)
        if not accepted and not reason:
            raise MemoryStoreError("a rejected candidate needs the reason it was rejected")
        speedup = speedup or {}
        return self._insert("validations", {
            "candidate_id": candidate_id, "accepted": int(accepted), "reason": reason, "forcing": _json(forcing),
            "exact": None if forcing is None else int(bool(forcing.get("exact"))),
            "speedup_median": speedup.get("median"), "speedup_min": speedup.get("min"),
            "speedup_max": speedup.get("max"), "speedup_lower": speedup.get("lower"), "p_value": speedup.get("p"),
            "pairs": speedup.get("pairs"), "noise_band": noise_band, "commit_sha": commit, "created_utc": _now()})

    def add_mechanism(self, name: str, description: str, preconditions: dict, candidate_id: int | None = None) -> int:
        return self._insert("mechanisms", {"name": name, "description": description,
                                           "preconditions": _json(preconditions), "first_candidate_id": candidate_id})

    def event(self, kind: str, detail: dict | None = None, round_id: int | None = None) -> int:
        return self._insert("events", {"round_id": round_id, "kind": kind, "detail": _json(detail),
                                       "created_utc": _now()})

    # ---- reads ----------------------------------------------------------------------------------
    def rounds(self) -> list[dict[str, Any]]:
        """Every round with its deployment and its candidates' counts."""
        return list(self.db.query(
            "SELECT r.id, r.number, r.status, r.started_utc, r.finished_utc, d.target, d.drafter, d.device, d.dtype, "
            "d.load, (SELECT COUNT(*) FROM candidates c WHERE c.round_id = r.id) AS candidates, "
            "(SELECT COUNT(*) FROM candidates c JOIN validations v ON v.candidate_id = c.id "
            " WHERE c.round_id = r.id AND v.accepted = 1) AS accepted "
            "FROM rounds r JOIN deployments d ON d.id = r.deployment_id ORDER BY r.id"))

    def round_report(self, round_id: int) -> dict[str, Any]:
        """A round: its row, gaps by rank, directions, and candidates with their verdicts."""
        row = self._get("rounds", round_id)
        return {
            "round": row,
            "deployment": self._get("deployments", row["deployment_id"]),
            "gaps": list(self.db["gaps"].rows_where("round_id = ?", [round_id], order_by="rank")),
            "directions": list(self.db["directions"].rows_where("round_id = ?", [round_id], order_by="id")),
            "candidates": list(self.db.query(
                "SELECT c.id, c.agent, c.parent_id, c.params, v.accepted, v.reason, v.exact, v.speedup_median, "
                "v.speedup_min, v.speedup_max, v.speedup_lower, v.p_value, v.pairs FROM candidates c LEFT JOIN validations v ON v.candidate_id = c.id "
                "WHERE c.round_id = ? ORDER BY c.id", [round_id])),
        }

    def export(self) -> dict[str, list[dict[str, Any]]]:
        """Every table's rows (the schema's record of migrations included)."""
        return {name: list(self.db[name].rows) for name in sorted(self.db.table_names())}

    def diff(self, round_a: int, round_b: int) -> dict[str, Any]:
        """Gaps of two rounds side by side (by name: ms before, after, change) and what the later accepted."""
        a, b = self.round_report(round_a), self.round_report(round_b)
        before = {g["name"]: g["measured_ms"] - g["floor_ms"] for g in a["gaps"]}
        after = {g["name"]: g["measured_ms"] - g["floor_ms"] for g in b["gaps"]}
        gaps = [{"name": n, "before_ms": before.get(n), "after_ms": after.get(n),
                 "change_ms": None if n not in before or n not in after else after[n] - before[n]}
                for n in sorted(before.keys() | after.keys())]
        return {"rounds": [round_a, round_b], "gaps": gaps,
                "accepted": [c for c in b["candidates"] if c["accepted"]]}


def _statements(sql: str) -> list[str]:
    """A migration's statements (a trigger's body keeps its own semicolons)."""
    out, buf = [], ""
    for line in sql.splitlines(keepends=True):
        if line.lstrip().startswith("--") and not buf:
            continue
        buf += line
        if sqlite3.complete_statement(buf):
            out.append(buf.strip())
            buf = ""
    if buf.strip():
        raise MemoryStoreError(f"an unterminated statement in a migration: {buf[:80]!r}")
    return out
