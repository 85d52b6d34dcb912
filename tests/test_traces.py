"""OpenTelemetry: one request's trace arrives at an OTLP/HTTP receiver the test runs
(``otlp_receiver.py``), in the client's trace (W3C ``traceparent``), with the HTTP span, the
engine's "generate" span tiled by its wait, its frames and the head's time between them, and
each frame tiled by the wire's hops and every stage's span (itself tiled by its parts)."""

from __future__ import annotations

import os


FRAMES = {"prefill chunk", "decode step", "verify step"}
PARTS = ["queued", "decode", "compute", "encode"]


def _children(spans, parent):
    return sorted((s for s in spans if s["parent_id"] == parent["span_id"]), key=lambda s: (s["start"], s["end"]))


def _tiles(parent, children, slack_ns=2_000) -> bool:
    """``children`` cover ``parent`` from its start to its end without a gap."""
    cursor = parent["start"]
    for c in children:
        if c["start"] > cursor + slack_ns or c["start"] < parent["start"] - slack_ns:
            return False
        cursor = max(cursor, c["end"])
    return abs(cursor - parent["end"]) <= slack_ns


def test_a_request_trace_arrives_with_per_stage_spans(team_server, otlp_receiver):
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    r = team_server.http.post(f"{team_server.base_url}/chat/completions", timeout=120,
                   headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
                   json={"model": "default", "messages": [{"role": "user", "content": "Name a colour."}],
                         "max_tokens": 6})
    assert r.status_code == 200
    spans = otlp_receiver.trace(trace_id, until="POST /v1/chat/completions")
    (http,) = [s for s in spans if s["name"] == "POST /v1/chat/completions"]
    assert http["parent_id"] == client_span and http["attrs"]["http.response.status_code"] == 200
    (generate,) = _children(spans, http)
    assert generate["name"] == "generate" and http["start"] <= generate["start"] <= generate["end"] <= http["end"]
    assert generate["attrs"]["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert "prefix_cache.cached_tokens" in generate["attrs"]
    parts = _children(spans, generate)
    assert parts[0]["name"] == "queue" and {p["name"] for p in parts} <= FRAMES | {"queue", "head"}
    assert _tiles(generate, parts), "the request's spans leave a gap"
    frames = [p for p in parts if p["name"] in FRAMES]
    assert any(f["name"] == "prefill chunk" for f in frames)
    assert len(frames) >= r.json()["usage"]["completion_tokens"] // 4  # (verify steps carry several)
    for frame in frames:
        inside = _children(spans, frame)
        stages = [c for c in inside if c["name"].startswith("stage")]
        assert [c["name"] for c in stages] == ["stage 0", "stage 1"], inside
        assert [c["name"] for c in inside] == ["wire", "stage 0", "wire", "stage 1", "wire"]
        assert _tiles(frame, inside), f"{frame['name']}'s stage and wire spans leave a gap"
        for stage in stages:
            pieces = _children(spans, stage)
            assert [p["name"] for p in pieces] == PARTS and _tiles(stage, pieces)
        if frame["name"] == "verify step":
            a = frame["attrs"]
            assert a["speculation.accepted"] + a["speculation.rejected"] == a["speculation.drafted"]


def test_a_request_without_traceparent_starts_its_own_trace(team_server, otlp_receiver):
    before = {s["trace_id"] for s in otlp_receiver.spans}
    r = team_server.http.post(f"{team_server.base_url}/embeddings", json={"model": "m", "input": "traced"})
    assert r.status_code == 200
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        new = [s for s in otlp_receiver.spans if s["trace_id"] not in before and s["name"] == "POST /v1/embeddings"]
        if new:
            assert new[0]["parent_id"] == ""
            return
        time.sleep(0.1)
    raise AssertionError("no trace of the embeddings request arrived")
