"""Property-based fuzzing of the HTTP API from its own OpenAPI schema: whatever
schemathesis sends to any of the APIs (OpenAI chat and completions, Responses,
Anthropic Messages, Ollama), the server answers without a 5xx, and keeps serving.

The bodies' schemas are the translators' own pydantic models, nested shapes
included, so schemathesis reaches every field. Bounded for CI: one shared
server, a few generated tokens per request, a fixed number of examples per
operation (the aliases of a route, ``/messages``, are left to their ``/v1``
twin)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_proc import ServerProcess

# Generating routes get more examples than the ones that only read state.
EXAMPLES = {"POST": 30, "GET": 8}
ALIASES = ("/messages", "/messages/count_tokens")


@pytest.fixture(scope="module")
def fuzz_server(dsv3_model):
    srv = ServerProcess("--model", str(dsv3_model), "--stages", "2", "--split", "even", "--max-tokens", "4",
                        "--max-tokens-limit", "8", capture_log=True)
    yield srv
    srv.stop()


def test_no_input_gets_a_5xx(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.root}/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    operations = [o for o in operations if o.path not in ALIASES]
    assert {f"{o.method.upper()} {o.path}" for o in operations} >= {
        "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health",
        "POST /v1/responses", "GET /v1/responses/{response_id}", "POST /v1/messages", "POST /v1/messages/count_tokens",
        "POST /api/chat", "POST /api/generate", "POST /api/show"}
    answered = {}
    for operation in operations:
        @given(case=operation.as_strategy(), served=st.booleans())
        @settings(max_examples=EXAMPLES.get(operation.method.upper(), 8), deadline=None,
                  suppress_health_check=list(HealthCheck), database=None)
        def check(case, served):
            if served and isinstance(case.body, dict) and "model" in case.body:
                # Half the bodies get past what random ones rarely do, so that the rest of the
                # body reaches generation: a model name OpenAI's routes serve, and valid chat
                # messages (random ones almost always lack a content the role needs).
                case.body["model"] = "default"
                if case.path == "/v1/chat/completions":
                    case.body["messages"] = [{"role": "user", "content": "Hi"}]
            response = case.call(timeout=60)
            assert response.status_code < 500, (
                f"{case.method} {case.path}: {response.status_code} {response.text[:500]}")
            if response.status_code >= 400:
                assert "error" in response.json()
            answered.setdefault(f"{case.method} {case.path}", set()).add(response.status_code // 100)

        check()
    # The fuzz reached past validation: every generating API answered some requests with a 2xx.
    for route in ("POST /v1/chat/completions", "POST /v1/responses", "POST /v1/messages", "POST /api/chat"):
        assert 2 in answered.get(route, ()), (route, answered.get(route))
    assert not [line for line in fuzz_server.log if "Traceback" in line or "unhandled error" in line]


def test_still_serving_after_the_fuzz(fuzz_server):
    r = httpx.post(f"{fuzz_server.base_url}/completions", json={"model": "default", "prompt": [5, 6], "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
