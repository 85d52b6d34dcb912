"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``,
``/api/ps``, ``/api/version``): what Open WebUI's Ollama connection, the
``ollama`` clients and many Mac apps speak. A translator only: bodies become the
internal request (``request.GenerationRequest``: chat, or with ``raw`` plain text); replies stream
back as newline-delimited JSON (``stream`` defaults to true, as in Ollama).

``options`` map to sampling (temperature, top_p, top_k, min_p, num_predict,
stop, seed, repeat_penalty, presence/frequency_penalty); options about Ollama's
own runtime (num_ctx, num_gpu, keep_alive, ...) mean nothing here and are
ignored. ``format`` ("json" or a JSON schema) is enforced by the grammar, as
``response_format`` is. A name of another model the head serves (``--also``) reaches it;
any other name is served by the pipeline's model.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Dict, List, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, field_validator

from mlxpipe.server.api.chat_template import json_value
from mlxpipe.server.api.errors import ApiError
from mlxpipe.server.api.generation import Generation, Generator
from mlxpipe.server.api.json_body import Body, cache_salt_field
from mlxpipe.server.api.keys import caller_of
from mlxpipe.server.api.options import ApiOptions
from mlxpipe.server.api.request import GenerationRequest, image_part, request_sampling
from mlxpipe.server.api.schemas import Tool, stop_strings
from mlxpipe.server.api.tenants import Tenant
from mlxpipe.server.core.streams import GenerationFailed, SequenceFailed
from mlxpipe.shards.params.sampling import Sampling

VERSION = "0.12.0"  # the Ollama API this follows (clients check that /api/version answers)
# Ollama's options that are sampling parameters, by their name in ``Sampling``.
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: Dict[str, Any] = {}


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: Optional[List[str]] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_name: Optional[str] = None


class Options(BaseModel):
    """Ollama's ``options``: those that mean something here (the rest, Ollama's runtime, ignored)."""

    model_config = ConfigDict(extra="ignore")

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    repeat_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    num_predict: Optional[int] = None   # -1: until the context is full, -2: fill it
    stop: Optional[List[str]] = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return stop_strings(v)

    def sampling(self, options: ApiOptions) -> Sampling:
        return request_sampling(options, **{ours: getattr(self, theirs) for theirs, ours in _OPTIONS.items()})

    def max_tokens(self) -> Optional[int]:
        return self.num_predict if self.num_predict and self.num_predict > 0 else None


class ChatBody(Body):
    model: str
    messages: List[Message] = []
    tools: Optional[List[Tool]] = None
    format: Union[Literal["", "json"], Dict[str, Any], None] = None
    options: Options = Options()
    stream: bool = True
    cache_salt: Optional[str] = cache_salt_field()


class GenerateBody(Body):
    model: str
    prompt: str = ""
    system: Optional[str] = None
    raw: bool = False
    images: Optional[List[str]] = None
    format: Union[Literal["", "json"], Dict[str, Any], None] = None
    options: Options = Options()
    stream: bool = True
    cache_salt: Optional[str] = cache_salt_field()


class ShowBody(Body):
    model: Optional[str] = None
    name: Optional[str] = None  # older clients


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _format(fmt) -> Optional[Dict[str, Any]]:
    """Ollama's ``format`` as OpenAI's response_format."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}


def _pictured(content: str, images: Optional[List[str]], refs: list, param: str):
    """A message's content with its images (base64, as Ollama sends them) before its text, as
    Ollama puts them; their refs appended to ``refs``."""
    if not images:
        return content
    return [image_part(refs, b64, f"{param}.{j}", is_base64=True) for j, b64 in enumerate(images)] + (
        [{"type": "text", "text": content}] if content else [])


def _messages(messages: List[Message], refs: list) -> List[Dict[str, Any]]:
    """Ollama messages as OpenAI chat messages: calls get ids, results answer them by name;
    images become image parts (their refs appended to ``refs``)."""
    out, pending = [], []
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for c in m.tool_calls:
                call_id = f"call_{i}_{len(calls)}"
                pending.append((c.function.name, call_id))
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)}})
            out.append({"role": "assistant", "content": m.content or None, "tool_calls": calls})
        elif m.role == "tool":
            match = next((p for p in pending if m.tool_name in (None, p[0])), None)
            if match is not None:
                pending.remove(match)
            out.append({"role": "tool", "tool_call_id": match[1] if match else "", "content": m.content})
        else:
            out.append({"role": m.role, "content": _pictured(m.content, m.images, refs, f"messages.{i}.images")})
    return out




def request_of(body: Union[ChatBody, GenerateBody], options: ApiOptions, tenant: Tenant) -> GenerationRequest:
    """The internal request of an Ollama chat or generate body."""
    common = dict(sampling=body.options.sampling(options),  # num_predict past the context:
                  max_tokens=body.options.max_tokens(), clamp_max_tokens=True,  # what it leaves, as Ollama
                  stop=body.options.stop or [],
                  response_format=_format(body.format), tenant=tenant)
    refs = []  # the images, in order
    if isinstance(body, ChatBody):
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []] or None
        return GenerationRequest(messages=_messages(body.messages, refs), tools=tools, images=refs, **common)
    if body.raw:  # the prompt as it is, no template
        if body.images:
            raise ApiError(400, "images: a raw prompt takes no images (the template places them: raw false)",
                           param="images")
        return GenerationRequest(text=body.prompt, split_reply=False, **common)
    messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
        {"role": "user", "content": _pictured(body.prompt, body.images, refs, "images")}]
    return GenerationRequest(messages=messages, images=refs, **common)


def _calls(calls: List[dict]) -> List[dict]:
    out = []
    for c in calls:
        try:
            arguments = json_value(c["function"]["arguments"])
        except ValueError:  # cut off by num_predict (or not JSON): nothing to give
            arguments = {}
        if not isinstance(arguments, dict):
            arguments = {}
        out.append({"function": {"name": c["function"]["name"], "arguments": arguments}})
    return out


def _message(delta) -> Dict[str, Any]:
    message = {"role": "assistant", "content": delta.content}
    if delta.reasoning:
        message["thinking"] = delta.reasoning
    if delta.tool_calls:
        message["tool_calls"] = _calls(delta.tool_calls)
    return message


def _done(gen: Generation, finish: str, started: float) -> Dict[str, Any]:
    """The last line's ending and Ollama's counters (durations in nanoseconds)."""
    s, u = gen.streams[0], gen.usage()
    first = s.first_token_at or time.monotonic()
    last = s.last_token_at or first
    return {"done": True, "done_reason": "length" if finish == "length" else "stop",
            "total_duration": int((time.monotonic() - started) * 1e9), "load_duration": 0,
            "prompt_eval_count": u.prompt_tokens, "prompt_eval_duration": int((first - s.submitted) * 1e9),
            "eval_count": u.completion_tokens, "eval_duration": int(max(last - first, 0) * 1e9)}


async def _lines(gen: Generation, model: str, key: str, started: float, on_error) -> AsyncIterator[str]:
    """Newline-delimited JSON: one object per event, the last with ``done`` and the counters."""
    try:
        async for ev in gen.events():
            line = {"model": model, "created_at": _now(),
                    key: _message(ev.delta) if key == "message" else ev.delta.content, "done": False}
            if ev.finish_reason is not None:
                line.update(_done(gen, ev.finish_reason, started))
            yield json.dumps(line, separators=(",", ":")) + "\n"
    except (GenerationFailed, SequenceFailed) as err:
        yield json.dumps(on_error(err)) + "\n"


async def _whole(gen: Generation, request: Request, model: str, key: str, started: float) -> Dict[str, Any]:
    choice = (await gen.until_done(request))[0]
    return {"model": model, "created_at": _now(),
            key: _message(choice.delta) if key == "message" else choice.delta.content,
            **_done(gen, choice.finish_reason, started)}


def _card(generator: Generator) -> Dict[str, Any]:
    """A served model as Ollama's model listings describe one."""
    name, facts = f"{generator.options.model_id}:latest", generator.model_facts()
    return {"name": name, "model": name, "modified_at": _now(), "size": facts["model_bytes"],
            "digest": facts["fingerprint"], "details": {
                "parent_model": "", "format": "mlx", "family": facts["model_type"], "families": [facts["model_type"]],
                "parameter_size": "", "quantization_level": f"Q{facts['bits']}" if facts["bits"] else "unquantized"}}


def _embedding_card(generator: Generator) -> List[Dict[str, Any]]:
    """The head's embedding model, if any, as Ollama lists one."""
    embedder = getattr(generator.head, "embedder", None)
    if embedder is None:
        return []
    f = embedder.facts
    return [{"name": f"{f.name}:latest", "model": f"{f.name}:latest", "modified_at": _now(), "size": f.weight_bytes,
             "digest": "", "details": {"parent_model": "", "format": "mlx", "family": f.model_type,
                                       "families": [f.model_type], "parameter_size": "",
                                       "quantization_level": "unquantized"}}]


def add_routes(app: FastAPI, generator: Generator, options: ApiOptions) -> None:
    every = [generator, *generator.others.values()]  # the pipeline's model, then the head's others

    @app.get("/api/version")
    async def version():
        return {"version": VERSION}

    @app.get("/api/tags")
    async def tags():
        return {"models": [_card(g) for g in every] + _embedding_card(generator)}

    @app.get("/api/ps")
    async def ps():
        return {"models": [_card(g) | {"expires_at": "2999-01-01T00:00:00Z", "size_vram": 0,
                                       "context_length": g.engine.max_context} for g in every]}

    @app.post("/api/show")
    async def show(body: ShowBody):
        chosen = generator.pick(body.model or body.name)
        card, facts = _card(chosen), chosen.model_facts()
        return {"modelfile": "", "parameters": "", "template": getattr(chosen.tok, "chat_template", None) or "",
                "details": card["details"], "modified_at": card["modified_at"],
                "model_info": {"general.architecture": facts["model_type"],
                               f"{facts['model_type']}.context_length": chosen.engine.max_context,
                               "general.block_count": facts["num_layers"]},
                "capabilities": ["completion", "tools"] + (["vision"] if generator.vision is not None else [])}

    async def answer(body, request: Request, key: str):
        started = time.monotonic()
        req = request_of(body, options, caller_of(request).tenant(body.cache_salt))
        chosen = generator.pick(body.model)  # another model the head serves, by name; else the pipeline's
        gen = await chosen.start(req)
        if body.stream:
            return StreamingResponse(_lines(gen, body.model, key, started,
                                            lambda e: chosen.error(req, e).body("ollama")),
                                     media_type="application/x-ndjson")
        return await _whole(gen, request, body.model, key, started)

    @app.post("/api/chat")
    async def chat(body: ChatBody, request: Request):
        if not body.messages:  # Ollama's way to load a model: nothing to say
            return {"model": body.model, "created_at": _now(), "message": {"role": "assistant", "content": ""},
                    "done_reason": "load", "done": True}
        return await answer(body, request, "message")

    @app.post("/api/generate")
    async def generate(body: GenerateBody, request: Request):
        if not body.prompt:
            return {"model": body.model, "created_at": _now(), "response": "", "done_reason": "load", "done": True}
        return await answer(body, request, "response")
