"""benchmarks/train_step_profile.py: the synthetic target has the embedded model's shapes, and the script runs
the trainer's own step in every mode, attributing the profiled time to the step's phases."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import train_step_profile  # noqa: E402

from specpilot.training.train import STEP_PHASES  # noqa: E402


def test_the_synthetic_target_has_the_embedded_model_s_shapes(embedded_checkpoint):
    assert train_step_profile.SMOLLM2_135M == embedded_checkpoint.config


def test_every_mode_s_step_is_timed_and_split_into_its_phases(tmp_path):
    out = tmp_path / "step.json"
    train_step_profile.main(["--device", "cpu", "--batch-size", "2", "--anchors-per-seq", "4", "--max-seq-len", "96",
                             "--prompt-len", "30", "--response-len", "30", "--num-layers", "1",
                             "--intermediate-size", "32", "--warmup", "1", "--steps", "2", "--profiled-steps", "1",
                             "--top", "3", "--out", str(out)])
    results = json.loads(out.read_text())
    assert list(results["modes"]) == list(train_step_profile.MODES)
    for mode in results["modes"].values():
        assert len(mode["step_ms_each"]) == 2 and mode["step_ms"]["median"] > 0
        assert set(mode["phases_ms"]) == set(STEP_PHASES)
        # the operators' own times, each counted to one phase: the work lies in features, forward and backward
        attributed = sum(mode["phases_ms"].values())
        assert 0.9 * mode["total_ms"] <= attributed <= mode["total_ms"] * 1.0001
        assert all(mode["phases_ms"][p] > 0 for p in ("features", "forward", "backward", "optimizer"))
        assert len(mode["top"]) == 3 and mode["top"][0]["ms"] >= mode["top"][-1]["ms"]
