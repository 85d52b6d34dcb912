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
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from mlxpipe.server.api.chat_template import json_value
from mlxpipe.server.api.generation import SSE_HEADERS, Generation, Generator, keepalive
from mlxpipe.server.api.json_body import Body, by_type, cache_salt_field
from mlxpipe.server.api.keys import caller_of
from mlxpipe.server.api.options import ApiOptions
from mlxpipe.server.api.request import GenerationRequest, image_part, request_sampling
from mlxpipe.server.api.schemas import stop_strings
from mlxpipe.server.api.tenants import Tenant
from mlxpipe.server.core.streams import GenerationFailed, SequenceFailed

BILLING_HEADER = "x-anthropic-billing-header:"
PING_EVERY_S = 10.0  # a `ping` event this often while nothing else is sent (long prefills)
# Content blocks that carry what this server takes no model for.
NOT_TEXT = ("document", "search_result", "container_upload")


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Optional[str] = None
    input_schema: Optional[Dict[str, Any]] = None  # absent: a server tool (web search, ...), not served here
    type: Optional[str] = None


# -- content blocks: each a model, picked by its "type" -------------------------------------


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations

    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_use"]
    id: str
    name: str
    input: Dict[str, Any]


class ImageSource(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["base64", "url"]
    media_type: Optional[str] = None  # (the bytes say what they are)
    data: Optional[str] = None
    url: Optional[str] = None

    @model_validator(mode="after")
    def _given(self):
        if (self.data if self.type == "base64" else self.url) is None:
            raise ValueError(f"a {self.type} image source carries its `{'data' if self.type == 'base64' else 'url'}`")
        return self


class ImageBlock(BaseModel):
    """An image: base64 bytes, or a URL the server fetches where its operator allows it."""

    model_config = ConfigDict(extra="ignore")  # cache_control

    type: Literal["image"]
    source: ImageSource

    def part(self, images: list, param: str) -> dict:
        src = self.source
        return image_part(images, src.data if src.type == "base64" else src.url, param, src.type == "base64")


class NotTextBlock(BaseModel):
    """A block that carries what this server takes no model for: refused, in words that name it."""

    model_config = ConfigDict(extra="ignore")

    type: Literal[NOT_TEXT]

    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError(f"{self.type} blocks are not supported: this server takes text and image blocks")


ResultPart = by_type({"text": TextBlock, "image": ImageBlock, **dict.fromkeys(NOT_TEXT, NotTextBlock)})


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, List[ResultPart], None] = None
    is_error: StrictBool = False

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(b.text for b in self.content if isinstance(b, TextBlock))

    def content_for(self, images: list, param: str):
        """Its content as a tool message holds it: text, or its parts in order where it holds images."""
        text = f"Error: {self.text()}" if self.is_error else self.text()
        if not isinstance(self.content, list) or not any(isinstance(b, ImageBlock) for b in self.content):
            return text
        return [b.part(images, f"{param}.content.{j}") if isinstance(b, ImageBlock) else {"type": "text", "text": b.text}
                for j, b in enumerate(self.content)]


Block = by_type({"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock, "image": ImageBlock,
                 **dict.fromkeys(NOT_TEXT, NotTextBlock)})  # thinking, server tools' blocks: left out


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: Union[str, List[Block]]


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: StrictBool = False

    @model_validator(mode="after")
    def _named(self):
        if self.type == "tool" and not self.name:
            raise ValueError('a tool_choice of type "tool" names the tool')
        return self


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["json_schema"]
    schema_: Dict[str, Any] = Field(default_factory=dict, alias="schema")


class OutputConfig(BaseModel):
    """Structured output (``format``, enforced); ``effort`` and the rest are ignored."""

    model_config = ConfigDict(extra="ignore")

    format: Optional[OutputFormat] = None


class CountRequest(Body):
    """What ``count_tokens`` takes: the prompt's parts. Fields not listed are accepted and ignored."""

    model: str
    messages: List[Message] = Field(min_length=1)
    system: Union[str, List[TextBlock], None] = None
    tools: Optional[List[Tool]] = None


class MessagesRequest(CountRequest):
    """Anthropic's request body; fields not listed are accepted and ignored."""

    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[List[str]] = None
    temperature: Optional[float] = Field(default=None, ge=0, le=1)
    top_p: Optional[float] = Field(default=None, ge=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=0)
    stream: StrictBool = False
    tool_choice: Optional[ToolChoice] = None
    output_config: Optional[OutputConfig] = None  # its `format` (a JSON schema) is enforced; `effort` ignored
    metadata: Optional[Dict[str, Any]] = None
    cache_salt: Optional[str] = cache_salt_field()

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v):
        return stop_strings(v)


def _system(system: Union[str, List[TextBlock], None]) -> str:
    if isinstance(system, list):
        return "\n".join(b.text for b in system if not b.text.startswith(BILLING_HEADER))
    return system or ""


def _message(m: Message, images: list, param: str) -> List[Dict[str, Any]]:
    """One Anthropic message as OpenAI chat messages (tool results become tool messages); its
    images become image parts, their refs appended to ``images``."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    parts, calls, results = [], [], []
    for j, b in enumerate(m.content):
        if isinstance(b, TextBlock):
            parts.append({"type": "text", "text": b.text})
        elif isinstance(b, ImageBlock):
            parts.append(b.part(images, f"{param}.content.{j}"))
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input)}})
        elif isinstance(b, ToolResultBlock):
            results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": b.content_for(images, f"{param}.content.{j}")})
        # thinking / redacted_thinking: the model's own reasoning, not shown to it again
    pictured = any(p["type"] == "image" for p in parts)
    content = parts if pictured else "\n".join(p["text"] for p in parts)
    if m.role == "assistant":
        return [{"role": "assistant", "content": content or None, "tool_calls": calls or None}]
    return results + ([{"role": "user", "content": content}] if parts or not results else [])


def _tool_choice(choice: Optional[ToolChoice]):
    kind = choice.type if choice is not None else "auto"
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return kind


def _output_format(config: Optional[OutputConfig]) -> Optional[Dict[str, Any]]:
    """Anthropic's structured output (``output_config.format``: a JSON schema; Claude
    Code asks for its session titles so) as the internal response_format."""
    if config is None or config.format is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": config.format.schema_}}


def _messages(req: Union[MessagesRequest, CountRequest], images: list) -> List[Dict[str, Any]]:
    messages = [{"role": "system", "content": s}] if (s := _system(req.system)) else []
    for i, m in enumerate(req.messages):
        messages += _message(m, images, f"messages.{i}")
    return messages


def _tools(req: Union[MessagesRequest, CountRequest]) -> Optional[List[Dict[str, Any]]]:
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                 "parameters": t.input_schema}}
             for t in req.tools or [] if t.input_schema is not None]
    return tools or None


def to_request(req: MessagesRequest, options: ApiOptions, tenant: Tenant) -> GenerationRequest:
    """The internal request of an Anthropic one."""
    tools, images = _tools(req), []
    return GenerationRequest(
        messages=_messages(req, images), tools=tools, images=images,
        sampling=request_sampling(options, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k),
        max_tokens=req.max_tokens, clamp_max_tokens=True, stop=req.stop_sequences or [],
        response_format=_output_format(req.output_config),
        tool_choice=_tool_choice(req.tool_choice) if tools else None,
        parallel_tool_calls=not (req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use),
        tenant=tenant)


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
        arguments = json_value(call["function"]["arguments"])
    except ValueError:  # cut off by max_tokens (or not JSON): what there is
        arguments = None
    if not isinstance(arguments, dict):
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
        req = to_request(body, options, caller_of(request).tenant(body.cache_salt))
        chosen = generator.pick(body.model)  # another model the head serves, by name; else the pipeline's
        gen = await chosen.start(req)
        msg_id = f"msg_{uuid.uuid4().hex[:24]}"
        if body.stream:
            def on_error(err):
                return {"error": chosen.error(req, err).body("anthropic")["error"]}
            return StreamingResponse(stream_message(gen, body.model, msg_id, on_error),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return await whole_message(gen, request, body.model, msg_id)

    async def count_tokens(body: CountRequest, request: Request):
        images = []
        prompt = await generator.pick(body.model).prompt(GenerationRequest(
            messages=_messages(body, images), tools=_tools(body), images=images, tenant=caller_of(request).tenant(None)))
        return {"input_tokens": len(prompt)}

    for base in ("/v1/messages", "/messages"):
        app.post(base)(messages)
        app.post(f"{base}/count_tokens")(count_tokens)
