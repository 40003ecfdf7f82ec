"""Client tools against a live server: `specpilot bench --serving` and scripts/load_test.py."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from dataclasses import replace

import httpx
import pytest
from test_server_support import serve

from specpilot.bench.serving import ServingBenchConfig, _share, client_processes
from specpilot.cli import main

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tiny_dir):
    yield from serve(tiny_dir, max_running_requests=4, context_length=512, speculative_algorithm="ngram")


@pytest.mark.parametrize("backend,extra", [("sglang", ["--request-rate", "50"]),
                                           ("sglang-oai-chat", ["--max-concurrency", "3"]),
                                           ("sglang", ["--max-concurrency", "3", "--client-processes", "2"])],
                         ids=["sglang-rate", "oai-concurrency", "sglang-two-processes"])
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
    assert report["config"]["client_processes"] == (2 if "--client-processes" in extra else 1)


def test_the_load_is_shared_between_processes():
    cfg = ServingBenchConfig(num_prompts=40, max_concurrency=5, request_rate=10.0, client_processes=2)
    shares = [_share(cfg, i, 2) for i in range(2)]
    assert [s.max_concurrency for s in shares] == [3, 2] and [s.request_rate for s in shares] == [5.0, 5.0]
    assert client_processes(cfg) == 2
    assert client_processes(replace(cfg, client_processes=9)) == 5  # each process keeps a request in flight
    assert client_processes(replace(cfg, client_processes=None, max_concurrency=1)) == 1


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


def test_bench_serving_sweep_starts_each_setting_and_charts_them(tiny_dir, tmp_path, capsys):
    """Two settings (AR and n-gram speculation) over two concurrencies: a server each, every run complete,
    the chart and table written; speculation's accept length is reported, AR's is not."""
    argv = ["bench", "--serving", "--sweep", "--concurrency", "1", "2", "--num-prompts", "2", "--max-new-tokens", "6",
            "--warmup-prompts", "1", "--output-dir", str(tmp_path),
            "--serve-flags", f"--model-path {tiny_dir} --device cpu --max-running-requests 2 --context-length 512",
            "--setting", "ar=--speculative-algorithm none",
            "--setting", "ngram=--speculative-algorithm ngram --speculative-num-draft-tokens 4"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert list(report["settings"]) == ["ar", "ngram"] and report["concurrency"] == [1, 2]
    assert report["provenance"]["dtype"] == "float32"  # the servers' own, not `auto`
    for name, setting in report["settings"].items():
        assert [r["concurrency"] for r in setting["runs"]] == [1, 2]
        assert all(r["summary"]["completed"] == r["num_prompts"] == max(2, 2 * r["concurrency"]) for r in setting["runs"])
        assert all(r["summary"]["total_output_tokens"] == 6 * r["num_prompts"] for r in setting["runs"])
        assert all(r["scheduler_time"]["decode"]["count"] > 0 for r in setting["runs"])
    assert report["settings"]["ar"]["speculative_algorithm"] is None
    assert report["settings"]["ngram"]["runs"][0]["summary"]["accept_length"] >= 1.0
    assert (tmp_path / "sweep.png").stat().st_size > 0 and (tmp_path / "ngram.server.log").is_file()
    assert "serving sweep" in capsys.readouterr().out


@pytest.mark.parametrize("argv,error", [
    (["bench", "--sweep"], "--sweep loads servers: pass it with --serving"),
    (["bench", "--serving", "--sweep", "--setting", "nameless"], "--setting takes NAME=FLAGS"),
])
def test_bench_sweep_errors_name_the_flag(argv, error, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--output-dir", str(tmp_path)])
    assert exc.value.code == 2 and error in capsys.readouterr().err


def test_server_info_splits_the_schedulers_time(server):
    """internal_states' step_time: how many prefill and decode steps and publishes the scheduler ran, and for how
    long (where a served step's time goes, beside the offline engine's)."""
    before = server.info()["internal_states"][0]["step_time"]
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    assert httpx.post(server.url + "/generate", json=body, trust_env=False, timeout=60).status_code == 200
    after = server.wait_for(lambda i: i["running_requests"] == 0)["internal_states"][0]["step_time"]
    assert set(after) == {"prefill", "decode", "publish"}
    assert after["prefill"]["count"] >= before["prefill"]["count"] + 1
    assert after["decode"]["count"] >= before["decode"]["count"] + 1  # ngram steps: 5 tokens in 1..5 passes
    assert all(after[k]["seconds"] > before[k]["seconds"] for k in ("prefill", "decode", "publish"))
