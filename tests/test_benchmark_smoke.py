"""The GPU benchmark scripts' --smoke modes run on CPU at tiny shapes: a script that breaks is found here, not
in a device session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, smoke: bool = True) -> None:
    """benchmarks/NAME with ARGS (after --smoke unless smoke is False) must exit 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / name), *(["--smoke"] if smoke else []), *args],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("target,trace", [("llama", "histogram"), ("hybrid", "histogram"), ("llama", "passes")])
def test_gpu_spec_smoke_with_replayed_acceptance(tmp_path, target, trace):
    path = tmp_path / "trace.json"
    if trace == "histogram":  # a specpilot bench JSON
        path.write_text(json.dumps({"results": [{"dataset": "humaneval", "accept_histogram":
                                                 [0, 45, 52, 34, 14, 6, 3, 3, 2, 2, 2, 1, 1, 1, 0, 0, 0]}]}))
    else:  # a confidence trace (record_confidences.py)
        passes = [(a, [0.9] * a + [0.3] * (15 - a)) for a in (0, 1, 2, 2, 3, 5, 8, 15)]
        path.write_text(json.dumps({"dataset": "humaneval", "passes": passes}))
    run_script("gpu_spec.py", "--target", target, "--batch", "1", "2", "--repeats", "1", "--new-tokens", "12",
               "--context", "16", "--replay", f"{path}:humaneval", "--replay-tau", "4", "--out", str(tmp_path))
    result = json.loads((tmp_path / "gpu_spec.json").read_text())
    assert result["acceptance"].startswith("replayed acceptance") and result["target"] == f"tiny {target}"
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    assert all(r["fastest"]["tau"]["median"] > 1.5 for r in result["rows"])  # the replay, not random drafts
    assert ("invariant" in result["rows"][0]) == (target == "llama")


def test_step_host_ops_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path / "cache"))  # two-level's cost table, profiled here
    run_script("step_host_ops.py", "--out", str(tmp_path))
    rows = {r["set"]: r for r in json.loads((tmp_path / "step_host_ops.json").read_text())["rows"]}
    default, ragged = rows["default"], rows["+two-level,+ragged"]
    assert "early-launch" in default["mechanisms"]  # the replayed drafter launches early, as a real one does
    assert {"ragged", "two-level"} <= set(ragged["mechanisms"])
    assert ragged["ops_per_step"]["plan"] > default["ops_per_step"]["plan"] >= 1  # ragged lays its pass out eagerly


def test_ar_overlap_smoke(tmp_path):
    run_script("ar_overlap.py", "--batch", "1", "3", "--repeats", "1", "--new-tokens", "10", "--context", "12",
               "--out", str(tmp_path))
    result = json.loads((tmp_path / "ar_overlap.json").read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 3] and all(r["same_tokens"] for r in result["rows"])


def test_gpu_page_size_smoke(tmp_path):
    run_script("gpu_page_size.py", "--repeats", "1", "--iters", "1", "--prompt-lengths", "30", "300", "1000",
               "--out", str(tmp_path))
    result = json.loads((tmp_path / "gpu_page_size.json").read_text())
    assert [(r["batch"], r["q"]) for r in result["rows"]] == [(1, 1), (1, 16), (2, 1), (2, 16)]
    assert all(all(r["logits_bitwise_default"].values()) for r in result["rows"])
    capacity = result["capacity"]["rows"]  # no rounding, then page sizes upwards: fewer requests fit
    assert [c["page_size"] for c in capacity] == [1, 16, 32, 64, 128] and capacity[0]["waste_share"] == 0
    assert [c["requests"] for c in capacity] == sorted((c["requests"] for c in capacity), reverse=True)


@pytest.mark.parametrize("trace_kind", ["histogram", "passes"])
def test_verify_bound_prices_every_policy_and_the_oracle_beats_them(tmp_path, trace_kind):
    """benchmarks/verify_bound.py on a synthetic table and trace: tokens per pass follow the trace (the whole block
    commits its tau), level 1 runs where the trace recorded confidences, and no policy beats verifying exactly what
    is accepted."""
    table = {"key": "synthetic", "batch_sizes": [4, 8], "tokens": [1, 2, 4, 8, 16], "context": 64, "graphs": True,
             "ms": [[5.0, 5.1, 5.3, 6.0, 8.0], [5.5, 5.7, 6.2, 7.5, 11.0]]}
    run = {"rows": [{"batch": b, "default": {"graph_draft_ms": 1.0, "graph_acceptance_ms": 0.1,
                                             "ar_step_ms": {"median": 5.0}}} for b in (4, 8)]}
    (tmp_path / "table.json").write_text(json.dumps(table))
    (tmp_path / "run.json").write_text(json.dumps(run))
    trace = tmp_path / "trace.json"
    if trace_kind == "histogram":
        trace.write_text(json.dumps({"results": [{"dataset": "humaneval", "accept_histogram":
                                                  [0, 45, 52, 34, 14, 6, 3, 3, 2, 2, 2, 1, 1, 1, 0, 0, 0]}]}))
    else:
        passes = [(a, [0.95] * a + [0.2] * (15 - a)) for a in (0, 1, 2, 2, 3, 3, 4, 5, 6, 8, 11, 15)]
        trace.write_text(json.dumps({"dataset": "humaneval", "passes": passes}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "verify_bound.py"), "--run",
                           str(tmp_path / "run.json"), "--cost-table", str(tmp_path / "table.json"), "--trace",
                           str(trace), "--tau", "4", "--steps", "60", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "verify_bound.json").read_text())
    assert result["tau"] == pytest.approx(4.0, abs=1e-3)
    level_one = {"level 1, best", "level 1, ragged graphs"} if trace_kind == "passes" else set()
    for row in result["rows"]:
        policies = row["policies"]
        assert policies["whole block"]["tokens"] == pytest.approx(4.0, abs=1e-3)
        assert set(policies) == {"whole block", "width 2", "width 4", "width 8", "oracle"} | level_one
        assert all(p["over_ar"] < policies["oracle"]["over_ar"] for name, p in policies.items() if name != "oracle")


def test_tau_sweep_sets_drafters_side_by_side(tmp_path):
    """benchmarks/tau_sweep.py --draft: each drafter is a row on the same prompts (the shipped one named and by
    its directory give the same tau), drawn per dataset."""
    from specpilot.drafters import EMBEDDED_DRAFTER

    run_script("tau_sweep.py", "--dataset", "humaneval", "--num-prompts", "1", "--max-new-tokens", "8", "--batch", "1",
               "--draft", "shipped", str(EMBEDDED_DRAFTER), "--out", str(tmp_path), smoke=False)
    rows = json.loads((tmp_path / "tau_sweep.json").read_text())["rows"]
    assert [r["draft"] for r in rows] == ["shipped", str(EMBEDDED_DRAFTER)]
    assert rows[0]["humaneval"] == rows[1]["humaneval"] >= 1.0
    assert (tmp_path / "tau_sweep.png").stat().st_size > 0


def test_drafter_ceiling_of_a_given_drafter(tmp_path):
    """benchmarks/drafter_ceiling.py --draft: a checkpoint directory's per-slot accuracy and ceiling, the output
    equal to AR's."""
    from specpilot.drafters import EMBEDDED_DRAFTER

    run_script("drafter_ceiling.py", "--dataset", "humaneval", "--num-prompts", "1", "--max-new-tokens", "8",
               "--batch", "1", "--draft", str(EMBEDDED_DRAFTER), "--out", str(tmp_path), smoke=False)
    row = json.loads((tmp_path / "drafter_ceiling.json").read_text())["rows"][0]
    assert row["identical_to_ar"] == row["prompts"] == 1
    assert row["tau_tree_oracle"] >= row["tau_tree_actual"] >= 1.0


def test_tree_calibration_rescores_trees_by_what_hits_given_the_prefix(tmp_path):
    """benchmarks/tree_calibration.py: lists whose second-ranked token is always right after the first slot, at a
    lower draft probability, make trees from the drafter's probabilities stop at slot 1 while calibrated ones follow
    the tokens that hit (two-fold, same lists); the script itself runs end to end on the embedded pair."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import torch
    from drafter_ceiling import DraftSteps
    from tree_calibration import compare

    s = 40
    ids = torch.tensor([[10, 20], [11, 21], [12, 22]]).expand(s, 3, 2)
    probs = torch.tensor([0.6, 0.4]).expand(s, 3, 2)
    steps = DraftSteps(ids, probs, torch.tensor([10, 21, 22]).expand(s, 3), torch.arange(s), s, s, 2.0)
    row = compare("synthetic", steps, {"synthetic": steps}, nodes=3)
    assert row["tau_drafter_probs"] == 2.0 and row["tau_calibrated"] == 4.0 == row["tau_ceiling"]

    run_script("tree_calibration.py", "--dataset", "humaneval", "--num-prompts", "2", "--max-new-tokens", "8",
               "--batch", "2", "--out", str(tmp_path), smoke=False)
    row = json.loads((tmp_path / "tree_calibration.json").read_text())["rows"][0]
    assert row["tau_ceiling"] >= row["tau_drafter_probs"] >= 1.0 and row["tau_calibrated"] >= 1.0


def test_drafter_misses_finds_where_chains_stop_and_which_stops_are_shifts(tmp_path):
    """benchmarks/drafter_misses.py: on hand-made lists, the stop slot, its token's kind, a late stop (the next
    slot holds the missed token: a shifted branch would accept two more) and an early one (the stop slot holds the
    token after it); the script runs end to end on the embedded pair."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import torch
    from drafter_ceiling import DraftSteps
    from drafter_misses import analyse, token_kind

    assert [token_kind(t) for t in ("\n    ", "  ", " (", "42", " return", "urn")] == [
        "newline", "space", "punctuation", "digits", "word start", "word piece"]
    ids = torch.tensor([[[1, 2], [9, 8], [2, 7], [3, 6]],
                        [[5, 0], [7, 0], [0, 0], [0, 0]],
                        [[1, 0], [2, 0], [0, 0], [0, 0]]])
    ref = torch.tensor([[1, 2, 3, 4], [5, 6, 7, -1], [1, 2, -1, -1]])
    steps = DraftSteps(ids, torch.full(ids.shape, 0.5), ref, torch.arange(3), 3, 3, 2.0)
    row = analyse("synthetic", steps, lambda t: "newline" if t == 2 else "word piece", 2)
    assert row["stops"] == 2 and row["late_share"] == 0.5 == row["early_share"]
    assert row["tau_gain_late"] == 2 / 3 and row["next_token_in_list_at_hits"] == 1 / 4
    newline = row["kinds"]["newline"]
    assert newline["share_of_stops"] == 0.5 and newline["share_of_reached"] == 1 / 3 and newline["topk"] == 0.5

    run_script("drafter_misses.py", "--dataset", "humaneval", "--num-prompts", "1", "--max-new-tokens", "8",
               "--batch", "1", "--out", str(tmp_path), smoke=False)
    row = json.loads((tmp_path / "drafter_misses.json").read_text())["rows"][0]
    assert row["identical_to_ar"] == row["prompts"] == 1
    assert abs(sum(k["share_of_reached"] for k in row["kinds"].values()) - 1) < 1e-9
    assert (tmp_path / "drafter_misses.png").stat().st_size > 0


def test_train_determinism_repeats_steps_from_one_state(tmp_path):
    """benchmarks/train_determinism.py --smoke: on CPU the trainer's steps from one saved state repeat bit for bit,
    after a large allocation too; the chunk trials run the loss in smaller chunks (whether a 6-row chunk keeps the
    bits is the matmul library's choice, so only reported)."""
    out = tmp_path / "train_determinism.json"
    run_script("train_determinism.py", "--out", str(out))
    result = json.loads(out.read_text())
    trials = result["trials"]
    assert set(trials) == {"repeat", "memory", "chunk/3", "chunk/400"}
    assert all(trials[n]["identical"] for n in ("repeat", "memory")), trials
    assert trials["chunk/400"]["logit_chunk"] == result["logit_chunk"] // 400
    assert all(t["parameters"] > 0 and len(t["losses"]) == 4 for t in trials.values())
