"""Every field SGLang's and OpenAI's clients send is understood: implemented, accepted as metadata, or
(a feature not implemented yet) accepted at its neutral value only and otherwise a 400 naming it; a
length that cannot fit in the context is a 400 naming the limit."""

from __future__ import annotations

import re

import openai
import pydantic
import pytest
from test_server import GREEDY, generate, http, oai, server, stream_generate  # noqa: F401 (fixtures)
from test_server_support import sse_events

from specpilot.server import protocol

MESSAGES = [{"role": "user", "content": "w31 w32"}]

# SGLang 0.5.23's GenerateReqInput (srt/managers/io_struct.py), every field at its default but text
SGLANG_REQUEST_DEFAULTS = {
    **dict.fromkeys(
        "rid session_id input_ids input_embeds image_data video_data audio_data mm_hashes mm_content_hashes "
        "video_config sampling_params watermark return_logprob logprob_start_len top_logprobs_num "
        "token_ids_logprob return_sampling_mask sampling_logprobs_mode modalities session_params lora_path "
        "lora_id custom_logit_processor positional_embed_overrides bootstrap_host bootstrap_port bootstrap_room "
        "bootstrap_pair_key decode_tp_size routed_dp_rank data_parallel_rank disagg_prefill_dp_rank routing_key "
        "conversation_id http_worker_ipc max_thinking_tokens priority extra_key custom_labels "
        "external_trace_header received_time need_wait_for_mm_inputs num_items_assigned encoder_urls "
        "max_dynamic_patch min_dynamic_patch image_max_dynamic_patch video_max_dynamic_patch images_config "
        "mm_processor_kwargs multi_item_delimiter_indices token_indices_to_pool cache_salt kv_hints".split()),
    **dict.fromkeys(
        "use_audio_in_video return_text_in_logprobs return_flat_raw_top_logprobs return_flat_raw_output_top_logprobs "
        "return_flat_raw_top_logprobs_b64 stream return_hidden_states return_routed_experts return_indexer_topk "
        "background require_reasoning no_logs return_bytes return_entropy return_prompt_token_ids".split(), False),
    "log_metrics": True, "routed_experts_start_len": 0,
}
# its SamplingParams' API keys (srt/sampling/sampling_params.py) at their defaults
SGLANG_SAMPLING_DEFAULTS = {
    **dict.fromkeys("stop stop_token_ids stop_regex beam_width json_schema regex ebnf structural_tag "
                    "stream_interval logit_bias sampling_seed custom_params watermark".split()),
    "max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": 1 << 30, "min_p": 0.0,
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1,
    "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False,
}


def bad_request(http, path: str, body: dict) -> str:
    response = http.post(path, json=body)
    assert response.status_code == 400, (body, response.text)
    return response.json()["error"]["message"]


# ---- /generate ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_sglang_bench_serving_payload(http, stream):
    """What sglang.benchmark.serving's async_request_sglang_generate sends, at its argparse defaults."""
    body = {"text": "w5 w6 w7", "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True},
            "stream": stream, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
            "logprob_start_len": -1}
    final = stream_generate(http, **body)[-2] if stream else generate(http, **body)
    assert final["meta_info"]["completion_tokens"] == 6


def test_every_sglang_field_at_its_default(http):
    out = generate(http, **SGLANG_REQUEST_DEFAULTS | {"text": "w5 w6", "sampling_params": SGLANG_SAMPLING_DEFAULTS})
    assert 0 < out["meta_info"]["completion_tokens"] <= 128
    # a batch may give the per-prompt fields as lists
    batch = generate(http, text=["w5", "w6"], sampling_params={"max_new_tokens": 2} | GREEDY,
                     return_logprob=[False, False], lora_path=[None, None], logprob_start_len=[-1, -1])
    assert [o["meta_info"]["completion_tokens"] for o in batch] == [2, 2]


UNSUPPORTED_GENERATE = [
    ({"logprob_start_len": -2}, "logprob_start_len"),
    ({"return_logprob": True, "token_ids_logprob": [10**6]}, "token_ids_logprob must lie in"),
    ({"text": ["w5", "w6"], "top_logprobs_num": [1, 2, 3]}, "top_logprobs_num is a list of 3"),
    ({"return_hidden_states": True}, "return_hidden_states: true"),
    ({"routed_experts_start_len": 3}, "routed_experts_start_len: 3"),
    ({"lora_path": "adapter"}, 'lora_path: "adapter"'),
    ({"image_data": "http://example.com/cat.png"}, "image_data"),
    ({"routed_dp_rank": 1}, "routed_dp_rank: 1"),
    ({"log_metrics": "yes"}, "log_metrics"),  # metadata is typed too
    ({"not_an_sglang_field": 1}, "not_an_sglang_field: Extra inputs are not permitted"),
]
UNSUPPORTED_SAMPLING = [
    ({"frequency_penalty": 0.5}, "frequency_penalty: 0.5 is not supported yet"),
    ({"repetition_penalty": 1.2}, "repetition_penalty: 1.2"),
    ({"n": 0}, "n: Input should be greater than or equal to 1"),
    ({"n": 65}, "n: Input should be less than or equal to 64"),
    ({"json_schema": '{"type": "object"}'}, "json_schema: no token of this model's vocabulary can start it"),
    ({"regex": "(w5"}, "regex: "),
    ({"structural_tag": '{"a": 1}'}, "structural_tag"),
    ({"logit_bias": {"5": 2.0}}, "logit_bias"),
    ({"beam_width": 4}, "beam_width: 4"),
    ({"no_stop_trim": True}, "no_stop_trim: true"),
    ({"skip_special_tokens": False}, "skip_special_tokens: false"),
    ({"n": True}, "n: Input should be a valid integer"),  # no puns: true is not 1
    ({"not_a_sampling_key": 1}, "not_a_sampling_key: Extra inputs are not permitted"),
]


@pytest.mark.parametrize("fields,needle", UNSUPPORTED_GENERATE, ids=[n for _, n in UNSUPPORTED_GENERATE])
def test_unsupported_generate_value_is_400_naming_it(http, fields, needle):
    assert needle in bad_request(http, "/generate", {"text": "w5"} | fields)


@pytest.mark.parametrize("fields,needle", UNSUPPORTED_SAMPLING, ids=[n for _, n in UNSUPPORTED_SAMPLING])
def test_unsupported_sampling_value_is_400_naming_it(http, fields, needle):
    assert needle in bad_request(http, "/generate", {"text": "w5", "sampling_params": fields})


@pytest.mark.parametrize("model,base,table", [
    (protocol.GenerateRequest, {"text": "w5"}, protocol.GENERATE_UNSUPPORTED),
    (protocol.GenerateSampling, {}, protocol.SAMPLING_UNSUPPORTED),
    (protocol.CompletionRequest, {"prompt": "w5"},
     protocol.OPENAI_UNSUPPORTED | protocol.SGLANG_UNSUPPORTED | protocol.COMPLETION_UNSUPPORTED),
    (protocol.ChatCompletionRequest, {"messages": MESSAGES}, protocol.CHAT_UNSUPPORTED),
], ids=["generate", "sampling_params", "completions", "chat"])
def test_every_catalogued_feature_refuses_other_values(model, base, table):
    """A value that no neutral value equals, in each field of the catalogue (the 400 is the error's
    location and message)."""
    for name, neutral in table.items():
        model.model_validate(base | {name: neutral[-1]})
        with pytest.raises(pydantic.ValidationError) as err:
            model.model_validate(base | {name: "bogus"})
        [error] = err.value.errors()
        assert error["loc"] == (name,) and error["msg"].startswith('"bogus" is not supported yet'), error


def test_sampling_seed_is_sglang_name_for_seed(http):
    sampled = {"text": "w5 w6", "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}}

    def run(**seeds: int) -> list[int]:
        return generate(http, **sampled | {"sampling_params": sampled["sampling_params"] | seeds})["output_ids"]

    assert run(sampling_seed=7) == run(sampling_seed=7) == run(seed=7) == run(seed=7, sampling_seed=7)
    assert run(sampling_seed=7) != run(sampling_seed=8)
    body = sampled | {"sampling_params": {"seed": 1, "sampling_seed": 2}}
    assert "sampling_seed (2) and seed (1) differ" in bad_request(http, "/generate", body)


# ---- OpenAI API -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "w5 w6", "best_of": 1, "max_tokens": 6}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 6}),
], ids=["sglang-oai", "sglang-oai-chat"])
def test_sglang_bench_openai_payloads(http, path, body, stream):
    """What sglang.benchmark.serving's sglang-oai and sglang-oai-chat backends send by default."""
    body = body | {"model": "any", "stream": stream, "temperature": 0.0, "ignore_eos": True}
    if not stream:
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 6
        return
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        events = list(sse_events(response.iter_lines()))
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


def test_openai_client_metadata_and_neutral_values_pass(oai):
    out = oai.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "w5", "name": "ann"}], max_completion_tokens=3,
        temperature=0, user="u", metadata={"team": "a"}, store=False, service_tier="auto", seed=1,
        prompt_cache_key="k", safety_identifier="s", parallel_tool_calls=True, tool_choice="none",
        response_format={"type": "text"}, logit_bias={}, n=1, frequency_penalty=0, presence_penalty=0,
        logprobs=False, modalities=["text"], extra_body={"ignore_eos": True, "repetition_penalty": 1})
    assert out.usage.completion_tokens == 3


def test_max_completion_tokens_is_honoured(oai, http):
    out = oai.chat.completions.create(model="any", messages=MESSAGES, max_completion_tokens=5, temperature=0)
    assert out.usage.completion_tokens <= 5
    forced = oai.chat.completions.create(model="any", messages=MESSAGES, max_completion_tokens=5, max_tokens=5,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 5
    body = {"messages": MESSAGES, "max_tokens": 4, "max_completion_tokens": 5}
    assert "max_completion_tokens (5) and max_tokens (4) differ" in bad_request(http, "/v1/chat/completions", body)


@pytest.mark.parametrize("kwargs,needle", [
    ({"response_format": {"type": "json_schema"}}, "json_schema goes with type json_schema"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"regex": "w5"}}, "response_format and"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"5": 3}}, "logit_bias"),
    ({"extra_body": {"guided_json": {}}}, "guided_json"),  # not OpenAI's nor SGLang's: unrecognized
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "tool_calls"),
])
def test_openai_chat_unsupported_is_a_clear_400(oai, kwargs, needle):
    with pytest.raises(openai.BadRequestError, match=needle):
        oai.chat.completions.create(**{"model": "any", "messages": MESSAGES, "max_tokens": 2} | kwargs)


def test_openai_completions_take_sglang_s_grammar_keys(oai):
    out = oai.completions.create(model="any", prompt="w5", max_tokens=8, temperature=0,
                                 extra_body={"regex": "(w5|w6){2,4}w7"})
    assert re.fullmatch("(w5|w6){2,4}w7", out.choices[0].text.replace(" ", "")), out.choices[0].text
    with pytest.raises(openai.BadRequestError, match="stop_regex: .* is not supported yet"):
        oai.completions.create(model="any", prompt="w5", max_tokens=2, extra_body={"stop_regex": "w5"})


# ---- lengths that cannot fit ----------------------------------------------------------------------------
def test_a_length_beyond_the_context_is_400_naming_the_limit(http, oai):
    body = {"input_ids": [5] * 4000, "sampling_params": {"max_new_tokens": 200}}
    assert bad_request(http, "/generate", body) == (
        "prompt (4000 tokens) + max_new_tokens (200) exceeds the context length (4096)")
    with pytest.raises(openai.BadRequestError, match=r"max_tokens \(1000000000\) exceeds the context length"):
        oai.completions.create(model="any", prompt="w5", max_tokens=10**9)
    with pytest.raises(openai.BadRequestError, match=r"max_completion_tokens \(1000000000\) exceeds the context"):
        oai.chat.completions.create(model="any", messages=MESSAGES, max_completion_tokens=10**9)


def test_without_a_length_the_default_is_clamped_to_the_context(http):
    prompt = [5] * 4090  # 6 of the 4096 positions left
    assert generate(http, input_ids=prompt, sampling_params=GREEDY)["meta_info"]["completion_tokens"] == 6
    response = http.post("/v1/completions", json={"prompt": prompt, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 6


def test_openapi_schema_lists_the_catalogue(http):
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["GenerateRequest"]["properties"]["return_hidden_states"]["anyOf"][0] == {"enum": [None, False]}
    assert schemas["GenerateRequest"]["properties"]["log_metrics"]["type"] == "boolean"
    assert "max_completion_tokens" in schemas["ChatCompletionRequest"]["properties"]
