"""The cost model: floors from shapes and ceilings (the roofline and launches), the ranked gaps and what
each is worth, CPU calibration, and `specpilot costmodel --measure` end to end on the tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specpilot.cli import main
from specpilot.costmodel import Ceilings, Measured, Shapes, calibrate, floors, rank_gaps
from specpilot.costmodel.floors import KERNELS_PER_LAYER

CEILINGS = Ceilings("test", "bfloat16", copy_bytes_per_s=4e12, read_bytes_per_s=4e12, matmul_flops=7e14,
                    decode_matmul_bytes_per_s=3e12, launch_s=5e-6, graph_replay_s=10e-6)
# Llama-3.1-8B-like: 16 GB of projections, 8 B parameters; a 1 GB drafter; block 16
SHAPES = Shapes(target_weight_bytes=16_000_000_000, target_params=8_000_000_000, kv_bytes_per_token=131072,
                drafter_weight_bytes=1_000_000_000, drafter_params=500_000_000, block=16, target_layers=32,
                drafter_layers=5)


def test_floors_are_the_roofline_of_each_pass_plus_its_launches():
    f = floors(SHAPES, CEILINGS, batch=1, context=1000, graphs=True)
    read_ms = (16e9 + 1000 * 131072) / 4e12 * 1e3
    assert f.ar_step_ms == pytest.approx(read_ms + 0.010)
    assert f.verify_ms == pytest.approx(read_ms + 0.010)  # 16 tokens of 8 B parameters: still read-bound
    assert f.draft_ms == pytest.approx(1e9 / 4e12 * 1e3 + 0.010)
    assert f.speedup_ceiling == pytest.approx(16 * f.ar_step_ms / (f.draft_ms + f.verify_ms + 0.030))
    assert f.ceiling_over(2 * f.ar_step_ms) == pytest.approx(2 * f.speedup_ceiling)
    big = floors(SHAPES, CEILINGS, batch=64, context=1000, graphs=True)
    assert big.verify_ms == pytest.approx(2 * 8e9 * 64 * 16 / 7e14 * 1e3 + 0.010)  # compute-bound
    eager = floors(SHAPES, CEILINGS, batch=1, context=1000, graphs=False)
    assert eager.ar_step_ms - f.ar_step_ms == pytest.approx(((KERNELS_PER_LAYER * 32 + 2) * 5e-6 - 10e-6) * 1e3)
    ngram = floors(Shapes(**{**vars(SHAPES), "drafter_weight_bytes": 0, "drafter_params": 0}), CEILINGS)
    assert ngram.draft_ms == 0.0


def test_each_gap_is_worth_what_closing_it_alone_adds():
    f = floors(SHAPES, CEILINGS, batch=1, context=1000, graphs=True)
    m = Measured(ar_step_ms=4.7, draft_ms=1.1, verify_ms=4.8, other_ms=0.3, tau=3.2)
    gaps = rank_gaps(m, f)
    assert [g.lost_speedup for g in gaps] == sorted((g.lost_speedup for g in gaps), reverse=True)
    by_name = {g.name: g for g in gaps}
    verify = by_name["verify"]
    closed = m.spec_step_ms - (verify.measured - verify.best)
    assert verify.lost_speedup == pytest.approx(m.tau * m.ar_step_ms / closed - m.speedup)
    assert by_name["acceptance (tau)"].lost_speedup == pytest.approx((16 - 3.2) * 4.7 / m.spec_step_ms)
    assert all(g.lost_speedup >= 0 for g in gaps) and m.speedup < f.speedup_ceiling


def test_cpu_calibration_measures_something_finite():
    c = calibrate(torch.device("cpu"), torch.float32, size_mib=16)
    for value in (c.copy_bytes_per_s, c.read_bytes_per_s, c.matmul_flops, c.decode_matmul_bytes_per_s, c.launch_s):
        assert math.isfinite(value) and value > 0
    assert c.graph_replay_s is None and c.device == "cpu"


def test_costmodel_cli_measures_the_tiny_model(tiny_dir, tmp_path, capsys):
    assert main(["costmodel", "--model-path", str(tiny_dir), "--dataset", "math", "--num-prompts", "2",
                 "--max-new-tokens", "16", "--speculative-algorithm", "ngram", "--measure", "--batch-size", "2",
                 "--output-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "costmodel.json").read_text())
    assert report["shapes"]["block"] == 8 and report["shapes"]["drafter_weight_bytes"] == 0
    assert report["floors"]["batch"] == 2 and report["measured"]["tau"] >= 1
    # both timed here (a shared CPU): finite, not ordered (the ordering is test_each_gap_is_worth_..., on fixed numbers)
    assert all(math.isfinite(v) and v > 0 for v in (report["measured"]["speedup"], report["floors"]["speedup_ceiling"]))
    assert {g["name"] for g in report["gaps"]} == {"draft", "verify", "host and overhead", "acceptance (tau)"}
    assert (tmp_path / "costmodel.png").is_file() and "gaps, by the speedup" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["costmodel", "--model-path", str(tiny_dir), "--measure", "--output-dir", str(tmp_path)])
    assert "--speculative-algorithm" in capsys.readouterr().err
