"""The optimizer's memory (specpilot.memory): migrations, one transaction per write, the append-only
history, crash recovery after kill -9, and `specpilot memory list|show|export|diff`."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from specpilot.cli import main
from specpilot.memory import Memory, MemoryStoreError
from specpilot.memory.store import migrations


def _round_with_results(memory: Memory) -> tuple[int, int, int]:
    dep = memory.deployment("embedded", "dflash", "cpu", "float32", "B=1")
    first = memory.start_round(dep)
    memory.add_gaps(first, [{"name": "verify", "measured_ms": 9.0, "floor_ms": 5.0, "lost_speedup": 0.4},
                            {"name": "draft", "measured_ms": 3.0, "floor_ms": 2.5}])
    direction = memory.add_direction(first, "a smaller block", "gap")
    good = memory.add_candidate(first, "search", params={"tunables": {"block-size": 4}}, direction_id=direction)
    memory.validate(good, True, forcing={"passed": True, "exact": False}, speedup={"median": 1.4, "min": 1.3,
                                                                                   "max": 1.5}, noise_band=0.05)
    bad = memory.add_candidate(first, "llm:scripted", patch="--- a\n+++ b\n", parent_id=good)
    memory.validate(bad, False, reason="forcing failed: 3 mismatches")
    memory.add_mechanism("small-block", "block 4 on 2 CPU cores", {"device": "cpu"}, good)
    memory.finish_round(first)
    second = memory.start_round(dep)
    memory.add_gaps(second, [{"name": "verify", "measured_ms": 7.0, "floor_ms": 5.0}])
    memory.finish_round(second)
    return first, second, good


def test_migrations_apply_once_and_a_newer_file_is_refused(tmp_path):
    path = tmp_path / "m.db"
    memory = Memory(path)
    assert memory.version == len(migrations()) >= 1
    assert {"deployments", "rounds", "gaps", "directions", "candidates", "mechanisms", "validations",
            "events"} <= set(memory.db.table_names())
    assert {"candidate_results", "validated_mechanisms"} <= set(memory.db.view_names())
    assert Memory(path).version == memory.version  # reopening applies nothing twice
    assert memory.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    memory.db["schema_migrations"].insert({"version": 99, "name": "099_future", "applied_utc": "x"})
    with pytest.raises(MemoryStoreError, match="newer specpilot"):
        Memory(path)


def test_a_new_file_opened_by_two_processes_at_once_gets_its_schema_once(tmp_path, monkeypatch):
    """The optimizer and a watcher (the app, a test polling for verdicts) may open a file that does not exist
    yet at the same moment: the one that finds the migrations applied while it waited must go on."""
    from specpilot.memory import store

    path, real = tmp_path / "m.db", store.migrations

    def another_process_migrates_first():
        monkeypatch.setattr(store, "migrations", real)
        Memory(path)
        return real()

    monkeypatch.setattr(store, "migrations", another_process_migrates_first)
    memory = Memory(path)  # it read "nothing applied" before the other applied everything
    assert [r["version"] for r in memory.db["schema_migrations"].rows] == [v for v, _ in real()]


def test_rounds_candidates_and_verdicts_read_back(tmp_path):
    memory = Memory(tmp_path / "m.db")
    first, second, good = _round_with_results(memory)
    assert memory.deployment("embedded", "dflash", "cpu", "float32", "B=1") == 1  # found, not duplicated
    rounds = memory.rounds()
    assert [(r["number"], r["status"], r["candidates"], r["accepted"]) for r in rounds] == \
        [(1, "finished", 2, 1), (2, "finished", 0, 0)]
    report = memory.round_report(first)
    assert [g["name"] for g in report["gaps"]] == ["verify", "draft"] and report["gaps"][0]["rank"] == 1
    assert [(c["accepted"], c["parent_id"]) for c in report["candidates"]] == [(1, None), (0, good)]
    assert report["candidates"][1]["reason"].startswith("forcing failed")
    diff = memory.diff(first, second)
    assert diff["gaps"][1] == {"name": "verify", "before_ms": 4.0, "after_ms": 2.0, "change_ms": -2.0}
    [row] = memory.db.query("SELECT name, speedup_median FROM validated_mechanisms")
    assert row == {"name": "small-block", "speedup_median": 1.4}


def test_history_is_append_only_and_a_failed_write_leaves_nothing(tmp_path):
    memory = Memory(tmp_path / "m.db")
    _round_with_results(memory)
    for sql in ("DELETE FROM events", "UPDATE events SET kind = 'x'", "UPDATE validations SET accepted = 1"):
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            memory.db.execute(sql)
    with pytest.raises(MemoryStoreError, match="reason"):
        memory.validate(1, False)
    with pytest.raises(MemoryStoreError, match="no candidate with id 999"):
        memory.add_candidate(1, "search", parent_id=999)
    events = memory.db["events"].count
    with pytest.raises(RuntimeError), memory.transaction():
        memory.db["events"].insert({"kind": "half", "created_utc": "t"})
        raise RuntimeError("the process fails mid-transaction")
    assert memory.db["events"].count == events


def test_kill_9_mid_round_leaves_a_clean_file_and_an_incomplete_round(tmp_path):
    path = tmp_path / "m.db"
    writer = textwrap.dedent(f"""
        from specpilot.memory import Memory
        m = Memory({str(path)!r})
        r = m.start_round(m.deployment("embedded", None, "cpu", "float32", "B=1"))
        i = 0
        while True:
            m.validate(m.add_candidate(r, "search", params={{"i": i}}), True, speedup={{"median": 1.0}})
            i += 1
            if i == 20:
                print("ready", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    memory = Memory(path)
    assert memory.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert memory.mark_interrupted() == [1] and memory.rounds()[0]["status"] == "incomplete"
    done = list(memory.db.query("SELECT c.id FROM candidates c JOIN validations v ON v.candidate_id = c.id"))
    assert len(done) >= 20 and memory.db["candidates"].count - len(done) <= 1  # at most one unjudged
    assert [e["kind"] for e in memory.db["events"].rows][-1] == "round interrupted"


def test_memory_cli(tmp_path, capsys):
    path = tmp_path / "m.db"
    first, second, _ = _round_with_results(Memory(path))
    assert main(["memory", "list", "--db", str(path)]) == 0
    assert "finished" in capsys.readouterr().out
    assert main(["memory", "show", str(first), "--db", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["round"]["number"] == 1
    assert main(["memory", "diff", str(first), str(second), "--db", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["rounds"] == [first, second]
    assert main(["memory", "export", "--db", str(path)]) == 0
    assert len(json.loads(capsys.readouterr().out)["validations"]) == 2
    for argv, message in ((["memory", "show", "--db", str(path)], "takes 1 ROUND"),
                          (["memory", "list", "--db", str(tmp_path / "none.db")], "no memory file"),
                          (["memory", "show", "7", "--db", str(path)], "no round with id 7")):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err
