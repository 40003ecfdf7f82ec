"""Client tools against a live server: `specpilot bench --serving` and scripts/load_test.py."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from test_server_support import serve

from specpilot.cli import main

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tiny_dir):
    yield from serve(tiny_dir, max_running_requests=4, context_length=512, speculative_algorithm="ngram")


@pytest.mark.parametrize("backend,extra", [("sglang", ["--request-rate", "50"]),
                                           ("sglang-oai-chat", ["--max-concurrency", "3"])])
def test_bench_serving_writes_json_and_png(server, tmp_path, capsys, backend, extra):
    argv = ["bench", "--serving", "--backend", backend, "--base-url", server.url, "--num-prompts", "6",
            "--max-new-tokens", "8", "--output-dir", str(tmp_path), *extra]
    assert main(argv) == 0
    report = json.loads((tmp_path / f"serving_{backend}.json").read_text())
    summary = report["summary"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 6 * 8  # ignore_eos: every request generates all its tokens
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        assert summary[key]["p50"] > 0 and summary[key]["p99"] >= summary[key]["p50"]
    assert summary["output_throughput"] > 0 and summary["accept_length"] >= 1.0
    assert (tmp_path / f"serving_{backend}.png").stat().st_size > 0
    prov = report["provenance"]
    assert prov["versions"]["specpilot"] and prov["argv"] and prov["utc"] and prov["device"]
    assert prov["dtype"] == report["server_info"]["dtype"] and report["server_info"]["speculative_algorithm"] == "ngram"
    assert "TTFT" in capsys.readouterr().out


def test_bench_serving_without_a_server_names_the_url(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--serving", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"])
    assert exc.value.code == 2 and "http://127.0.0.1:9" in capsys.readouterr().err


def test_load_test_script_short_run(server):
    cmd = [sys.executable, str(REPO / "scripts" / "load_test.py"), "--base-url", server.url, "--clients", "6",
           "--duration", "3", "--pid", str(os.getpid()), "--max-new-tokens", "8", "--num-prompts", "3"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert report["requests"] > 0 and report["unexpected_statuses"] == 0 and report["greedy_mismatches"] == 0
    assert report["server_idle_after"] and report["rss_mib"]["after"] > 0


def test_load_test_refuses_non_loopback_urls():
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "load_test.py"), "--base-url",
                          "http://192.0.2.1:30000"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "loopback" in run.stderr
