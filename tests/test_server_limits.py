"""Admission limits and shutdown: 503 + Retry-After when slots and queue are full, 400 for a rid in use,
graceful drain (503 for newcomers, in-flight requests end with abort after the grace period), and
`specpilot serve` under SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_server_support import (
    LiveServer,
    free_port,
    serve,
    sse_events,
    wait_healthy,
)

from specpilot.server import ServerArgs

LONG = {"max_new_tokens": 3800, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_dir):
    """One running slot and one queue place: the third concurrent request is refused."""
    yield from serve(tiny_dir, ServerArgs(max_queued_requests=1), max_running_requests=1, context_length=4096)


class Stream:
    """A streaming /generate in a background thread; `events` fills as chunks arrive."""

    def __init__(self, url: str, rid: str, sampling_params: dict = LONG) -> None:
        self.events: list = []
        body = {"input_ids": [5, 6], "rid": rid, "stream": True, "sampling_params": sampling_params}

        def read() -> None:
            with httpx.stream("POST", url + "/generate", json=body, timeout=60, trust_env=False) as response:
                assert response.status_code == 200
                self.events.extend(sse_events(response.iter_lines()))

        self.thread = threading.Thread(target=read, daemon=True)
        self.thread.start()

    def final(self) -> dict:
        self.thread.join(30)
        assert self.events[-1] == "[DONE]"
        return self.events[-2]["meta_info"]


def test_full_queue_gives_503_with_retry_after_then_recovers(server):
    first, second = Stream(server.url, "first"), Stream(server.url, "second")
    server.wait_for(lambda i: i["running_requests"] == 1 and i["waiting_requests"] == 1)
    for path, body in (("/generate", {"text": "w5"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}]}),
                       ("/generate", {"text": ["w5", "w6"]})):
        response = httpx.post(server.url + path, json=body, trust_env=False)
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
        assert "capacity" in response.json()["error"]["message"]
    # while requests run there is nothing to flush, and a rid in use is refused
    assert httpx.post(server.url + "/flush_cache", trust_env=False).status_code == 400
    assert httpx.post(server.url + "/abort_request", json={"abort_all": True}, trust_env=False).status_code == 200
    assert first.final()["finish_reason"] == second.final()["finish_reason"] == {"type": "abort"}
    server.wait_for(lambda i: i["rids"] == [])
    ok = httpx.post(server.url + "/generate", json={"text": ["w5", "w6"]}, trust_env=False)
    assert ok.status_code == 200 and len(ok.json()) == 2
    assert httpx.get(server.url + "/flush_cache", trust_env=False).status_code == 200


def test_rid_in_use_is_400(server):
    running = Stream(server.url, "dup")
    server.wait_for(lambda i: "dup" in i["rids"])
    response = httpx.post(server.url + "/generate", json={"text": "w5", "rid": "dup"}, trust_env=False)
    assert response.status_code == 400 and "already in use" in response.json()["error"]["message"]
    httpx.post(server.url + "/abort_request", json={"rid": "dup"}, trust_env=False)
    assert running.final()["finish_reason"]["type"] == "abort"


def test_drain_refuses_newcomers_and_aborts_stragglers_after_the_grace_period(tiny_dir):
    with LiveServer(tiny_dir, ServerArgs(shutdown_grace_period=0.3), max_running_requests=2,
                    context_length=4096) as server:
        short = Stream(server.url, "short", {"max_new_tokens": 4})
        assert short.final()["finish_reason"]["type"] == "length"
        straggler = Stream(server.url, "straggler")
        server.wait_for(lambda i: "straggler" in i["rids"])
        drained = time.monotonic()
        server.ctx.scheduler.drain(0.3)
        assert httpx.get(server.url + "/health", trust_env=False).status_code == 503
        refused = httpx.post(server.url + "/generate", json={"text": "w5"}, trust_env=False)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert straggler.final()["finish_reason"] == {"type": "abort"}
        assert 0.3 <= time.monotonic() - drained < 2.0


@pytest.mark.parametrize("mode", [[], ["--single-process"]], ids=["engine-process", "single-process"])
def test_serve_cli_with_sigterm(tiny_dir, mode):
    """`specpilot serve` with SGLang's flags; after SIGTERM the server still answers, 503 on /health,
    while the in-flight stream gets the grace period (then ends with abort), and the process exits."""
    port = free_port()
    cmd = [sys.executable, "-m", "specpilot.cli", "serve", "--model-path", str(tiny_dir), "--port", str(port),
           "--host", "127.0.0.1", "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4",
           "--max-running-requests", "2", "--context-length", "16384", "--max-total-tokens", "32768",
           "--dtype", "float32", "--device", "cpu", "--shutdown-grace-period", "2", *mode]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 60)
        info = httpx.get(url + "/get_server_info", trust_env=False).json()
        assert (info["speculative_algorithm"], info["max_running_requests"], info["port"]) == ("ngram", 2, port)
        assert info["kv_cache"]["num_slots"] == 2 and info["kv_cache"]["total_tokens"] == 2 * 16384
        # long enough to outlast the grace period even where the engine steps in its own process
        stream = Stream(url, "in-flight", {"max_new_tokens": 16000, "ignore_eos": True})
        while not stream.events:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while httpx.get(url + "/health", trust_env=False).status_code == 200:
            assert time.monotonic() - signalled < 1.5, "/health still says ok while draining"
        assert httpx.get(url + "/health", trust_env=False).status_code == 503
        assert stream.final()["finish_reason"] == {"type": "abort"}
        assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    finally:
        proc.kill()
        proc.wait()
