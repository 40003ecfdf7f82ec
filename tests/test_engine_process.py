"""The engine in a process of its own (`specpilot serve`'s default): the same answers as in one process, the
server's info, back-pressure, a drain, an engine that fails to start, and one that dies under load."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from test_server_support import LiveServer, sse_events

from specpilot.engine.engine import EngineConfig
from specpilot.server import ServerArgs
from specpilot.server.remote_scheduler import RemoteScheduler

PROMPTS = ["w5 w6 w7 w5 w6", "w9 w10", "w11 w12 w13 w14 w15 w16", "w20"]


def _generate(url: str, text: str, **sampling) -> dict:
    reply = httpx.post(f"{url}/generate", json={"text": text, "sampling_params": {"max_new_tokens": 16} | sampling},
                       timeout=60, trust_env=False)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.fixture(scope="module")
def both(tiny_dir):
    engine = dict(speculative_algorithm="ngram", max_running_requests=4, context_length=256)
    with LiveServer(tiny_dir, engine_process=True, **engine) as remote, LiveServer(tiny_dir, **engine) as local:
        yield remote, local


def test_answers_equal_the_single_process_server_s(both):
    remote, local = both
    results = {}

    def run(name, url):
        results[name] = [_generate(url, p)["output_ids"] for p in PROMPTS] + \
                        [_generate(url, PROMPTS[0], temperature=0.9, sampling_seed=7)["output_ids"]]

    threads = [threading.Thread(target=run, args=(n, s.url)) for n, s in (("remote", remote), ("local", local))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["remote"] == results["local"]
    chat = {"model": "m", "messages": [{"role": "user", "content": "w7 w8"}], "max_tokens": 12, "stream": True,
            "temperature": 0}
    streamed = []
    for server in (remote, local):
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat, timeout=60, trust_env=False) as r:
            events = list(sse_events(r.iter_lines()))
        assert events[-1] == "[DONE]"
        streamed.append("".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]))
    assert streamed[0] == streamed[1] and streamed[0]


def test_server_info_comes_from_the_engine_process(both):
    remote, _ = both
    _generate(remote.url, PROMPTS[0])
    info = remote.info()
    assert info["kv_pool"]["num_slots"] == 4 and info["speed"]["mechanisms"] == ["device-acceptance"]
    state = info["internal_states"][0]
    assert state["step_time"]["decode"]["count"] > 0 and state["spec_stats"]
    meta = _generate(remote.url, PROMPTS[1])["meta_info"]
    assert meta["completion_tokens"] == 16 and meta["finish_reason"]["type"] == "length"


def test_overload_gets_back_pressure(tiny_dir):
    """The HTTP process counts what it handed the engine: with the engine process held still, a submission
    past the capacity is refused at once (503), and the held one completes once the engine goes on."""
    with LiveServer(tiny_dir, ServerArgs(max_queued_requests=0), engine_process=True, max_running_requests=1,
                    context_length=256) as server:
        scheduler = server.ctx.scheduler
        reply = {}
        os.kill(scheduler.process.pid, signal.SIGSTOP)
        try:
            thread = threading.Thread(target=lambda: reply.update(first=httpx.post(
                f"{server.url}/generate", json={"text": "w5 w6", "sampling_params": {"max_new_tokens": 16}},
                timeout=60, trust_env=False)))
            thread.start()
            deadline = time.monotonic() + 10
            while scheduler.outstanding < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            second = httpx.post(f"{server.url}/generate", json={"text": "w7"}, timeout=60, trust_env=False)
            assert second.status_code == 503 and "capacity" in second.json()["error"]["message"]
        finally:
            os.kill(scheduler.process.pid, signal.SIGCONT)
        thread.join(60)
        assert reply["first"].status_code == 200 and reply["first"].json()["meta_info"]["completion_tokens"] == 16
        assert scheduler.wait_idle(10) and _generate(server.url, "w7")["meta_info"]["completion_tokens"] == 16


def test_an_engine_that_cannot_start_says_why(tiny_dir, tmp_path):
    with pytest.raises(RuntimeError, match="no such|not found|does not exist|No such"):
        RemoteScheduler(EngineConfig(model_path=str(tmp_path / "missing"), device="cpu"), None)


def test_a_drain_finishes_what_runs_and_stops_the_engine_process(tiny_dir):
    server = LiveServer(tiny_dir, engine_process=True, max_running_requests=2, context_length=256)
    with server:
        scheduler = server.ctx.scheduler
        body = {"text": "w5 w6", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
        reply = {}
        thread = threading.Thread(target=lambda: reply.update(r=httpx.post(f"{server.url}/generate", json=body,
                                                                         timeout=60, trust_env=False)))
        os.kill(scheduler.process.pid, signal.SIGSTOP)  # the request is surely in flight when the drain starts
        try:
            thread.start()
            deadline = time.monotonic() + 10
            while scheduler.outstanding < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            scheduler.drain(30.0)
            assert httpx.post(f"{server.url}/generate", json=body, timeout=60, trust_env=False).status_code == 503
        finally:
            os.kill(scheduler.process.pid, signal.SIGCONT)
        thread.join(60)
        assert reply["r"].status_code == 200 and reply["r"].json()["meta_info"]["completion_tokens"] == 40
    assert not scheduler.process.is_alive()


def test_an_engine_process_that_dies_fails_its_requests(tiny_dir):
    with LiveServer(tiny_dir, engine_process=True, max_running_requests=2, context_length=8192,
                    max_total_tokens=16384) as server:
        body = {"text": "w5 w6", "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}, "stream": True}
        with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60, trust_env=False) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(server.ctx.scheduler.process.pid, signal.SIGKILL)
            events = list(sse_events(lines))
        assert any(isinstance(e, dict) and "error" in e for e in events)
        assert httpx.get(f"{server.url}/health", trust_env=False).status_code == 503


def test_stream_interval_sends_a_chunk_per_that_many_tokens(tiny_dir):
    """--stream-interval 5: the first token at once, then chunks of 5 or more new tokens, the end apart; the same
    text as without streaming. Through the engine process, whose steps may outrun the event loop."""
    with LiveServer(tiny_dir, ServerArgs(stream_interval=5), engine_process=True, max_running_requests=2,
                    context_length=256) as server:
        body = {"text": "w11 w12 w13", "sampling_params": {"max_new_tokens": 23, "temperature": 0}}
        with httpx.stream("POST", f"{server.url}/generate", json=body | {"stream": True}, timeout=60,
                          trust_env=False) as r:
            chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
        counts = [len(c["output_ids"]) for c in chunks]
        assert counts[0] >= 1 and counts[-1] == 23
        assert all(b - a >= 5 for a, b in zip(counts[1:-1], counts[2:-1]))
        assert all(b - a >= 5 for a, b in zip(counts[:1], counts[1:-1]))
        assert sum(len(c["meta_info"]["new_token_texts"]) for c in chunks) == 23
        assert chunks[-1]["text"] == _generate(server.url, "w11 w12 w13", max_new_tokens=23, temperature=0)["text"]
