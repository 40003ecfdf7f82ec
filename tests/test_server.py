"""The HTTP server end to end: a real uvicorn server (n-gram speculative decoding on a tiny random model)
driven with httpx and the openai client."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import openai
import pytest
from test_server_support import serve, sse_events

from specpilot.config import SamplingParams
from specpilot.engine.engine import Engine

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_dir):
    # context 4096 so that a long generation lasts seconds (client-disconnect and abort tests)
    yield from serve(tiny_dir, max_running_requests=4, context_length=4096, speculative_algorithm="ngram",
                     speculative_num_draft_tokens=4)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def generate(http, **body):
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_generate(http, **body):
    with http.stream("POST", "/generate", json=body | {"stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(sse_events(response.iter_lines()))


# ---- health and info ------------------------------------------------------------------------------
def test_health_and_info_endpoints(http, server):
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/health_generate").status_code == 200
    model = http.get("/get_model_info").json()
    assert model["is_generation"] and model["model_path"] == str(server.ctx.model_path)
    assert model["context_length"] == 4096
    info = http.get("/get_server_info").json()
    assert info.keys() == http.get("/server_info").json().keys()
    assert info["speculative_algorithm"] == "ngram" and info["max_running_requests"] == 4
    assert info["speculative_num_draft_tokens"] == 4 and info["speculative_draft_model_path"] is None
    assert info["max_queued_requests"] == 16  # 4 x max_running_requests by default
    state = info["internal_states"][0]
    assert {"avg_spec_accept_length", "last_gen_throughput"} <= set(state)
    assert info["running_requests"] == info["waiting_requests"] == 0 and info["rids"] == []
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == server.ctx.model_name
    for method in ("GET", "POST"):
        assert http.request(method, "/flush_cache").status_code == 200


# ---- /generate --------------------------------------------------------------------------------------
def test_generate_text_meta_info(http):
    out = generate(http, text="w5 w6 w7 w5 w6 w7 w5", sampling_params={"max_new_tokens": 12} | GREEDY)
    meta = out["meta_info"]
    assert len(out["output_ids"]) == meta["completion_tokens"] == 12
    assert out["text"] == " ".join(f"w{i}" for i in out["output_ids"])
    assert meta["prompt_tokens"] == 7 and meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["e2e_latency"] > 0 and len(meta["id"]) == 32
    assert sum(meta["spec_accept_histogram"]) == meta["spec_verify_ct"]
    assert meta["spec_accept_length"] == pytest.approx(12 / meta["spec_verify_ct"])
    assert http.get("/get_server_info").json()["internal_states"][0]["avg_spec_accept_length"] >= 1.0


def test_generate_batch_input_ids_and_per_item_params(http):
    single = generate(http, text="w8 w9", sampling_params={"max_new_tokens": 6} | GREEDY)
    by_ids = generate(http, input_ids=[8, 9], sampling_params={"max_new_tokens": 6} | GREEDY)
    assert by_ids["output_ids"] == single["output_ids"]
    batch = generate(http, text=["w8 w9", "w10"], rid=["b-0", "b-1"],
                     sampling_params=[{"max_new_tokens": 6} | GREEDY, {"max_new_tokens": 3} | GREEDY])
    assert isinstance(batch, list) and [b["meta_info"]["id"] for b in batch] == ["b-0", "b-1"]
    assert batch[0]["output_ids"] == single["output_ids"]
    assert [b["meta_info"]["completion_tokens"] for b in batch] == [6, 3]
    ids_batch = generate(http, input_ids=[[8, 9], [10]], sampling_params={"max_new_tokens": 3} | GREEDY)
    assert [o["output_ids"] for o in ids_batch] == [batch[0]["output_ids"][:3], batch[1]["output_ids"]]
    chunks = stream_generate(http, input_ids=[[8, 9], [10]], sampling_params={"max_new_tokens": 3} | GREEDY)
    finals = {c["index"]: c["output_ids"] for c in chunks[:-1] if c["meta_info"]["finish_reason"]}
    assert finals == {0: ids_batch[0]["output_ids"], 1: ids_batch[1]["output_ids"]}


def test_generate_stream_is_cumulative_and_matches_non_stream(http):
    body = {"text": "w11 w12 w13", "sampling_params": {"max_new_tokens": 40} | GREEDY}
    events = stream_generate(http, **body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for earlier, later in zip(chunks, chunks[1:], strict=False):
        assert later["text"].startswith(earlier["text"])
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    plain = generate(http, **body)
    assert (final["text"], final["output_ids"]) == (plain["text"], plain["output_ids"])


def test_stop_string_is_trimmed_in_stream_and_final_text(http):
    base = generate(http, text="w20 w21", sampling_params={"max_new_tokens": 10} | GREEDY)
    stop = f"w{base['output_ids'][5]}"  # a word the greedy output is known to contain
    body = {"text": "w20 w21", "sampling_params": {"max_new_tokens": 10, "stop": stop} | GREEDY}
    out = generate(http, **body)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and base["text"].startswith(out["text"])
    streamed = [c["text"] for c in stream_generate(http, **body)[:-1]]
    assert streamed[-1] == out["text"] and not any(stop in t for t in streamed)


def test_concurrent_greedy_outputs_equal_solo_runs(http):
    """More requests than running slots (4): they queue, join and leave the batch between steps."""
    bodies = [{"input_ids": [5 + i, 7, 9 + 2 * i, 5 + i], "sampling_params": {"max_new_tokens": 8 + 5 * i} | GREEDY}
              for i in range(10)]
    solo = [generate(http, **b)["output_ids"] for b in bodies]
    together: list[list[int] | None] = [None] * len(bodies)

    def run(i: int) -> None:
        together[i] = generate(http, **bodies[i])["output_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == solo


# ---- OpenAI-compatible API --------------------------------------------------------------------------
def test_openai_chat_stream_and_not(oai, http, server):
    messages = [{"role": "system", "content": "w30"}, {"role": "user", "content": "w31 w32"}]
    full = oai.chat.completions.create(model="any", messages=messages, max_tokens=9, temperature=0, seed=1)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens == len("w3 w30 w4 w3 w31 w32 w4 w5".split())
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.model == server.ctx.model_name and full.object == "chat.completion"
    chunks = list(oai.chat.completions.create(model="any", messages=messages, max_tokens=9, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # the chat template is applied server-side: /generate on the templated ids gives the same tokens
    ids = [3, 30, 4, 3, 31, 32, 4, 5]
    same = generate(http, input_ids=ids, sampling_params={"max_new_tokens": 9, "temperature": 0})
    assert same["text"] == choice.message.content


def test_openai_completions_stream_and_not(oai):
    full = oai.completions.create(model="any", prompt="w40 w41 w40", max_tokens=12, temperature=0)
    assert full.object == "text_completion" and full.usage.prompt_tokens == 3
    streamed = oai.completions.create(model="any", prompt="w40 w41 w40", max_tokens=12, temperature=0, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    batch = oai.completions.create(model="any", prompt=[[40, 41, 40], [42]], max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert full.choices[0].text.startswith(batch.choices[0].text)


def test_n_samples_of_a_prompt_on_both_apis(oai, http):
    body = {"text": "w40 w41 w40", "sampling_params": {"max_new_tokens": 10, "temperature": 0.9, "sampling_seed": 7,
                                                       "ignore_eos": True}}
    one = generate(http, **body)
    many = generate(http, **body | {"sampling_params": body["sampling_params"] | {"n": 3}})
    assert [o["index"] for o in many] == [0, 1, 2]
    assert many[0]["output_ids"] == one["output_ids"]  # the first sample keeps the seed
    assert len({tuple(o["output_ids"]) for o in many}) > 1  # the others are keyed apart
    again = generate(http, **body | {"sampling_params": body["sampling_params"] | {"n": 3}})
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in many]
    events = [e for e in stream_generate(http, **body | {"sampling_params": body["sampling_params"] | {"n": 2}})
              if isinstance(e, dict)]
    assert {e["index"] for e in events} == {0, 1}
    assert [e["output_ids"] for e in events if e["meta_info"]["finish_reason"]] == [o["output_ids"] for o in many[:2]]
    chat = oai.chat.completions.create(model="any", messages=[{"role": "user", "content": "w5"}], n=4, max_tokens=4,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1, 2, 3]
    assert all(c.message == chat.choices[0].message for c in chat.choices)  # greedy: four times the same
    assert chat.usage.completion_tokens == 16
    assert chat.usage.prompt_tokens == oai.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "w5"}], max_tokens=1).usage.prompt_tokens
    batch = oai.completions.create(model="any", prompt=[[40, 41], [42]], n=2, max_tokens=3, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text and batch.usage.prompt_tokens == 3


# ---- bad input: always a 4xx that says what is wrong ----------------------------------------------------
LONG_PROMPT = [5] * 5000

BAD_REQUESTS = [
    ("/generate", b"{bad json", "JSON"),
    ("/generate", b"[1, 2]", "object"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {}, "exactly one of text and input_ids"),
    ("/generate", {"text": "w5", "input_ids": [5]}, "exactly one of text and input_ids"),
    ("/generate", {"text": []}, "empty"),
    ("/generate", {"input_ids": []}, "empty"),
    ("/generate", {"input_ids": [5, 999]}, "[0, 320)"),
    ("/generate", {"input_ids": [-1]}, "input_ids"),
    ("/generate", {"input_ids": LONG_PROMPT}, "context length"),
    ("/generate", {"text": "w5", "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"text": "w5", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ("/generate", {"text": "w5", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ("/generate", {"text": "w5", "sampling_params": {"max_new_tokens": "10"}}, "max_new_tokens"),
    ("/generate", {"text": "w5", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("/generate", {"text": "w5", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 2}}, "min_new_tokens"),
    ("/generate", {"text": "w5", "sampling_params": {"stop_token_ids": [1000]}}, "stop_token_ids"),
    ("/generate", {"text": "w5", "sampling_params": {"seed": 2**70}}, "seed"),
    ("/generate", {"text": "w5", "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
    ("/generate", {"text": "w5", "stream": "yes"}, "stream"),
    ("/generate", {"text": ["w5", "w6"], "rid": "one"}, "rid"),
    ("/generate", {"text": ["w5"], "sampling_params": [{}, {}]}, "sampling_params"),
    ("/generate", {"text": ["w5", "w6"], "rid": ["same", "same"]}, "already in use"),
    ("/v1/completions", {"prompt": "w5", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "w5", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": "w5", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "w5", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "w5"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "presence_penalty": 1}, "presence"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "top_p": 0}, "top_p"),
    ("/abort_request", {}, "rid"),
]


@pytest.mark.parametrize("path,body,needle", BAD_REQUESTS, ids=[f"{p}:{n}" for p, _, n in BAD_REQUESTS])
def test_bad_requests_are_400_with_a_message(http, path, body, needle):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = http.post(path, **kwargs)
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


def test_unknown_path_and_method_are_4xx(http):
    assert http.get("/nope").status_code == 404
    assert http.get("/generate").status_code == 405


# ---- aborts and disconnects ---------------------------------------------------------------------------
LONG = {"max_new_tokens": 3800, "ignore_eos": True}

KILLED_CLIENT = textwrap.dedent("""
    import sys, httpx
    body = {"input_ids": [5, 6], "rid": sys.argv[2], "stream": True, "sampling_params": SAMPLING}
    with httpx.stream("POST", sys.argv[1] + "/generate", json=body, timeout=60, trust_env=False) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                print("streaming", flush=True)
                sys.stdin.read()  # hold the stream open until killed
""").replace("SAMPLING", repr(LONG))


def test_killed_client_frees_its_request_within_a_second(server):
    client = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, server.url, "killed-1"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "streaming"
        assert "killed-1" in server.info()["rids"]
    finally:
        client.kill()
        client.wait()
    killed = time.monotonic()
    info = server.wait_for(lambda i: "killed-1" not in i["rids"], timeout=1.0)
    assert time.monotonic() - killed < 1.0
    server.wait_for(lambda i: i["running_requests"] == 0)
    assert info["waiting_requests"] == 0


def test_abort_request_ends_the_stream_with_abort(http, server):
    events: list = []
    body = {"input_ids": [5, 6], "rid": "to-abort", "sampling_params": LONG}
    reader = threading.Thread(target=lambda: events.extend(stream_generate(http, **body)))
    reader.start()
    server.wait_for(lambda i: "to-abort" in i["rids"])
    assert http.post("/abort_request", json={"rid": "to-abort"}).json() == {"success": True}
    reader.join(10)
    assert events[-1] == "[DONE]"
    final = events[-2]["meta_info"]
    assert final["finish_reason"] == {"type": "abort"} and final["completion_tokens"] < 3800
    assert "to-abort" not in server.info()["rids"]


def test_engine_failure_is_a_500_and_the_server_keeps_serving(http, server, monkeypatch):
    engine = server.ctx.engine

    def broken_step():
        monkeypatch.undo()  # fail once
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine, "step", broken_step)
    response = http.post("/generate", json={"text": "w5", "sampling_params": {"max_new_tokens": 4}})
    assert response.status_code == 500 and "simulated kernel failure" in response.json()["error"]["message"]
    assert generate(http, text="w5", sampling_params={"max_new_tokens": 4})["meta_info"]["completion_tokens"] == 4
    assert server.info()["rids"] == []


def test_speculative_generation_up_to_the_end_of_the_context(http):
    """Found by fuzzing: a verify pass near the end of the context writes past it. Without a
    max_new_tokens the default (128) is clamped to the 16 positions left."""
    prompt = [5] * 4080  # 4080 of the 4096 positions
    out = generate(http, input_ids=prompt, sampling_params=GREEDY)
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["meta_info"]["completion_tokens"] == 16


LOGPROB_PROMPT = "w5 w6 w7 w5 w6 w7 w5 w6"


def test_logprobs_on_both_apis_equal_ar_s(http, oai, server):
    """Speculative (n-gram) logprobs through /generate, its stream and the openai client, against an AR
    engine of the same weights (CPU kernels: within float rounding)."""
    body = {"text": LOGPROB_PROMPT, "sampling_params": {"max_new_tokens": 8} | GREEDY, "return_logprob": True,
            "top_logprobs_num": 2, "token_ids_logprob": [5, 9], "return_text_in_logprobs": True}
    out = generate(http, **body)
    meta = out["meta_info"]
    assert meta["spec_verify_ct"] > 0  # it speculated
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(isinstance(text, str) for _, _, text in meta["output_token_logprobs"])
    assert [len(top) for top in meta["output_top_logprobs"]] == [2] * 8
    assert [[i for _, i, _ in named] for named in meta["output_token_ids_logprobs"]] == [[5, 9]] * 8
    streamed = stream_generate(http, **body | {"logprob_start_len": 2})
    assert streamed[-2]["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]
    prompt_ids = server.ctx.tokenizer.encode(LOGPROB_PROMPT)
    for chunk in (streamed[0], streamed[-2]):  # the prompt's, from the first chunk on
        assert [t for _, t, _ in chunk["meta_info"]["input_token_logprobs"]] == prompt_ids[2:]
    whole = generate(http, **body | {"logprob_start_len": 0})["meta_info"]
    assert whole["input_token_logprobs"][0][0] is None and whole["input_top_logprobs"][0] is None
    assert [lp for lp, _, _ in whole["input_token_logprobs"][3:]] == pytest.approx(
        [lp for lp, _, _ in streamed[-2]["meta_info"]["input_token_logprobs"][1:]], abs=1e-5)

    engine = server.ctx.engine
    ar_engine = Engine(engine.checkpoint, dataclasses.replace(engine.config, speculative_algorithm=None,
                                                              max_running_requests=1, context_length=256),
                       model=engine.model)  # the weights it loaded (the server is idle meanwhile)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, return_logprob=True, top_logprobs_num=2)
    ar = ar_engine.generate([server.ctx.tokenizer.encode(LOGPROB_PROMPT)], params)[0]
    assert ar.output_ids == out["output_ids"]
    ar_logprobs = [e.logprob for e in ar.logprobs]
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(ar_logprobs, abs=1e-4)

    completion = oai.completions.create(model="any", prompt=LOGPROB_PROMPT, max_tokens=8, temperature=0, logprobs=2,
                                        extra_body={"ignore_eos": True})
    lp = completion.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(ar_logprobs, abs=1e-4)
    assert lp.tokens == [text for _, _, text in meta["output_token_logprobs"]]  # each id's own text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(8)]
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    chat = dict(model="any", messages=MESSAGES_FOR_LOGPROBS, max_tokens=5, temperature=0, logprobs=True,
                top_logprobs=3, extra_body={"ignore_eos": True})
    full = oai.chat.completions.create(**chat).choices[0].logprobs.content
    assert len(full) == 5 and all(len(entry.top_logprobs) == 3 for entry in full)
    assert all(entry.top_logprobs[0].logprob == entry.logprob for entry in full)  # greedy: the top id
    streamed = [entry for chunk in oai.chat.completions.create(**chat, stream=True) if chunk.choices
                and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in full]


MESSAGES_FOR_LOGPROBS = [{"role": "user", "content": "w31 w32"}]


def test_more_samples_than_the_server_holds_is_a_400(http, server):
    capacity = server.ctx.scheduler.capacity
    body = {"text": "w5", "sampling_params": {"n": capacity + 1, "max_new_tokens": 1}}
    response = http.post("/generate", json=body)
    assert response.status_code == 400 and f"exceed what the server holds at once ({capacity}" in response.text
