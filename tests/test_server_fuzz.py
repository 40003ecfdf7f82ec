"""Schema-driven fuzzing of /generate and /v1/completions: whatever a client sends, the answer is never a
5xx (valid requests succeed, the rest are 4xx)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from test_server_support import serve

EXAMPLES_PER_OPERATION = 50


@pytest.fixture(scope="module")
def server(tiny_dir):
    # A short context bounds what any fuzzed max_new_tokens can cost, and makes requests reach its end.
    yield from serve(tiny_dir, max_running_requests=4, context_length=96, speculative_algorithm="ngram")


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.include(path_regex=r"^/(generate|v1/completions)$").parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_never_get_a_server_error(case):
    response = case.call(timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {response.text}"
