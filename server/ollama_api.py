"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``,
``/api/ps``, ``/api/version``): what Open WebUI's Ollama connection, the
``ollama`` clients and many Mac apps speak. A translator only: bodies become the
internal chat (or, with ``raw``, text) request of ``turns.py``; replies stream
back as newline-delimited JSON (``stream`` defaults to true, as in Ollama).

``options`` map to sampling (temperature, top_p, top_k, min_p, num_predict,
stop, seed, repeat_penalty, presence/frequency_penalty); options about Ollama's
own runtime (num_ctx, num_gpu, keep_alive, ...) mean nothing here and are
ignored. ``format`` ("json" or a JSON schema) is enforced by the grammar, as
``response_format`` is. Any model name is served by the one model.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Dict, List, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from mlxpipe.server.chat import Delta
from mlxpipe.server.engine import GenerationFailed, SequenceFailed
from mlxpipe.server.errors import ApiError
from mlxpipe.server.schemas import ChatCompletionRequest, CompletionRequest
from mlxpipe.server.turns import ChatTurn, Turns

VERSION = "0.12.0"  # the Ollama API this follows (clients check that /api/version answers)
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: Optional[List[str]] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None
    tool_name: Optional[str] = None


class ChatBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: List[Message] = []
    tools: Optional[List[Dict[str, Any]]] = None
    format: Union[str, Dict[str, Any], None] = None
    options: Optional[Dict[str, Any]] = None
    stream: bool = True


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str = ""
    system: Optional[str] = None
    raw: bool = False
    images: Optional[List[str]] = None
    format: Union[str, Dict[str, Any], None] = None
    options: Optional[Dict[str, Any]] = None
    stream: bool = True


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _sampling(options: Optional[Dict[str, Any]], fmt) -> Dict[str, Any]:
    """Ollama's options and format as the internal request's fields."""
    out = {ours: options[theirs] for theirs, ours in _OPTIONS.items() if (options or {}).get(theirs) is not None}
    predict = (options or {}).get("num_predict")
    if isinstance(predict, int) and predict > 0:  # -1: until the context is full, -2: fill it
        out["max_tokens"] = predict
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise ApiError(400, f"format must be \"json\" or a JSON schema, not {fmt!r}")
    return out


def _messages(messages: List[Message]) -> List[Dict[str, Any]]:
    """Ollama messages as OpenAI chat messages: calls get ids, results answer them by name."""
    out, pending = [], []
    for i, m in enumerate(messages):
        if m.images:
            raise ApiError(400, f"messages.{i}.images: images are not supported: this model takes text only")
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for c in m.tool_calls:
                f = c.get("function") or {}
                call_id = f"call_{i}_{len(calls)}"
                pending.append((f.get("name"), call_id))
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": f.get("name") or "", "arguments": json.dumps(f.get("arguments") or {})}})
            out.append({"role": "assistant", "content": m.content or None, "tool_calls": calls})
        elif m.role == "tool":
            match = next((p for p in pending if m.tool_name in (None, p[0])), None)
            if match is not None:
                pending.remove(match)
            out.append({"role": "tool", "tool_call_id": match[1] if match else "", "content": m.content})
        else:
            out.append({"role": m.role, "content": m.content})
    return out


def _validated(cls, body: Dict[str, Any]):
    try:
        return cls.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ApiError(400, f"{where}: {first['msg'].removeprefix('Value error, ')}") from None


def chat_request(body: ChatBody) -> ChatCompletionRequest:
    fields = {"model": body.model, "messages": _messages(body.messages), **_sampling(body.options, body.format)}
    if body.tools:
        fields["tools"] = body.tools
    return _validated(ChatCompletionRequest, fields)


def _stats(gen, prompt_tokens: int, generated: int, started: float) -> Dict[str, Any]:
    """Ollama's counters and durations (nanoseconds)."""
    s = gen.streams[0]
    first = s.first_token_at or time.monotonic()
    last = s.last_token_at or first
    return {"total_duration": int((time.monotonic() - started) * 1e9), "load_duration": 0,
            "prompt_eval_count": prompt_tokens, "prompt_eval_duration": int((first - s.submitted) * 1e9),
            "eval_count": generated, "eval_duration": int(max(last - first, 0) * 1e9)}


def _calls(calls: List[dict]) -> List[dict]:
    out = []
    for c in calls:
        try:
            arguments = json.loads(c["function"]["arguments"])
        except json.JSONDecodeError:
            arguments = {}
        out.append({"function": {"name": c["function"]["name"], "arguments": arguments}})
    return out


async def _chat_lines(turn: ChatTurn, model: str, started: float, on_error=None) -> AsyncIterator[dict]:
    """One object per piece of the reply, the last with ``done`` and the counters."""
    generated = 0
    try:
        async for p in turn.pieces():
            generated += p.tokens
            message = {"role": "assistant", "content": p.delta.content}
            if p.delta.reasoning:
                message["thinking"] = p.delta.reasoning
            if p.delta.tool_calls:
                message["tool_calls"] = _calls(p.delta.tool_calls)
            line = {"model": model, "created_at": _now(), "message": message, "done": p.finish is not None}
            if p.finish is not None:
                line |= {"done_reason": "length" if p.finish == "length" else "stop",
                         **_stats(turn.gen, turn.gen.prompt_tokens, generated, started)}
            yield line
    except (GenerationFailed, SequenceFailed) as err:
        if on_error is None:  # not streamed: the route answers with the error's status
            raise
        yield on_error(err)


def _merge(lines: List[dict]) -> dict:
    """The non-streamed answer: the pieces' text joined, the last line's counters."""
    last = dict(lines[-1])
    message = {"role": "assistant", "content": "".join(line["message"]["content"] for line in lines)}
    thinking = "".join(line["message"].get("thinking", "") for line in lines)
    calls = [c for line in lines for c in line["message"].get("tool_calls", [])]
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = calls
    last["message"] = message
    return last


def _ndjson(lines: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        async for line in lines:
            yield json.dumps(line, separators=(",", ":")) + "\n"

    return StreamingResponse(body(), media_type="application/x-ndjson")


async def _collect(lines: AsyncIterator[dict]) -> List[dict]:
    return [line async for line in lines]


def _card(name: str, cluster) -> Dict[str, Any]:
    """The one model as Ollama's model listings describe one."""
    load = cluster.pipeline.stages[0].load
    bits = (cluster.model_config.get("quantization") or {}).get("bits")
    return {"name": name, "model": name, "modified_at": _now(), "size": int(load.model_bytes) if load else 0,
            "digest": (load.fingerprint if load else "") or "", "details": {
                "parent_model": "", "format": "mlx", "family": load.model_type if load else "",
                "families": [load.model_type] if load else [], "parameter_size": "",
                "quantization_level": f"Q{bits}" if bits else "unquantized"}}


def add_routes(app: FastAPI, turns: Turns, cluster) -> None:
    name = f"{turns.options.model_id}:latest"

    @app.get("/api/version")
    async def version():
        return {"version": VERSION}

    @app.get("/api/tags")
    async def tags():
        return {"models": [_card(name, cluster)]}

    @app.get("/api/ps")
    async def ps():
        return {"models": [_card(name, cluster) | {"expires_at": "2999-01-01T00:00:00Z", "size_vram": 0,
                                                     "context_length": turns.engine.max_context}]}

    @app.post("/api/show")
    async def show(body: Dict[str, Any]):
        card = _card(name, cluster)
        load = cluster.pipeline.stages[0].load
        return {"modelfile": "", "parameters": "", "template": getattr(turns.tok, "chat_template", None) or "",
                "details": card["details"], "modified_at": card["modified_at"],
                "model_info": {"general.architecture": card["details"]["family"],
                               f"{card['details']['family']}.context_length": turns.engine.max_context,
                               "general.block_count": load.num_layers if load else 0},
                "capabilities": ["completion", "tools"]}

    @app.post("/api/chat")
    async def chat(body: ChatBody, request: Request):
        started = time.monotonic()
        if not body.messages:  # Ollama's way to load a model: nothing to say
            return {"model": body.model, "created_at": _now(), "message": {"role": "assistant", "content": ""},
                    "done_reason": "load", "done": True}
        req = chat_request(body)
        turn = await turns.chat(req)
        if body.stream:
            return _ndjson(_chat_lines(turn, body.model, started,
                                       lambda e: turns.error(req, e).body("ollama")))
        return _merge(await turns.whole(request, req, turn.gen, _collect(_chat_lines(turn, body.model, started))))

    @app.post("/api/generate")
    async def generate(body: GenerateBody, request: Request):
        if not body.prompt:
            return {"model": body.model, "created_at": _now(), "response": "", "done_reason": "load", "done": True}
        if body.images:
            raise ApiError(400, "images are not supported: this model takes text only")
        started = time.monotonic()
        messages = ([Message(role="system", content=body.system)] if body.system else []) + [
            Message(role="user", content=body.prompt)]
        if body.raw:
            req = _validated(CompletionRequest, {"model": body.model, "prompt": body.prompt,
                                                 **_sampling(body.options, body.format)})
            turn = ChatTurn(turns.submit(req, await turns.encode(turns.tok.encode, body.prompt)), [_Plain()])
        else:
            req = chat_request(ChatBody(model=body.model, messages=messages, format=body.format,
                                        options=body.options))
            turn = await turns.chat(req)

        async def lines(on_error=None):
            async for line in _chat_lines(turn, body.model, started, on_error):
                if "message" in line:
                    line["response"] = line.pop("message")["content"]
                yield line

        if body.stream:
            return _ndjson(lines(lambda e: turns.error(req, e).body("ollama")))
        out = await turns.whole(request, req, turn.gen, _collect(lines()))
        return dict(out[-1], response="".join(line["response"] for line in out))


class _Plain:
    """A raw generation's reply: its text as it comes."""

    def feed(self, text: str, final: bool) -> Delta:
        return Delta(content=text)

    def finish_reason(self, reason):
        return reason
