"""A second model on the head (``--also default``, served as ``<name>-head``): listed beside the
pipeline's, answering while the pipeline's model streams, through every API, with mlx-lm's greedy
tokens; an unknown name is a 404 that lists the served models (OpenAI's paths)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from conftest import run_async

PIPELINE = "SmolLM2-135M-Instruct-Q4_1"
HEAD = f"{PIPELINE}-head"


def _head_tokens(server) -> int:
    health = server.http.get(f"{server.root}/health").json()
    return next(m for m in health["head_models"] if m["name"] == HEAD)["generated_tokens"]


def test_listed_beside_the_pipeline_model(team_server):
    models = {m["id"]: m for m in team_server.http.get(f"{team_server.base_url}/models").json()["data"]}
    assert models[PIPELINE]["runs_on"] == "pipeline" and models[HEAD]["runs_on"] == "head"
    assert models[HEAD]["context_length"] > 0 and "chat" in models[HEAD]["capabilities"]
    assert models["all-MiniLM-L6-v2"]["capabilities"] == ["embedding"]
    tags = [m["name"] for m in team_server.http.get(f"{team_server.root}/api/tags").json()["models"]]
    assert tags == [f"{PIPELINE}:latest", f"{HEAD}:latest", "all-MiniLM-L6-v2:latest"]


def test_unknown_model_is_a_404_listing_the_served_ones(team_server):
    import openai

    client = openai.OpenAI(base_url=team_server.base_url, api_key=team_server.key)
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "Hi"}])
    message = str(err.value)
    assert "gpt-9" in message and all(name in message for name in (PIPELINE, HEAD, "all-MiniLM-L6-v2"))
    assert team_server.http.get(f"{team_server.base_url}/models/gpt-9").status_code == 404


def test_head_model_equals_mlx_lm_while_the_pipeline_streams(team_server, default_model, reference):
    from mlx_lm import load

    _, tok = load(str(default_model))
    prompt = tok.encode("The capital of France is")
    want = tok.decode(reference(default_model, prompt, 24))

    async def run():
        async with httpx.AsyncClient(base_url=team_server.base_url, timeout=120,
                                     headers={"Authorization": f"Bearer {team_server.key}"}) as http:
            pipeline_done, streamed = asyncio.Event(), []

            async def pipeline():  # a long stream on the pipeline's model (cancelled once the head answered)
                async with http.stream("POST", "/completions", json={
                        "model": PIPELINE, "prompt": "Once upon a time", "max_tokens": 400, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        streamed.append(line)
                pipeline_done.set()

            streaming = asyncio.ensure_future(pipeline())
            while len(streamed) < 2:  # it streams
                await asyncio.sleep(0.05)
            started = time.monotonic()
            got = (await http.post("/completions", json={"model": HEAD, "prompt": prompt, "max_tokens": 24})).json()
            answered_while_streaming = not pipeline_done.is_set()
            streaming.cancel()
            await asyncio.gather(streaming, return_exceptions=True)
            return got, answered_while_streaming, time.monotonic() - started

    got, during, _ = run_async(run())
    text = got["choices"][0]["text"]  # (a completion's first token's leading space: as the pipeline's, not compared)
    assert got["model"] == HEAD and text.strip() and want.strip().startswith(text.strip())
    assert got["usage"]["completion_tokens"] == 24 or got["choices"][0]["finish_reason"] == "stop"
    assert during, "the head's model answered only after the pipeline's stream ended"


def test_every_api_reaches_the_head_model(team_server):
    import anthropic
    import ollama
    import openai

    ask = "Say hello."
    before = _head_tokens(team_server)
    oai = openai.OpenAI(base_url=team_server.base_url, api_key=team_server.key)
    chat = oai.chat.completions.create(model=HEAD, messages=[{"role": "user", "content": ask}], max_tokens=12)
    text = chat.choices[0].message.content
    assert chat.model == HEAD and text
    after_chat = _head_tokens(team_server)
    assert after_chat - before == chat.usage.completion_tokens
    responses = oai.responses.create(model=HEAD, input=ask, max_output_tokens=12)
    assert responses.output_text == text
    claude = anthropic.Anthropic(base_url=team_server.root, api_key=team_server.key).messages.create(
        model=HEAD, max_tokens=12, messages=[{"role": "user", "content": ask}])
    assert claude.content[0].text == text
    llama = ollama.Client(host=team_server.root, headers={"Authorization": f"Bearer {team_server.key}"}).chat(
        model=f"{HEAD}:latest", messages=[{"role": "user", "content": ask}], options={"num_predict": 12, "temperature": 0})
    assert llama.message.content == text
    assert _head_tokens(team_server) - after_chat == 3 * chat.usage.completion_tokens
    refused = team_server.http.post(f"{team_server.base_url}/chat/completions", json={
        "model": HEAD, "messages": [{"role": "user", "content": ask}], "response_format": {"type": "json_object"}})
    assert refused.status_code == 400 and "grammar" in refused.json()["error"]["message"]
