"""T(B, tokens) (engine/cost_table.py, costmodel/cost_table.py): interpolation, the cache on disk, and the
profile of a real engine's target through `specpilot bench --profile-cost-table`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specpilot.cli import main
from specpilot.engine.cost_table import CostTable, cache_path, load_cost_table, save_cost_table, table_key

TABLE = CostTable("dev-model", (1, 4), (1, 8), ((1.0, 2.0), (3.0, 10.0)), context=512, graphs=False)


def test_the_table_interpolates_between_and_past_its_points():
    assert TABLE.at(1, 1) == 1.0 and TABLE.at(4, 8) == 10.0
    assert TABLE.at(1, 4.5) == pytest.approx(1.5)  # halfway along tokens
    assert TABLE.at(2.5, 1) == pytest.approx(2.0)  # halfway along batch
    assert TABLE.at(2.5, 4.5) == pytest.approx((1.5 + 6.5) / 2)
    assert TABLE.at(4, 15) == pytest.approx(17.0)  # past the last point: the last segment's slope
    single = CostTable("k", (8,), (16,), ((5.0,),), context=0, graphs=True)
    assert single.at(1, 1) == 5.0


def test_trees_read_their_own_grid_where_the_table_has_one(tmp_path, monkeypatch):
    both = CostTable("k", (1, 4), (1, 8), TABLE.ms, 512, False, tree_ms=((1.0, 4.0), (3.0, 20.0)))
    assert both.at(4, 8) == 10.0 and both.at(4, 8, tree=True) == 20.0 and both.at(1, 4.5, tree=True) == 2.5
    assert TABLE.at(4, 8, tree=True) == 10.0  # unmeasured trees cost a chain's
    assert CostTable.from_json(both.to_json()) == both
    old = json.loads(TABLE.to_json())
    del old["tree_ms"]  # a table cached before trees were profiled
    assert CostTable.from_json(json.dumps(old)) == TABLE
    with pytest.raises(ValueError, match="needs that many times"):
        CostTable("k", (1, 4), (1, 8), TABLE.ms, 0, False, tree_ms=((1.0, 2.0),))


def test_a_malformed_table_is_refused():
    with pytest.raises(ValueError, match="increasing"):
        CostTable("k", (4, 1), (1,), ((1.0,), (2.0,)), 0, False)
    with pytest.raises(ValueError, match="needs that many times"):
        CostTable("k", (1, 4), (1, 8), ((1.0, 2.0),), 0, False)


def test_tables_are_cached_per_key(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path))
    key = table_key("NVIDIA H200", "/models/Llama 3.1", "bfloat16", exact=True)
    assert key == "NVIDIA_H200-Llama_3.1-bfloat16-invariant"
    assert load_cost_table(key) is None
    table = replace(TABLE, key=key)
    assert save_cost_table(table) == cache_path(key) and cache_path(key).parent == tmp_path / "cost_tables"
    assert load_cost_table(key) == table
    cache_path(key).write_text("{not json")
    assert load_cost_table(key) is None


def test_bench_profiles_the_targets_passes(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["bench", "--profile-cost-table", "--model-path", str(tiny_dir), "--device", "cpu",
                 "--cost-batch-sizes", "1", "3", "--cost-tokens", "1", "4", "--cost-context", "32", "--repeats", "2",
                 "--output-dir", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "cost_table.json").read_text())
    table = CostTable.from_json(json.dumps(report["table"]))
    assert table.batch_sizes == (1, 3) and table.tokens == (1, 4) and table.context == 32 and not table.graphs
    assert all(ms > 0 for row in table.ms for ms in row)
    assert all(ms > 0 for row in table.tree_ms for ms in row)  # tree-masked verifies, timed apart
    assert [row[0] for row in table.tree_ms] == [row[0] for row in table.ms]  # one row is no tree
    assert load_cost_table(table.key) == table and report["provenance"]["argv"]
    assert (tmp_path / "out" / "cost_table.png").stat().st_size > 0
    assert "ms per pass" in capsys.readouterr().out


def test_the_profile_names_the_flag_that_does_not_fit(tiny_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--profile-cost-table", "--model-path", str(tiny_dir), "--device", "cpu", "--cost-batch-sizes",
              "2", "--max-running-requests", "1", "--output-dir", str(tmp_path)])
    assert exc.value.code == 2 and "--cost-batch-sizes: 2 requests" in capsys.readouterr().err
