"""Property-based fuzzing of the HTTP API from its own OpenAPI schema: whatever
schemathesis sends, the server answers without a 5xx, and keeps serving."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from server_proc import ServerProcess


@pytest.fixture(scope="module")
def fuzz_server(dsv3_model):
    srv = ServerProcess("--model", str(dsv3_model), "--stages", "2", "--split", "even", "--max-tokens-limit", "8")
    yield srv
    srv.stop()


def test_no_input_gets_a_5xx(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.root}/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {f"{o.method.upper()} {o.path}" for o in operations} >= {
        "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health"}
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call(timeout=60)
            assert response.status_code < 500, (
                f"{case.method} {case.path}: {response.status_code} {response.text[:500]}")
            if response.status_code >= 400:
                assert "error" in response.json()

        check()


def test_still_serving_after_the_fuzz(fuzz_server):
    r = httpx.post(f"{fuzz_server.base_url}/completions", json={"model": "default", "prompt": [5, 6], "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
