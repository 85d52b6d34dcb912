"""Tool calling, enforced structured output and reasoning through two real stage
processes, driven by the `openai` client (the tiny DeepSeek-V3 with a Qwen-style
template: its tokenizer has tool-call and think markers)."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema_rs
import openai
import pytest
from server_proc import ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 12}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def server(chat_model):
    srv = ServerProcess("--model", str(chat_model), "--stages", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def stream_message(chunks):
    """A streamed reply put together as the SDK's users do: content, reasoning,
    tool calls by index, the finish reason."""
    content, reasoning, calls, finish = "", "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    return content, reasoning, list(calls.values()), finish


@pytest.mark.parametrize("stream", [False, True])
def test_conversation_call_then_result_then_answer(client, stream):
    kw = dict(model="default", tools=[WEATHER, CLOCK], temperature=1.0, max_tokens=60, extra_body=NO_THINKING)
    # 1. The model must call get_weather (named), with arguments its schema allows.
    choice = {"type": "function", "function": {"name": "get_weather"}}
    if stream:
        content, _, calls, finish = stream_message(client.chat.completions.create(
            messages=ASK, tool_choice=choice, parallel_tool_calls=False, stream=True, **kw))
    else:
        r = client.chat.completions.create(messages=ASK, tool_choice=choice, parallel_tool_calls=False, **kw)
        msg = r.choices[0].message
        content, finish = msg.content, r.choices[0].finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls]
    assert finish == "tool_calls" and not content
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    jsonschema_rs.validate(WEATHER["function"]["parameters"], json.loads(calls[0]["arguments"]))
    # 2. The tool's result goes back; the model answers in text.
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0]["id"], "type": "function",
             "function": {"name": "get_weather", "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 C, sunny"}]
    kw["max_tokens"] = 8
    if stream:
        content, _, calls, finish = stream_message(client.chat.completions.create(
            messages=history, tool_choice="none", stream=True, **kw))
    else:
        r = client.chat.completions.create(messages=history, tool_choice="none", **kw)
        content, calls, finish = r.choices[0].message.content, r.choices[0].message.tool_calls or [], \
            r.choices[0].finish_reason
    assert content and not calls and finish in ("stop", "length")


def test_required_may_call_any_tool_and_several(client):
    r = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                                       temperature=1.0, max_tokens=120, n=4, seed=5, extra_body=NO_THINKING)
    for c in r.choices:
        calls = c.message.tool_calls or []
        assert calls and all(t.function.name in ("get_weather", "get_time") for t in calls)
        assert c.finish_reason in ("tool_calls", "length")
        for t in calls:
            json.loads(t.function.arguments)


def test_json_schema_validates_100_of_100_at_temperature_1(server):
    validator = jsonschema_rs.validator_for(PERSON)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)

    async def one(i):
        r = await aclient.chat.completions.create(
            model="default", messages=[{"role": "user", "content": f"Person {i}"}], response_format=fmt,
            temperature=1.0, max_tokens=48, extra_body=NO_THINKING)
        return r.choices[0]

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i) for i in range(100)))
        finally:
            await aclient.close()

    choices = asyncio.run(all_of_them())
    valid = sum(c.finish_reason == "stop" and validator.is_valid(json.loads(c.message.content)) for c in choices)
    assert valid == 100


def test_json_object_streams_an_object(client):
    chunks = client.chat.completions.create(model="default", messages=ASK, response_format={"type": "json_object"},
                                            temperature=1.0, max_tokens=64, seed=3, stream=True, extra_body=NO_THINKING)
    content, _, _, finish = stream_message(chunks)
    if finish == "stop":  # an object's text can be long: only a finished one must parse
        assert isinstance(json.loads(content), dict)
    assert content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_goes_to_reasoning_content(client, stream):
    """The template opens a think block when enable_thinking is true (mlx-lm's default for
    a model with think markers): the tiny model never closes it, so all it writes is reasoning."""
    kw = dict(model="default", messages=ASK, temperature=0, max_tokens=8)
    if stream:
        thinking = stream_message(client.chat.completions.create(stream=True, **kw))
        plain = stream_message(client.chat.completions.create(stream=True, extra_body=NO_THINKING, **kw))
    else:
        m = client.chat.completions.create(**kw).choices[0].message
        thinking = (m.content, m.reasoning_content)
        m = client.chat.completions.create(extra_body=NO_THINKING, **kw).choices[0].message
        plain = (m.content, getattr(m, "reasoning_content", None))
    assert not thinking[0] and thinking[1]
    assert plain[0] and not plain[1]


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"},
                                                                 "strict": True}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "string", "format": "no-such-format"}}}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_what_cannot_be_enforced_is_a_400(server, body, param):
    r = httpx.post(f"{server.base_url}/chat/completions", json={"model": "default", "messages": ASK} | body,
                   timeout=60)
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"]
