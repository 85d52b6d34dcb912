"""OpenAI's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``):
what Codex CLI and the OpenAI Agents SDK speak. A translator only: ``input``
items become the internal request (``request.GenerationRequest``), the reply's
events become output items (reasoning, message, function calls) and the
Responses event lifecycle.

Stored responses (``store``, default true as in OpenAI's API) are kept on the
head so that ``previous_response_id`` can continue a conversation: at most
``MAX_STORED`` of them and ``MAX_STORED_BYTES`` in all, the oldest dropped first;
an unknown id is a 404. Any model name is served by the one model. Fields
without meaning here (``reasoning``, ``include``, ``prompt_cache_key``,
``truncation``, ``service_tier``, ``user``, ``metadata``) are accepted.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple, Union

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from mlxpipe.server.api.errors import ApiError
from mlxpipe.server.api.generation import SSE_HEADERS, Generation, Generator
from mlxpipe.server.api.request import GenerationRequest
from mlxpipe.server.cluster.config import ApiOptions
from mlxpipe.server.core.streams import GenerationFailed, SequenceFailed
from mlxpipe.shards.sampling import Sampling

MAX_STORED = 1024
MAX_STORED_BYTES = 64 << 20
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
NOT_TEXT = ("input_image", "input_file", "input_audio")


class ResponsesRequest(BaseModel):
    """The Responses API's request body; fields not listed are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: Union[str, List[Dict[str, Any]]] = Field(min_length=1)
    instructions: Optional[str] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    parallel_tool_calls: StrictBool = True
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    text: Optional[Dict[str, Any]] = None
    store: StrictBool = True
    previous_response_id: Optional[str] = None
    stream: StrictBool = False
    metadata: Optional[Dict[str, Any]] = None
    reasoning: Optional[Dict[str, Any]] = None


class Store:
    """Stored responses: id -> (the conversation's items, the response object), bounded."""

    def __init__(self, max_count: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.items: "OrderedDict[str, Tuple[list, dict, int]]" = OrderedDict()
        self.max_count, self.max_bytes, self.nbytes = max_count, max_bytes, 0

    def put(self, response: dict, conversation: list) -> None:
        size = len(json.dumps([conversation, response]))
        self.items[response["id"]] = (conversation, response, size)
        self.nbytes += size
        while self.items and (len(self.items) > self.max_count or self.nbytes > self.max_bytes):
            _, (_, _, dropped) = self.items.popitem(last=False)
            self.nbytes -= dropped

    def get(self, response_id: str) -> Tuple[list, dict]:
        if response_id not in self.items:
            raise ApiError(404, f"Response with id '{response_id}' not found.", param="previous_response_id",
                           code="not_found")
        conversation, response, _ = self.items[response_id]
        return conversation, response


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content or []):
        kind = part.get("type")
        if kind in NOT_TEXT:
            raise ApiError(400, f"{where}.{j}: {kind} parts are not supported: this model takes text only",
                           param="input")
        if kind in TEXT_PARTS:
            parts.append(part.get("text") or "")
    return "".join(parts)


def _messages(items: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Input items (messages, function calls and their outputs) as OpenAI chat messages."""
    out: List[Dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise ApiError(400, f"input.{i}.role must be user, assistant, system or developer", param="input")
            out.append({"role": role, "content": _content(item.get("content"), f"input.{i}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id") or "", "type": "function",
                    "function": {"name": item.get("name") or "", "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("content") in (None, ""):
                out[-1].setdefault("tool_calls", []).append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id") or "",
                        "content": output if isinstance(output, str) else _content(output, f"input.{i}.output")})
        # reasoning items (the model's own), item references and server tools' items: nothing to show it
    return out


def _tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise ApiError(400, "tool_choice names a tool that is not a function (only function tools are served)",
                           param="tool_choice")
        return {"type": "function", "function": {"name": choice.get("name", "")}}
    return choice


def _response_format(text: Optional[Dict[str, Any]]):
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": fmt.get("schema"),
                                                  "strict": fmt.get("strict")}}


def to_request(req: ResponsesRequest, history: list, options: ApiOptions) -> Tuple[GenerationRequest, list]:
    """The internal request, and the conversation's items (to store)."""
    items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    conversation = history + items
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + _messages(conversation)
    functions = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if t.get(k) is not None}}
                 for t in req.tools or [] if t.get("type") == "function"]
    sampling = Sampling(temperature=options.default_temperature if req.temperature is None else req.temperature,
                        top_p=1.0 if req.top_p is None else req.top_p)
    return GenerationRequest(
        messages=messages, tools=functions or None, sampling=sampling, max_tokens=req.max_output_tokens,
        response_format=_response_format(req.text),
        tool_choice=_tool_choice(req.tool_choice) if functions else None,
        parallel_tool_calls=req.parallel_tool_calls), conversation


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Response:
    """One response object, built as the reply streams."""

    def __init__(self, req: ResponsesRequest, gen: Generation):
        self.req, self.gen = req, gen
        self.obj = {"id": _id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
                    "error": None, "incomplete_details": None, "instructions": req.instructions,
                    "max_output_tokens": req.max_output_tokens, "model": req.model, "output": [],
                    "parallel_tool_calls": req.parallel_tool_calls,
                    "previous_response_id": req.previous_response_id, "reasoning": req.reasoning or {},
                    "store": req.store, "temperature": req.temperature, "text": req.text or {"format": {"type": "text"}},
                    "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": req.top_p,
                    "truncation": "disabled", "usage": None, "metadata": req.metadata or {}}

    def finish(self, finish: Optional[str]) -> dict:
        u = self.gen.usage()
        self.obj["usage"] = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                             "cached_tokens_by_tier": u.by_tier(),
                             "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": u.prompt_tokens + u.completion_tokens}
        if finish == "length":
            self.obj["status"], self.obj["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.obj["status"] = "completed"
        return self.obj


def _reasoning(text: str) -> dict:
    return {"type": "reasoning", "id": _id("rs"), "summary": [{"type": "summary_text", "text": text}]}


def _message(text: str) -> dict:
    return {"type": "message", "id": _id("msg"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call(c: dict) -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": c.get("id") or _id("call"),
            "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}


async def whole(resp: _Response, request: Request) -> dict:
    choice = (await resp.gen.until_done(request.is_disconnected))[0]
    d = choice.delta
    calls = [_call(c) for c in d.tool_calls]
    resp.obj["output"] = ([_reasoning(d.reasoning)] if d.reasoning else []) + (
        [_message(d.content)] if d.content or not calls else []) + calls
    return resp.finish(choice.finish_reason)


class _Events:
    """The Responses event lifecycle of one reply: items opened, filled and closed in
    order, each event numbered."""

    def __init__(self, resp: _Response):
        self.resp, self.seq, self.item, self.text = resp, 0, None, ""

    def event(self, kind: str, **body) -> str:
        body = {"type": kind, "sequence_number": self.seq, **body}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    @property
    def index(self) -> int:
        return len(self.resp.obj["output"])

    def _where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": self.index}

    def close(self) -> List[str]:
        item, text, out = self.item, self.text, []
        if item is None:
            return out
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            out += [self.event("response.output_text.done", **self._where(), content_index=0, text=text, logprobs=[]),
                    self.event("response.content_part.done", **self._where(), content_index=0, part=part)]
            item = _message(text) | {"id": item["id"]}
        else:
            part = {"type": "summary_text", "text": text}
            out += [self.event("response.reasoning_summary_text.done", **self._where(), summary_index=0, text=text),
                    self.event("response.reasoning_summary_part.done", **self._where(), summary_index=0, part=part)]
            item = _reasoning(text) | {"id": item["id"]}
        out.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.resp.obj["output"].append(item)
        self.item, self.text = None, ""
        return out

    def _open(self, kind: str) -> List[str]:
        if self.item is not None and self.item["type"] == kind:
            return []
        out = self.close()
        if kind == "message":
            self.item = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant",
                         "content": []}
            out.append(self.event("response.output_item.added", output_index=self.index, item=self.item))
            out.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": []}))
        else:
            self.item = {"type": "reasoning", "id": _id("rs"), "summary": []}
            out.append(self.event("response.output_item.added", output_index=self.index, item=self.item))
            out.append(self.event("response.reasoning_summary_part.added", **self._where(), summary_index=0,
                                  part={"type": "summary_text", "text": ""}))
        return out

    def piece(self, p) -> List[str]:
        out = []
        if p.delta.reasoning:
            out += self._open("reasoning")
            self.text += p.delta.reasoning
            out.append(self.event("response.reasoning_summary_text.delta", **self._where(), summary_index=0,
                                  delta=p.delta.reasoning))
        if p.delta.content:
            out += self._open("message")
            self.text += p.delta.content
            out.append(self.event("response.output_text.delta", **self._where(), content_index=0,
                                  delta=p.delta.content, logprobs=[]))
        for c in p.delta.tool_calls:
            out += self.close()
            item = _call(c)
            where = {"item_id": item["id"], "output_index": self.index}
            out += [self.event("response.output_item.added", output_index=self.index,
                               item=dict(item, arguments="", status="in_progress")),
                    self.event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=self.index, item=item)]
            self.resp.obj["output"].append(item)
        return out


async def stream(resp: _Response, on_error, stored) -> AsyncIterator[str]:
    ev = _Events(resp)
    yield ev.event("response.created", response=dict(resp.obj))
    yield ev.event("response.in_progress", response=dict(resp.obj))
    try:
        async for p in resp.gen.events():
            for e in ev.piece(p):
                yield e
            if p.finish_reason is not None:
                for e in ev.close():
                    yield e
                obj = resp.finish(p.finish_reason)
                stored(obj)
                kind = "response.incomplete" if obj["status"] == "incomplete" else "response.completed"
                yield ev.event(kind, response=obj)
    except (GenerationFailed, SequenceFailed) as err:
        error = on_error(err)
        yield ev.event("error", code=error["code"], message=error["message"], param=error["param"])
        resp.obj.update(status="failed", error={"code": error["code"] or "server_error", "message": error["message"]})
        yield ev.event("response.failed", response=resp.obj)


def add_routes(app: FastAPI, generator: Generator, options: ApiOptions) -> None:
    store = Store()

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        history = []
        if body.previous_response_id:
            items, previous = store.get(body.previous_response_id)
            history = items + [dict(o) for o in previous["output"]]
        req, conversation = to_request(body, history, options)
        resp = _Response(body, await generator.start(req))

        def stored(obj: dict) -> None:
            if body.store:
                store.put(obj, conversation)

        if body.stream:
            return StreamingResponse(stream(resp, lambda e: generator.error(req, e).body()["error"], stored),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        obj = await whole(resp, request)
        stored(obj)
        return obj

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        try:
            return store.get(response_id)[1]
        except ApiError as err:
            raise ApiError(404, err.message, param="response_id", code="not_found") from None
