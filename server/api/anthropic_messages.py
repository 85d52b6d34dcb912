"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``):
what Claude Code and the ``anthropic`` SDKs speak. A translator only: the body
becomes the internal request (``request.GenerationRequest``), the reply's events
become Anthropic's content blocks and server-sent events.

Served as Claude Code calls it (``?beta=true``, at ``/v1/messages`` and, for a
base URL that already ends in ``/v1``, at ``/messages``), with its fields that
cannot apply here accepted and ignored (``thinking``, ``context_management``,
``output_config``, ``metadata``, ``cache_control``). Any model name is served by
the one model (agents name their own). ``max_tokens`` is clamped to what the
context leaves (a reply cut there ends with ``stop_reason: "max_tokens"``).

Claude Code puts a ``x-anthropic-billing-header: cc_version=...`` text block in
``system`` that changes between its versions and sessions; it says nothing to
the model, and at the start of the prompt it would defeat the prefix cache on
every turn, so it is dropped.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Dict, List, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlxpipe.server.api.errors import ApiError
from mlxpipe.server.api.generation import SSE_HEADERS, Generation, Generator, keepalive
from mlxpipe.server.api.request import GenerationRequest
from mlxpipe.server.api.schemas import stop_strings
from mlxpipe.server.cluster.config import ApiOptions
from mlxpipe.server.core.streams import GenerationFailed, SequenceFailed
from mlxpipe.shards.sampling import Sampling

BILLING_HEADER = "x-anthropic-billing-header:"
PING_EVERY_S = 10.0  # a `ping` event this often while nothing else is sent (long prefills)
# Content blocks that carry what a text model cannot take.
NOT_TEXT = ("image", "document", "search_result", "container_upload")


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Optional[str] = None
    input_schema: Optional[Dict[str, Any]] = None  # absent: a server tool (web search, ...), not served here
    type: Optional[str] = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: Union[str, List[Dict[str, Any]]]


class MessagesRequest(BaseModel):
    """Anthropic's request body; fields not listed are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: List[Message] = Field(min_length=1)
    system: Union[str, List[Dict[str, Any]], None] = None
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[List[str]] = None
    temperature: Optional[float] = Field(default=None, ge=0, le=1)
    top_p: Optional[float] = Field(default=None, ge=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=0)
    stream: bool = False
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Dict[str, Any]] = None
    output_config: Optional[Dict[str, Any]] = None  # its `format` (a JSON schema) is enforced; `effort` ignored

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v):
        return stop_strings(v)


class CountRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: List[Message] = Field(min_length=1)
    system: Union[str, List[Dict[str, Any]], None] = None
    tools: Optional[List[Tool]] = None


def _text(blocks: Union[str, List[Dict[str, Any]], None], where: str) -> str:
    """The text of a string or of text blocks (a tool result's content)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    parts = []
    for b in blocks:
        kind = b.get("type")
        if kind in NOT_TEXT:
            raise ApiError(400, f"{where}: {kind} blocks are not supported: this model takes text only")
        if kind == "text":
            parts.append(b.get("text") or "")
    return "\n".join(parts)


def _system(system) -> str:
    if isinstance(system, list):
        system = [b for b in system if not (b.get("text") or "").startswith(BILLING_HEADER)]
    return _text(system, "system")


def _message(i: int, m: Message) -> List[Dict[str, Any]]:
    """One Anthropic message as OpenAI chat messages (tool results become tool messages)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts, calls, results = [], [], []
    for j, b in enumerate(m.content):
        kind, where = b.get("type"), f"messages.{i}.content.{j}"
        if kind == "text":
            texts.append(b.get("text") or "")
        elif kind == "tool_use":
            calls.append({"id": b.get("id") or "", "type": "function",
                          "function": {"name": b.get("name") or "", "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "tool_result":
            content = _text(b.get("content"), where)
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id") or "",
                            "content": f"Error: {content}" if b.get("is_error") else content})
        elif kind in NOT_TEXT:
            raise ApiError(400, f"{where}: {kind} blocks are not supported: this model takes text only")
        # thinking / redacted_thinking: the model's own reasoning, not shown to it again
    if m.role == "assistant":
        return [{"role": "assistant", "content": "\n".join(texts) or None, "tool_calls": calls or None}]
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def _tool_choice(choice: Optional[Dict[str, Any]]):
    kind = (choice or {}).get("type", "auto")
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name", "")}}
    if kind in ("auto", "none"):
        return kind
    raise ApiError(400, f"tool_choice.type must be auto, any, tool or none, not {kind!r}")


def _output_format(config: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Anthropic's structured output (``output_config.format``: a JSON schema; Claude
    Code asks for its session titles so) as the internal response_format."""
    fmt = (config or {}).get("format")
    if not fmt:
        return None
    if fmt.get("type") != "json_schema":
        raise ApiError(400, f"output_config.format.type must be json_schema, not {fmt.get('type')!r}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema") or {}}}


def _messages(req: Union[MessagesRequest, CountRequest]) -> List[Dict[str, Any]]:
    messages = [{"role": "system", "content": s}] if (s := _system(req.system)) else []
    for i, m in enumerate(req.messages):
        messages += _message(i, m)
    return messages


def _tools(req: Union[MessagesRequest, CountRequest]) -> Optional[List[Dict[str, Any]]]:
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                 "parameters": t.input_schema}}
             for t in req.tools or [] if t.input_schema is not None]
    return tools or None


def to_request(req: MessagesRequest, options: ApiOptions) -> GenerationRequest:
    """The internal request of an Anthropic one."""
    tools = _tools(req)
    return GenerationRequest(
        messages=_messages(req), tools=tools,
        sampling=Sampling(temperature=options.default_temperature if req.temperature is None else req.temperature,
                          top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0),
        max_tokens=req.max_tokens, clamp_max_tokens=True, stop=req.stop_sequences or [],
        response_format=_output_format(req.output_config),
        tool_choice=_tool_choice(req.tool_choice) if tools else None,
        parallel_tool_calls=not (req.tool_choice or {}).get("disable_parallel_tool_use", False))


def stop_reason(finish: Optional[str], stop_string: Optional[str]) -> str:
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_string else "end_turn"


def usage(gen: Generation, output_tokens: Optional[int] = None) -> dict:
    """Anthropic's usage: input tokens not read from the cache, and those that were."""
    u = gen.usage()
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "cache_read_input_tokens": u.cached_tokens,
            "cache_creation_input_tokens": 0,
            "output_tokens": u.completion_tokens if output_tokens is None else output_tokens}


def _tool_use(call: dict) -> dict:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:  # cut off by max_tokens: what there is
        arguments = {"_partial": call["function"]["arguments"]}
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call["function"]["name"],
            "input": arguments}


async def whole_message(gen: Generation, request: Request, model: str, msg_id: str) -> dict:
    choice = (await gen.until_done(request))[0]
    d, stop = choice.delta, choice.chunks[-1].stop if choice.chunks else None
    blocks = [_tool_use(c) for c in d.tool_calls]
    content = ([{"type": "thinking", "thinking": d.reasoning, "signature": ""}] if d.reasoning else [])
    content += ([{"type": "text", "text": d.content}] if d.content or not blocks else []) + blocks
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(choice.finish_reason, stop), "stop_sequence": stop, "usage": usage(gen)}


def _event(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(dict(type=kind, **body), separators=(',', ':'))}\n\n"


class _Blocks:
    """The content blocks of a streamed message: which is open, its index."""

    def __init__(self):
        self.index, self.open = -1, None

    def close(self) -> List[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def start(self, kind: str, block: dict) -> List[str]:
        """Events that make a block of ``kind`` the open one (a tool_use always a new one)."""
        if self.open == kind and kind != "tool_use":
            return []
        out = self.close()
        self.index, self.open = self.index + 1, kind
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]


def _piece_events(p, blocks: _Blocks) -> List[str]:
    out = []
    if p.delta.reasoning:
        out += blocks.start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        out.append(_event("content_block_delta", {"index": blocks.index, "delta": {
            "type": "thinking_delta", "thinking": p.delta.reasoning}}))
    if p.delta.content:
        out += blocks.start("text", {"type": "text", "text": ""})
        out.append(_event("content_block_delta", {"index": blocks.index,
                                                  "delta": {"type": "text_delta", "text": p.delta.content}}))
    for call in p.delta.tool_calls:
        block = _tool_use(call)
        out += blocks.start("tool_use", dict(block, input={}))
        out.append(_event("content_block_delta", {"index": blocks.index, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(block["input"])}}))
        out += blocks.close()
    return out


async def stream_message(gen: Generation, model: str, msg_id: str, on_error) -> AsyncIterator[str]:
    """Anthropic's event sequence for one reply, with ``ping``s while it is quiet."""
    u = usage(gen, 0)
    yield _event("message_start", {"message": {"id": msg_id, "type": "message", "role": "assistant", "model": model,
                                               "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": u}})
    blocks, tokens = _Blocks(), 0
    try:
        async for ev in keepalive(gen.events(), PING_EVERY_S):
            if ev is None:
                yield _event("ping", {})
                continue
            tokens += len(ev.chunk.tokens)
            for e in _piece_events(ev, blocks):
                yield e
            if ev.finish_reason is not None:
                for e in blocks.close():
                    yield e
                stop = ev.chunk.stop
                yield _event("message_delta", {"delta": {"stop_reason": stop_reason(ev.finish_reason, stop),
                                                         "stop_sequence": stop}, "usage": usage(gen, tokens)})
                yield _event("message_stop", {})
    except (GenerationFailed, SequenceFailed) as err:
        yield _event("error", on_error(err))


def add_routes(app: FastAPI, generator: Generator, options: ApiOptions) -> None:
    async def messages(body: MessagesRequest, request: Request):
        req = to_request(body, options)
        gen = await generator.start(req)
        msg_id = f"msg_{uuid.uuid4().hex[:24]}"
        if body.stream:
            def on_error(err):
                return {"error": generator.error(req, err).body("anthropic")["error"]}
            return StreamingResponse(stream_message(gen, body.model, msg_id, on_error),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return await whole_message(gen, request, body.model, msg_id)

    async def count_tokens(body: CountRequest):
        prompt = await generator.prompt(GenerationRequest(messages=_messages(body), tools=_tools(body)))
        return {"input_tokens": len(prompt)}

    for base in ("/v1/messages", "/messages"):
        app.post(base)(messages)
        app.post(f"{base}/count_tokens")(count_tokens)
