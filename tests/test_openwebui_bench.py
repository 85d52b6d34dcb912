"""What ``mlxpipe bench openwebui`` decides with, on the shared team server (no Open
WebUI here: the bench itself is far too heavy for the default run): its recording
pass-through in front of mlxpipe forwards a streamed chat and an embeddings request
unchanged and keeps their bodies; its reading of ``/metrics`` sees them counted; and
its checks fail when the document's chunk is not in the prompt."""

from __future__ import annotations

import httpx

from mlxpipe.bench.openwebui import CODE_WORD, PARAGRAPHS, checks, counters, grew
from mlxpipe.bench.recorder import Recorder


def test_recorder_forwards_and_keeps_what_mlxpipe_got(team_server):
    before = counters(team_server.http.get(f"{team_server.root}/metrics").text)
    recorder = Recorder(team_server.root)
    try:
        client = httpx.Client(headers={"Authorization": f"Bearer {team_server.key}"}, timeout=120)
        got = client.post(f"{recorder.url}/v1/embeddings", json={"model": "m", "input": PARAGRAPHS[:2]})
        assert got.status_code == 200 and len(got.json()["data"]) == 2
        body = {"model": "default", "max_tokens": 3, "stream": True,
                "messages": [{"role": "system", "content": f"Context: {PARAGRAPHS[2]}"},
                             {"role": "user", "content": "The code word?"}]}
        with client.stream("POST", f"{recorder.url}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        refused = client.post(f"{recorder.url}/v1/embeddings", json={"model": "m"})
        assert refused.status_code == 422 or refused.status_code == 400  # the upstream's answer, passed on
        client.close()
    finally:
        recorder.close()
    assert [(r.path, r.status) for r in recorder.requests] == [
        ("/v1/embeddings", 200), ("/v1/chat/completions", 200), ("/v1/embeddings", refused.status_code)]
    assert recorder.seen("/v1/chat/completions")[0].body == body

    after = counters(team_server.http.get(f"{team_server.root}/metrics").text)
    delta = grew(before, after)
    assert delta["requests /v1/embeddings"] == 1 and delta["embedding_inputs"] == 2
    assert delta["requests /v1/chat/completions"] == 1 and delta["generated_tokens"] == 3
    assert delta[f"requests /v1/embeddings {refused.status_code}"] == 1


def test_checks_need_the_chunk_in_the_prompt():
    upload = {"requests /v1/embeddings": 6, "embedding_inputs": 6}
    question = {"requests /v1/embeddings": 1, "embedding_inputs": 1, "requests /v1/chat/completions": 1,
                "generated_tokens": 40}
    page = {"answer": "The code word is", "growths": 5}
    retrieved = {"messages": [{"role": "system", "content": "\n".join(PARAGRAPHS[1:4])},
                              {"role": "user", "content": [{"type": "text", "text": "the code word?"}]}]}
    ok = checks(upload, question, page, [retrieved])
    assert all(passed for _, passed, _ in ok), ok
    assert ok[-1][2] == "the code word in 1 of 1 chat prompts, beside 2 of the other 5 paragraphs"

    missed = {"messages": [{"role": "system", "content": PARAGRAPHS[0]}, {"role": "user", "content": "?"}]}
    failed = {name for name, passed, _ in checks({}, {"requests /v1/chat/completions": 1},
                                                 {"answer": " ", "growths": 9}, [missed]) if not passed}
    assert failed == {"upload embedded by mlxpipe", "question embedded by mlxpipe (retrieval)",
                      "chat served by mlxpipe", "answer streamed into the page", "retrieved chunk in mlxpipe's prompt"}
    assert CODE_WORD in PARAGRAPHS[2] and all(CODE_WORD not in p for i, p in enumerate(PARAGRAPHS) if i != 2)
