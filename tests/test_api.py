"""The OpenAI-compatible API, driven by the official `openai` client and httpx
against a real server process with real stage processes."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

SYSTEM = "You are a terse assistant."
QUESTION = "Why is the sky blue?"


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def mlx_lm_chat(default_model):
    """mlx-lm's greedy text for a chat (same template), and the prompt length."""
    from mlx_lm import generate, load, stream_generate

    model, tok = load(str(default_model))

    cache = {}

    def run(messages, max_tokens):
        key = (repr(messages), max_tokens)
        if key not in cache:
            prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
            cache[key] = generate(model, tok, prompt=prompt, max_tokens=max_tokens), len(prompt)
        return cache[key]

    def run_text(text, max_tokens):
        # mlx-lm's tokens; their text as a continuation of the prompt's: the first token's
        # leading space kept (mlx-lm's own detokenizer, starting a text, drops it)
        prompt = tok.encode(text)
        tokens = [r.token for r in stream_generate(model, tok, prompt, max_tokens=max_tokens)
                  if r.token not in tok.eos_token_ids]
        return tok.decode(prompt + tokens)[len(tok.decode(prompt)):]

    run.text = run_text
    return run


MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [server.banner[0].split()[2]]
    health = httpx.get(f"{server.root}/health").json()
    assert health["status"] == "ok"
    layers = [s["layers"] for s in health["stages"]]
    assert layers[0][0] == 0 and layers[0][1] == layers[1][0] and layers[1][1] == 30
    assert all(s["state"] == "ready" for s in health["stages"])


def test_a_model_by_id_and_an_unknown_one(server, client):
    name = server.banner[0].split()[2]
    m = client.models.retrieve(name)
    assert (m.id, m.object, m.owned_by) == (name, "model", "mlxpipe")
    assert m == client.models.list().data[0]
    unknown = httpx.get(f"{server.base_url}/models/org/no-such-model")  # ids may hold a slash
    chat = httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                      json={"model": "org/no-such-model", "messages": MESSAGES})
    assert unknown.status_code == chat.status_code == 404
    assert unknown.json() == chat.json() and chat.json()["error"]["code"] == "model_not_found"


def test_chat_greedy_equals_mlx_lm(client, mlx_lm_chat):
    want, prompt_len = mlx_lm_chat(MESSAGES, 24)
    r = client.chat.completions.create(model="default", messages=MESSAGES, temperature=0, max_tokens=24)
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_len, 24)
    assert r.usage.total_tokens == prompt_len + 24


def test_chat_streaming_equals_non_streaming(client, mlx_lm_chat):
    want, prompt_len = mlx_lm_chat(MESSAGES, 24)
    chunks = list(client.chat.completions.create(model="default", messages=MESSAGES, temperature=0,
                                                 max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == prompt_len
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 5  # really streamed


@pytest.mark.extended  # (the prefix cache through the API: test_protocols' Claude Code turns in the default run)
def test_a_resent_conversation_is_reused_from_the_prefix_cache(client, mlx_lm_chat):
    system = ("You are the archivist of a river town. " * 12).strip()
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Who built the first bridge?"}]
    r1 = client.chat.completions.create(model="default", messages=turn1, temperature=0, max_tokens=12)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0  # nobody sent this system prompt before
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And when?"}]
    want, prompt_len = mlx_lm_chat(turn2, 12)
    r2 = client.chat.completions.create(model="default", messages=turn2, temperature=0, max_tokens=12)
    assert r2.choices[0].message.content == want
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens - 16 < cached < prompt_len  # turn 1's prompt, to a 16-token block
    chunks = list(client.chat.completions.create(model="default", messages=turn2, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached


def test_completion_greedy_equals_mlx_lm(client, mlx_lm_chat):
    prompt = "The capital of France is"
    want = mlx_lm_chat.text(prompt, 16)
    r = client.completions.create(model="default", prompt=prompt, temperature=0, max_tokens=16)
    assert r.choices[0].text == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="default", prompt=prompt, temperature=0, max_tokens=16, stream=True))
    assert streamed == want


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_answer_and_never_appear(client, mlx_lm_chat, stream):
    full, _ = mlx_lm_chat(MESSAGES, 24)  # the same text as the greedy tests: computed once
    words = full.split()
    stop = words[len(words) // 2]
    expected = full[: full.index(stop)]
    kw = dict(model="default", messages=MESSAGES, temperature=0, max_tokens=24, stop=["@@never@@", stop])
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason][-1]
    else:
        r = client.chat.completions.create(**kw)
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert text == expected and stop not in text
    assert reason == "stop"


def test_seed_gives_the_same_answer(client):
    kw = dict(model="default", messages=[{"role": "user", "content": "Tell me a story."}],
              temperature=1.0, top_p=0.95, max_tokens=10)
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    c = client.chat.completions.create(seed=99, **kw).choices[0].message.content
    assert a == b
    assert a != c


def test_logprobs(client):
    r = client.chat.completions.create(model="default", messages=MESSAGES, temperature=0, max_tokens=8,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 8
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy picks the most likely token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    c = client.completions.create(model="default", prompt="One, two,", temperature=0, max_tokens=4, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(d) == 2 for d in lp.top_logprobs)
    # The text continues the prompt's: its first token's leading space is kept (a chat reply drops it).
    assert "".join(lp.tokens) == c.choices[0].text


def test_n_choices(client):
    r = client.chat.completions.create(model="default", messages=MESSAGES, temperature=0, max_tokens=6, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: the same twice
    assert r.usage.completion_tokens == 12


def test_n_choices_with_temperature_differ_and_repeat_with_the_seed(client):
    kw = dict(model="default", messages=[{"role": "user", "content": "Tell me a story."}], temperature=1.0,
              max_tokens=8, n=3, seed=5)
    first = [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert len(set(first)) > 1  # each choice draws its own tokens
    assert [c.message.content for c in client.chat.completions.create(**kw).choices] == first


def _live(server):
    return [s["live_sequences"] for s in httpx.get(f"{server.root}/health").json()["stages"]]


def test_client_disconnect_frees_caches_on_every_stage(server):
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 500, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/chat/completions", json=body) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any("content" in line for line in got)
            assert max(_live(server)) == 1  # the sequence holds caches while it streams
    deadline = time.monotonic() + 20
    while max(_live(server)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _live(server) == [0, 0]


def test_concurrent_requests_all_stream_while_others_run(server):
    # Long enough replies that the later prompts' prefill (in chunks cut to --max-stall
    # while the first ones decode) ends before the first reply does.
    async def one(http, i, events):
        body = {"model": "default", "messages": [{"role": "user", "content": f"Count to {i + 20}."}],
                "max_tokens": 40, "temperature": 0, "stream": True}
        async with http.stream("POST", f"{server.base_url}/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            first = True
            async for line in resp.aiter_lines():
                if first and '"content":"' in line and '"content":""' not in line:
                    events.append(("first", i))
                    first = False
        events.append(("done", i))

    async def main():
        events = []
        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.gather(*(one(http, i, events) for i in range(4)))
        return events

    events = asyncio.run(main())
    first_done = events.index(next(e for e in events if e[0] == "done"))
    assert {i for kind, i in events[:first_done] if kind == "first"} == {0, 1, 2, 3}


OK_CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG = "hello " * 9000

BAD_REQUESTS = [
    ("bad JSON", "chat", b"{bad json", 400, "not valid JSON"),
    ("body is an array", "chat", b"[1, 2]", 400, "must be a JSON object"),
    ("messages not a list", "chat", OK_CHAT | {"messages": "hi"}, 400, "messages"),
    ("empty messages", "chat", OK_CHAT | {"messages": []}, 400, "at least 1 item"),
    ("missing messages", "chat", {"model": "default"}, 400, "messages: Field required"),
    ("unknown model", "chat", OK_CHAT | {"model": "gpt-17"}, 404, "does not exist"),
    ("max_tokens not a number", "chat", OK_CHAT | {"max_tokens": "ten"}, 400, "max_tokens"),
    ("max_tokens zero", "chat", OK_CHAT | {"max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens beyond the context", "chat", OK_CHAT | {"max_tokens": 10**6}, 400, "maximum context length"),
    ("prompt longer than the context", "chat", OK_CHAT | {"messages": [{"role": "user", "content": LONG}]},
     400, "maximum context length"),
    ("negative temperature", "chat", OK_CHAT | {"temperature": -1}, 400, "temperature"),
    ("absurd temperature", "chat", OK_CHAT | {"temperature": 50}, 400, "temperature"),
    ("top_p above 1", "chat", OK_CHAT | {"top_p": 1.5}, 400, "top_p"),
    ("negative top_k", "chat", OK_CHAT | {"top_k": -3}, 400, "top_k"),
    ("top_k beyond the vocabulary", "chat", OK_CHAT | {"top_k": 10**6}, 400, "vocabulary"),
    ("presence_penalty out of range", "chat", OK_CHAT | {"presence_penalty": 9}, 400, "presence_penalty"),
    ("n zero", "chat", OK_CHAT | {"n": 0}, 400, "n"),
    ("n too many", "chat", OK_CHAT | {"n": 100}, 400, "n"),
    ("top_logprobs too many", "chat", OK_CHAT | {"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("too many stop strings", "chat", OK_CHAT | {"stop": [str(i) for i in range(100)]}, 400, "stop"),
    ("unknown role", "chat", OK_CHAT | {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("content of the wrong type", "chat", OK_CHAT | {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("logit_bias key not a token id", "chat", OK_CHAT | {"logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("a tool without its function", "chat", OK_CHAT | {"tools": [{"type": "function"}]}, 400, "function"),
    ("a forced call of a function that is not among the tools", "chat", OK_CHAT | {
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("a tool name with characters outside OpenAI's rule", "chat", OK_CHAT | {
        "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "name"),
    ("a response_format schema that cannot be enforced", "chat", OK_CHAT | {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format"),
    ("seed not an integer", "chat", OK_CHAT | {"seed": "x"}, 400, "seed"),
    ("min_p above 1", "chat", OK_CHAT | {"min_p": 2}, 400, "min_p"),
    ("repetition_penalty zero", "chat", OK_CHAT | {"repetition_penalty": 0}, 400, "repetition_penalty"),
    ("an unknown draft source", "chat", OK_CHAT | {"speculation": "psychic"}, 400, "speculation"),
    ("a draft model the server lacks", "chat", OK_CHAT | {"speculation": "draft_model"}, 400, "no draft model"),
    ("num_draft_tokens negative", "chat", OK_CHAT | {"num_draft_tokens": -1}, 400, "num_draft_tokens"),
    ("empty completion prompt", "completions", {"model": "default", "prompt": ""}, 400, "empty"),
    ("completion token outside the vocabulary", "completions", {"model": "default", "prompt": [1, 999999]},
     400, "outside the vocabulary"),
    ("batched prompts", "completions", {"model": "default", "prompt": [[1, 2], [3]]}, 400,
     "prompt: batched prompts are not served"),
    ("max_tokens 0 without echo", "completions", {"model": "default", "prompt": "hi", "max_tokens": 0}, 400,
     "it is for scoring a prompt, with echo"),
]


def test_a_prompt_past_the_context_is_named_by_the_field_that_holds_it(server):
    """A completions prompt past the context was refused naming ``param: "messages"``."""
    for path, body, param in [
            ("completions", {"prompt": LONG}, "prompt"),
            ("completions", {"prompt": [5] * 9000}, "prompt"),
            ("chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
            ("responses", {"input": LONG}, "input")]:
        r = httpx.post(f"{server.base_url}/{path}", json={"model": "default"} | body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (param, "context_length_exceeded"), (path, err)


@pytest.mark.parametrize("what,route,body,status,message", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_a_clear_4xx(server, what, route, body, status, message):
    url = f"{server.base_url}/{'chat/completions' if route == 'chat' else 'completions'}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert message in err["message"], err["message"]


def test_still_serving_after_bad_requests(server, client):
    for _, route, body, _, _ in BAD_REQUESTS[:5]:
        httpx.post(f"{server.base_url}/chat/completions", content=body if isinstance(body, bytes) else None,
                   json=None if isinstance(body, bytes) else body, timeout=60)
    r = client.chat.completions.create(model="default", messages=MESSAGES, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert httpx.get(f"{server.root}/health").status_code == 200


def test_wrong_method_and_path_are_openai_shaped(server):
    r = httpx.get(f"{server.base_url}/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(f"{server.base_url}/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def _scrape(server):
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{server.root}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return values


def test_metrics_move_with_a_request(server, client):
    generated = httpx.get(f"{server.root}/health", timeout=30).json()["generated_tokens"]
    before = _scrape(server)
    client.chat.completions.create(model="default", messages=MESSAGES, temperature=0, max_tokens=5)
    after = _scrape(server)
    # /health counts them too (the page charts its rate).
    assert httpx.get(f"{server.root}/health", timeout=30).json()["generated_tokens"] == generated + 5

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("mlxpipe_http_requests_total", route="/v1/chat/completions", status="200") == 1
    assert delta("mlxpipe_generated_tokens_total") == 5
    assert delta("mlxpipe_time_to_first_token_seconds_count") == 1
    assert delta("mlxpipe_inter_token_seconds_count") == 4
    stages = [labels for (name, labels) in after if name == "mlxpipe_stage_up"]
    assert len(stages) == 2
    for labels in stages:
        assert after[("mlxpipe_stage_up", labels)] == 1.0
        assert delta("mlxpipe_stage_busy_seconds_total", **dict(labels)) > 0
        assert after[("mlxpipe_stage_weight_bytes", labels)] > 10e6
    assert after[("mlxpipe_live_requests", ())] == 0
    # Where the frames' time went: the stages' parts fit in the round trip, both stages report.
    kinds = {dict(labels)["kind"] for (name, labels) in after if name == "mlxpipe_frames_timed_total"}
    assert sum(delta("mlxpipe_frames_timed_total", kind=k) for k in kinds) >= 3  # a chunk, the last token, more
    for k in [k for k in kinds if delta("mlxpipe_frames_timed_total", kind=k)]:  # (not earlier requests' kinds)
        compute = delta("mlxpipe_frame_seconds_total", kind=k, part="compute")
        stages = sum(delta("mlxpipe_frame_seconds_total", kind=k, part=p) for p in ("queued", "decode", "encode"))
        assert 0 < compute + stages <= delta("mlxpipe_frame_seconds_total", kind=k, part="round_trip")
    assert all(delta("mlxpipe_stage_frame_seconds_total", kind="prefill", stage=i, part="compute") > 0
               for i in ("0", "1"))


def test_status_command_shows_the_cluster(server):
    import subprocess
    import sys

    health = httpx.get(f"{server.root}/health").json()
    out = subprocess.run([sys.executable, "-m", "mlxpipe.server.cli", "status", "--url", server.base_url],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ok (ready)" in out.stdout
    for s in health["stages"]:
        a, b = s["layers"]
        assert s["address"] in out.stdout and f"[{a}, {b})" in out.stdout
    down = subprocess.run([sys.executable, "-m", "mlxpipe.server.cli", "status", "--url", "http://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=60)
    assert down.returncode == 2 and "cannot reach the head" in down.stderr


def test_a_request_chooses_whether_to_speculate(server, client, mlx_lm_chat):
    """``speculation`` and mlx_lm.server's ``num_draft_tokens`` reach the scheduler:
    a prompt that asks for a copy is drafted from itself unless the request says no;
    the answer is the same either way."""
    from conftest import REPEAT_CODE

    messages = [{"role": "user", "content": REPEAT_CODE}]

    def ask(**extra):
        before = httpx.get(f"{server.root}/health", timeout=30).json()["speculation"]["drafted_tokens"]
        r = client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=24,
                                           extra_body=extra)
        after = httpx.get(f"{server.root}/health", timeout=30).json()["speculation"]["drafted_tokens"]
        return r.choices[0].message.content, after - before

    want, _ = mlx_lm_chat(messages, 24)
    assert ask(speculation="none") == (want, 0)
    assert ask(num_draft_tokens=0) == (want, 0)
    text, drafted = ask(speculation="prompt_lookup", num_draft_tokens=2)
    assert text == want and drafted > 0


def test_a_request_without_a_limit_may_run_to_the_end_of_the_context():
    """OpenAI's default (aider and Open WebUI send no max_tokens): the budget is what the context
    (and the stages' KV caches) leave, unless `serve --max-tokens` caps it; Ollama's num_predict
    past the context is clamped to it, as Ollama does."""
    from types import SimpleNamespace

    from mlxpipe.server.api.errors import ApiError
    from mlxpipe.server.api.generation import Generator
    from mlxpipe.server.api.ollama import GenerateBody, request_of
    from mlxpipe.server.api.keys import LOCAL
    from mlxpipe.server.api.request import GenerationRequest
    from mlxpipe.server.api.options import ApiOptions
    from mlxpipe.server.api.quotas import Quotas
    from mlxpipe.server.core.engine import Engine

    def budget(req, prompt_len, kv=1 << 20, **options):
        # The engine's own properties over a fake scheduler: what the KV caches hold bounds the context.
        engine = SimpleNamespace(model_context=8192, context_source="the model's maximum",
                                 scheduler=SimpleNamespace(max_kv_tokens=kv, kv=SimpleNamespace(longest=lambda: kv)))
        engine.max_context = Engine.max_context.fget(engine)
        engine.kv_tokens = Engine.kv_tokens.fget(engine)
        engine.context_limit = lambda: Engine.context_limit(engine)
        gen = SimpleNamespace(options=ApiOptions(model_id="m", **options), engine=engine, quotas=Quotas())
        return Generator.budget(gen, req, prompt_len)

    me = LOCAL.tenant(None)
    free = GenerationRequest(text="x", tenant=me)
    assert budget(free, 100) == 8192 - 100  # not 512
    assert budget(free, 100, kv=4000) == 4000 - 100  # ... within what the KV caches hold
    assert budget(free, 100, default_max_tokens=64) == 64
    assert budget(GenerationRequest(text="x", max_tokens=300, tenant=me), 100, default_max_tokens=64) == 300
    with pytest.raises(ApiError, match="maximum context length"):
        budget(GenerationRequest(text="x", max_tokens=10_000, tenant=me), 100)
    ollama = request_of(GenerateBody(model="m", prompt="x", options={"num_predict": 10_000}), ApiOptions(model_id="m"),
                        me)
    assert budget(ollama, 100) == 8192 - 100
