"""The terminal app on a large memory: copies a database (one a real `specpilot optimize` made), fills it
with candidates through the memory's own API until it holds --candidates of them (verdicts, profiles,
lineage, a patch on every tenth), then times the app's first screen (memory mode: the tree, the first
page of the table and the first candidate's detail on screen) and a filter, through Textual's Pilot.

    python benchmarks/tui_large_db.py --db specpilot-memory.db --candidates 10000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import tempfile
import time
from pathlib import Path

from specpilot.memory import Memory
from specpilot.tui.app import SpecPilotApp

PATCH = "--- a/specpilot/engine/step.py\n+++ b/specpilot/engine/step.py\n@@ -1,3 +1,3 @@\n-x = 1\n+x = {}\n y = 2\n"


def fill(db: Path, total: int, seed: int = 0) -> int:
    """Adds rounds of 100 candidates to the first deployment until the database holds `total`; in one
    transaction per round (the store's own writes), so filling 10,000 takes seconds."""
    memory = Memory(db)
    rng = random.Random(seed)
    have = memory.db.execute("SELECT COUNT(*) FROM candidates").fetchone()[0]
    dep = memory.db.execute("SELECT id FROM deployments ORDER BY id LIMIT 1").fetchone()[0]
    parent = None
    while have < total:
        round_id = memory.start_round(dep)
        memory.add_gaps(round_id, [{"name": n, "measured_ms": rng.uniform(1, 5), "floor_ms": 0.5}
                                   for n in ("verify", "draft", "host and overhead")])
        with memory.transaction():
            for _ in range(min(100, total - have)):
                params = {"mechanisms": None, "tunables": {"block-size": rng.choice([2, 4, 8]),
                                                           "ngram-assist": rng.choice([0, 1, 2])}}
                cid = memory.db["candidates"].insert({
                    "round_id": round_id, "parent_id": parent, "agent": f"search-{rng.randrange(4)}",
                    "params": json.dumps(params), "patch": PATCH.format(have) if have % 10 == 0 else None,
                    "created_utc": "2026-01-01T00:00:00+00:00"}).last_pk
                accepted = rng.random() < 0.3
                median = rng.uniform(0.8, 1.6)
                memory.db["validations"].insert({
                    "candidate_id": cid, "accepted": int(accepted),
                    "reason": None if accepted else "not faster than stock in every repeat",
                    "forcing": json.dumps({"passed": True, "positions_checked": 64, "non_tie_mismatches": 0}),
                    "exact": 0, "speedup_median": median, "speedup_min": median - 0.05, "speedup_max": median + 0.05,
                    "noise_band": 0.02, "created_utc": "2026-01-01T00:00:00+00:00"})
                parent = cid if rng.random() < 0.5 else parent
                have += 1
        memory.finish_round(round_id)
    memory.db.conn.close()
    return have


async def first_screen(db: Path) -> dict[str, float]:
    """Seconds until the memory screen shows its first page and first candidate; then a filter's."""
    app = SpecPilotApp(db, server="http://127.0.0.1:9", mode="memory")
    start = time.perf_counter()
    async with app.run_test(size=(160, 48)) as pilot:
        screen = app.screen
        while not (screen.loaded and screen.current is not None):
            await pilot.pause(0.01)
        first = time.perf_counter() - start
        start = time.perf_counter()
        screen.query_one("#search").value = "ngram-assist\": 2"
        while not (screen.filter.text and screen.loaded and screen.total < screen_total(db)):
            await pilot.pause(0.01)
        filtered = time.perf_counter() - start
        screen.query_one("#candidates").focus()
        start = time.perf_counter()
        for _ in range(20):
            await pilot.press("pagedown")
        while screen.loaded < min(screen.total, 600):  # pages load as the cursor nears the end
            await pilot.pause(0.01)
        scrolled = (time.perf_counter() - start) / 20
        return {"first_screen_s": first, "filter_s": filtered, "pagedown_s": scrolled,
                "candidates": screen_total(db), "filtered": screen.total, "loaded_after_scroll": screen.loaded}


async def rounds_first_screen(db: Path) -> float:
    """Seconds until the rounds screen shows the latest round's candidates."""
    app = SpecPilotApp(db, server="http://127.0.0.1:9", mode="rounds")
    start = time.perf_counter()
    async with app.run_test(size=(160, 48)) as pilot:
        while not app.screen.query_one("#round-candidates").row_count:
            await pilot.pause(0.01)
        return time.perf_counter() - start


def screen_total(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT COUNT(*) FROM candidates").fetchone()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", required=True, help="a memory a real optimize run wrote (copied, never changed)")
    parser.add_argument("--candidates", type=int, default=10_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "large.db"
        with sqlite3.connect(args.db) as src, sqlite3.connect(copy) as dst:
            src.backup(dst)  # WAL contents included
        start = time.perf_counter()
        n = fill(copy, args.candidates)
        print(f"filled to {n} candidates in {time.perf_counter() - start:.1f} s")
        result = asyncio.run(first_screen(copy))
        result["rounds_first_screen_s"] = asyncio.run(rounds_first_screen(copy))
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
