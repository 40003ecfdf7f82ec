"""Structured output through the HTTP APIs, with speculation on: OpenAI's response_format (a JSON schema, a
JSON object) through the official client, SGLang's json_schema / regex / ebnf on /generate, and the same
tokens as the server gives without speculation."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from test_server_support import serve

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def servers(spelled_dir):
    """The spelled tiny model served twice: n-gram speculation, and AR."""
    spec = serve(spelled_dir, max_running_requests=4, context_length=512, speculative_algorithm="ngram",
                 speculative_num_draft_tokens=4)
    ar = serve(spelled_dir, max_running_requests=4, context_length=512)
    yield next(spec), next(ar)
    for server in (spec, ar):
        next(server, None)


def _spelled(ids: list[int], tokenizer) -> str:
    return "".join(tokenizer.convert_ids_to_tokens([i for i in ids if i != 2]))


def test_response_format_json_schema_through_the_openai_client(servers):
    spec, _ = servers
    client = openai.OpenAI(base_url=spec.url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "give me json"}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
    value = json.loads(out.choices[0].message.content.replace(" ", ""))  # the tiny tokenizer spaces its pieces
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
    anything = client.completions.create(model="any", prompt="{", max_tokens=40, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"}})  # SGLang's
    assert anything.choices[0].text.replace(" ", "").startswith("{")


@pytest.mark.parametrize("key,spec_text,pattern", [
    ("json_schema", json.dumps(SCHEMA), None),
    ("regex", r"(yes|no)-[0-9]{2,4}", r"(yes|no)-[0-9]{2,4}"),
    ("ebnf", 'root ::= "(" [a-c] ("," [a-c])? ")"', r"\([a-c](,[a-c])?\)"),
])
def test_generate_grammars_give_ar_s_tokens(servers, key, spec_text, pattern):
    spec, ar = servers
    body = {"text": "hello there", "sampling_params": {"max_new_tokens": 60, "temperature": 0, key: spec_text}}
    outs = [httpx.post(s.url + "/generate", json=body, timeout=60, trust_env=False).json() for s in (spec, ar)]
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    assert outs[0]["meta_info"]["spec_verify_ct"] > 0 and outs[0]["meta_info"]["finish_reason"]["type"] == "stop"
    text = _spelled(outs[0]["output_ids"], spec.ctx.tokenizer)
    if pattern is None:
        assert json.loads(text)["n"] in (1, 2, 3)
    else:
        assert re.fullmatch(pattern, text), text
