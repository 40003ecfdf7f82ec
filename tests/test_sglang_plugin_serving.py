"""benchmarks/sglang_plugin_serving.py: repeated passes are summarized per concurrency (median and spread) and
charted from the medians, a failed pass left out; each run asks bench_serving for its per-request figures and keeps
them out of the summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sglang_plugin_serving as serving  # noqa: E402


def _run(c: int, repeat: int, rate: float | None, accept: float | None = None) -> dict:
    figures = {} if rate is None else {key: rate / 100 for key in serving.SUMMARY} | {
        "output_throughput": rate, "accept_length": accept}
    return {"concurrency": c, "repeat": repeat, "returncode": 0 if rate else 1, "sglang": figures}


def test_repeats_give_median_and_spread_per_concurrency_and_skip_failed_or_absent_figures() -> None:
    runs = [_run(1, 0, 300.0), _run(8, 0, 2000.0), _run(1, 1, 320.0), _run(8, 1, None), _run(1, 2, 310.0),
            _run(8, 2, 2400.0)]
    summary = serving.summarize(runs)
    assert list(summary) == [1, 8]
    assert summary[1]["output_throughput"] == {"median": 310.0, "min": 300.0, "max": 320.0,
                                               "values": [300.0, 320.0, 310.0]}
    assert summary[8]["output_throughput"]["values"] == [2000.0, 2400.0]  # the failed pass is not a zero
    assert "accept_length" not in summary[1]  # AR reports none
    spec = serving.summarize([_run(1, 0, 900.0, accept=4.5), _run(1, 1, 950.0, accept=4.7),
                              _run(1, 2, 920.0, accept=None)])  # a pass that reports none is left out of it
    assert spec[1]["accept_length"]["values"] == [4.5, 4.7]
    assert spec[1]["output_throughput"]["median"] == 920.0


def test_chart_draws_medians_of_repeats_and_single_passes_alike(tmp_path: Path) -> None:
    report = {"provenance": {"git": None, "device": "cpu", "dtype": None, "utc": "now"}, "servers": {
        "ar": {"runs": [_run(1, r, 300.0 + r) for r in range(3)] + [_run(8, r, 2000.0 + r) for r in range(3)]},
        "specpilot": {"runs": [_run(1, 0, 900.0, accept=4.5), _run(8, 0, 3000.0, accept=5.0)]},
        "broken": {"error": "did not start"}}}
    path = serving.chart(report, tmp_path / "chart.png")
    assert path.stat().st_size > 0


def test_bench_asks_for_each_requests_figures_and_keeps_them_out_of_the_summary(tmp_path: Path, monkeypatch) -> None:
    out_file = tmp_path / "run.jsonl"
    line = {"output_throughput": 900.0, "median_tpot_ms": 1.0, "ttfts": [0.01, 0.02], "itls": [[0.001], [0.002]],
            "output_lens": [256, 256], "generated_texts": ["a", "b"]}
    seen: list[list[str]] = []

    def run(cmd: list[str], **_: object) -> object:
        seen.append(cmd)
        out_file.write_text(json.dumps(line) + "\n")
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(serving.subprocess, "run", run)
    server = type("S", (), {"port": 1234})()
    args = type("A", (), {"dataset_path": "d.json", "input_len": 256, "output_len": 256, "min_prompts": 16})()
    result = serving.bench(server, "/models/m", 8, args, out_file)
    assert "--output-details" in seen[0] and seen[0][seen[0].index("--max-concurrency") + 1] == "8"
    assert result["sglang"] == {"output_throughput": 900.0, "median_tpot_ms": 1.0}
    assert json.loads(out_file.read_text())["ttfts"] == [0.01, 0.02]  # the raw lines keep them
