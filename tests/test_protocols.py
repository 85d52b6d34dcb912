"""Every protocol a client speaks, driven by that protocol's own client: the
``anthropic`` SDK (Messages), the ``openai`` SDK (Responses, chat), the ``ollama``
client, LangChain, and the real agent CLIs (Claude Code, Codex) installed from
npm, all against one real 2-stage ``mlxpipe serve`` of the default model.

What must hold: each API answers in its own shape (events, errors, usage with the
prefix cache's reads); a forced tool call works on a model whose template knows no
tools; JSON-schema output is valid at temperature 1 through every API; and
greedy text is the same whichever API asked for it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import anthropic
import httpx
import jsonschema_rs
import ollama
import openai
import pytest

SYSTEM = "You are a helpful assistant."
QUESTION = "Name three colors."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def root(default_server):
    return default_server.root


@pytest.fixture(scope="module")
def claude(root):
    return anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oai(root):
    return openai.OpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def olla(root):
    return ollama.Client(host=root)


# -- Anthropic Messages ---------------------------------------------------------------------


def test_messages_whole_streamed_and_counted(claude):
    msgs = [{"role": "user", "content": QUESTION}]
    whole = claude.messages.create(model="claude-any", max_tokens=16, system=SYSTEM, messages=msgs,
                                   extra_body={"temperature": 0})
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "claude-any"
    assert whole.content[0].type == "text" and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.output_tokens <= 16
    counted = claude.messages.count_tokens(model="claude-any", system=SYSTEM, messages=msgs).input_tokens
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == counted
    with claude.beta.messages.stream(model="claude-any", max_tokens=16, system=SYSTEM, messages=msgs,
                                     extra_body={"temperature": 0}) as stream:  # ?beta=true, as Claude Code
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: read from the prefix cache


def test_messages_forced_tool_and_its_result(claude):
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(model="m", max_tokens=48, messages=msgs, tools=tools,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use", first
    call = next(b for b in first.content if b.type == "tool_use")
    assert call.name == "get_weather" and jsonschema_rs.is_valid(WEATHER, call.input), call
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "12 C, rain"}]}]
    second = claude.messages.create(model="m", max_tokens=16, messages=msgs, tools=tools)
    assert second.content and second.content[0].type == "text"
    assert second.usage.cache_read_input_tokens > 0  # the first turn's prompt is the second's prefix


def test_messages_errors_in_anthropics_shape(claude, root):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="m", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert "max_tokens" in str(err.value)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    resp = httpx.post(f"{root}/v1/messages", json={"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": [image]}]})
    assert resp.status_code == 400 and resp.json()["type"] == "error", resp.text
    assert "images are not supported: this model takes text only" in resp.json()["error"]["message"]


# -- OpenAI Responses -----------------------------------------------------------------------


def test_responses_streamed_stored_and_continued(oai):
    events = list(oai.responses.create(model="gpt-any", instructions=SYSTEM, input=QUESTION, max_output_tokens=12,
                                       temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert "response.output_text.delta" in kinds and kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    first = events[-1].response
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    follow = oai.responses.create(model="gpt-any", input="And two more.", previous_response_id=first.id,
                                  max_output_tokens=8)
    assert follow.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="gpt-any", input="x", previous_response_id="resp_nope")


def test_responses_function_call_and_its_output(oai):
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": WEATHER}]
    first = oai.responses.create(model="m", input="Weather in Oslo?", tools=tools, max_output_tokens=48,
                                 tool_choice={"type": "function", "name": "get_weather"})
    call = next(o for o in first.output if o.type == "function_call")
    assert call.name == "get_weather" and jsonschema_rs.is_valid(WEATHER, json.loads(call.arguments))
    second = oai.responses.create(model="m", previous_response_id=first.id, tools=tools, max_output_tokens=12,
                                  input=[{"type": "function_call_output", "call_id": call.call_id,
                                          "output": "3 C, snow"}])
    assert second.status in ("completed", "incomplete") and second.output_text


def test_a_cut_response_is_incomplete_down_to_its_item_and_echoes_its_sampling(oai):
    whole = oai.responses.create(model="m", input=QUESTION, max_output_tokens=3)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    (message,) = whole.output
    assert message.type == "message" and message.status == "incomplete"  # as OpenAI marks the item
    assert (whole.temperature, whole.top_p) == (0.0, 1.0)  # what was used (this server: --temp 0), not null
    events = list(oai.responses.create(model="m", input=QUESTION, max_output_tokens=3, temperature=0.5,
                                       top_p=0.9, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.status for i in done] == ["incomplete"] and events[-1].type == "response.incomplete"
    last = events[-1].response
    assert last.output[0].status == "incomplete" and (last.temperature, last.top_p) == (0.5, 0.9)


# -- Ollama --------------------------------------------------------------------------------


def test_ollama_lists_shows_and_chats(olla):
    listed = olla.list().models
    assert len(listed) == 1 and listed[0].model.endswith(":latest")
    assert olla.show(listed[0].model).capabilities and olla.ps().models
    reply = olla.chat(model="llama3.2", messages=[{"role": "user", "content": QUESTION}],
                      options={"temperature": 0, "num_predict": 12})
    assert reply.done and reply.message.content and reply.eval_count <= 12 and reply.prompt_eval_count > 0
    parts = list(olla.chat(model="llama3.2", messages=[{"role": "user", "content": QUESTION}], stream=True,
                           options={"temperature": 0, "num_predict": 12}))
    assert parts[-1].done and "".join(p.message.content for p in parts) == reply.message.content
    generated = olla.generate(model="x", prompt="The sky is", raw=True, options={"num_predict": 6})
    assert generated.done and generated.response
    with pytest.raises(ollama.ResponseError) as err:
        olla.chat(model="x", messages=[{"role": "user", "content": "x", "images": ["AAAA"]}])
    assert "images are not supported" in str(err.value)


# -- forced tool calls and structured output, through every API -------------------------------


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_tool_call_on_a_model_without_tool_markers(oai, choice):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
             {"type": "function", "function": {"name": "get_person", "parameters": PERSON}}]
    tool_choice = {"type": "function", "function": {"name": "get_person"}} if choice == "named" else "required"
    out = oai.chat.completions.create(model="default", messages=[{"role": "user", "content": "Who is Ada?"}],
                                      tools=tools, tool_choice=tool_choice, max_tokens=64, temperature=1.0,
                                      seed=7, parallel_tool_calls=False)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.tool_calls, out
    for call in message.tool_calls:
        schema = {"get_weather": WEATHER, "get_person": PERSON}[call.function.name]
        assert jsonschema_rs.is_valid(schema, json.loads(call.function.arguments)), call
    if choice == "named":
        assert [c.function.name for c in message.tool_calls] == ["get_person"]


def test_a_forced_call_adds_no_undeclared_keys(oai):
    """The schema leaves additionalProperties unsaid: strict by default (as xgrammar), so the
    greedy default model ends its call with the one key declared, well inside the budget
    (it used to write '{"city": "Paris", "type": "city", "properties": {...' until cut)."""
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    out = oai.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is the weather in Paris?"}], temperature=0,
        max_tokens=60, tools=[{"type": "function", "function": {"name": "get_weather", "parameters": city}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and out.usage.completion_tokens < 40, out
    assert list(json.loads(call.function.arguments)) == ["city"]


def test_langchain_structured_output_by_function_calling(root):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    llm = ChatOpenAI(base_url=f"{root}/v1", api_key="unused", model="default", max_tokens=48, max_retries=0)
    person = llm.with_structured_output(Person, method="function_calling").invoke("Describe a person.")
    assert isinstance(person, Person)


@pytest.mark.extended  # (sampled structured output through every API; greedy schemas stay in the default run)
def test_json_schema_output_is_valid_at_temperature_1_through_every_api(claude, oai, olla):
    outs = []
    for seed in range(3):
        outs.append(oai.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "A person as JSON"}], temperature=1.0,
            seed=seed, max_tokens=48, response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON}}).choices[0].message.content)
        outs.append(oai.responses.create(
            model="m", input="A person as JSON", temperature=1.0, max_output_tokens=48,
            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}}).output_text)
        outs.append(claude.messages.create(
            model="m", max_tokens=48, messages=[{"role": "user", "content": "A person as JSON"}],
            extra_body={"temperature": 1.0, "output_config": {"format": {"type": "json_schema",
                                                                        "schema": PERSON}}}).content[0].text)
        outs.append(olla.chat(model="m", messages=[{"role": "user", "content": "A person as JSON"}], format=PERSON,
                              options={"temperature": 1.0, "num_predict": 48}).message.content)
    for text in outs:
        assert jsonschema_rs.is_valid(PERSON, json.loads(text)), text


def test_greedy_text_is_the_same_through_every_api(claude, oai, olla):
    msgs = [{"role": "user", "content": QUESTION}]
    chat = oai.chat.completions.create(model="default", messages=[{"role": "system", "content": SYSTEM}] + msgs,
                                       temperature=0, max_tokens=20).choices[0].message.content
    messages = claude.messages.create(model="m", system=SYSTEM, messages=msgs, max_tokens=20,
                                      extra_body={"temperature": 0}).content[0].text
    responses = oai.responses.create(model="m", instructions=SYSTEM, input=QUESTION, temperature=0,
                                     max_output_tokens=20).output_text
    ollama_chat = olla.chat(model="m", messages=[{"role": "system", "content": SYSTEM}] + msgs,
                            options={"temperature": 0, "num_predict": 20}).message.content
    assert chat and messages == chat and responses == chat and ollama_chat == chat


def test_an_unknown_path_names_what_is_served(root):
    resp = httpx.post(f"{root}/v1/moderations", json={"input": "x"})
    assert resp.status_code == 404
    message = resp.json()["error"]["message"]
    for served in ("/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/v1/messages", "/api/chat",
                   "/api/embed"):
        assert served in message, message


# -- the real agent CLIs ----------------------------------------------------------------------

AGENTS = {"@anthropic-ai/claude-code": "2.1.197", "@openai/codex": "0.171.0"}
AGENT_CONFIGS = Path(__file__).parent.parent / "docs" / "agents"


@pytest.fixture(scope="module")
def agent_bin():
    """The agent CLIs, installed from npm once into a cache folder (pinned versions)."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the agent CLIs cannot be installed")
    folder = Path(os.environ.get("MLXPIPE_AGENTS_DIR", Path.home() / ".cache" / "mlxpipe-tests" / "agents"))
    folder.mkdir(parents=True, exist_ok=True)
    bins = folder / "node_modules" / ".bin"
    if not ((bins / "claude").exists() and (bins / "codex").exists()):
        proc = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(folder),
                               *[f"{name}@{v}" for name, v in AGENTS.items()]],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return bins


def _agent_env(home: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_"))}
    return env | {"HOME": str(home), "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
                  "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"} | extra


def test_claude_code_completes_turns_and_the_second_reads_the_cache(agent_bin, root, tmp_path):
    # Claude Code counts a reply cut at its max_tokens as an error, so the questions are
    # ones the default model (greedy: the server's default here) answers briefly.
    env = _agent_env(tmp_path, ANTHROPIC_BASE_URL=root, ANTHROPIC_API_KEY="unused",
                     CLAUDE_CODE_MAX_OUTPUT_TOKENS="200")
    results = []
    for question in ("What color is the sky?", "What color is grass?"):
        proc = subprocess.run([str(agent_bin / "claude"), "-p", question, "--tools", "", "--system-prompt",
                               "Answer with one word.", "--output-format", "json"],
                              capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
        results.append(json.loads(proc.stdout))
    for r in results:
        assert not r["is_error"] and r["result"], r
    assert results[1]["usage"]["cache_read_input_tokens"] > 0, results[1]["usage"]


@pytest.mark.extended  # the slowest agent CLI: CI's second run
def test_codex_completes_turns_and_the_second_reads_the_cache(agent_bin, root, tmp_path):
    (tmp_path / ".codex").mkdir()
    config = (AGENT_CONFIGS / "codex-config.toml").read_text()
    config = config.replace("http://127.0.0.1:8000/v1", f"{root}/v1").replace(
        '"codex-instructions.md"', json.dumps(str(AGENT_CONFIGS / "codex-instructions.md")))
    (tmp_path / ".codex" / "config.toml").write_text(config)
    cached = []
    for question in ("What color is the sky?", "What color is the sky?"):  # answered within the server's budget
        proc = subprocess.run([str(agent_bin / "codex"), "exec", "--skip-git-repo-check", "--json", question],
                              capture_output=True, text=True, timeout=300, env=_agent_env(tmp_path), cwd=tmp_path)
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
        events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        done = [e for e in events if e.get("type") == "turn.completed"]
        assert done and any(e.get("type") == "item.completed" for e in events), events[-5:]
        cached.append(done[-1]["usage"]["cached_input_tokens"])
    assert cached[1] > 0, cached
