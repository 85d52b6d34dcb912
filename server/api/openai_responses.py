"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``):
what Codex CLI and the OpenAI Agents SDK speak. A translator only: ``input``
items become the internal request (``request.GenerationRequest``), the reply's
events become output items (reasoning, message, function calls) and the
Responses event lifecycle.

Stored responses (``store``, default true as in OpenAI's API) are kept on the
head so that ``previous_response_id`` can continue a conversation, and belong to
the API key that made them (``Store``): each key has an equal share of
``MAX_STORED`` responses and ``MAX_STORED_BYTES``, its oldest dropped first, and
another key's id is a 404 for ``GET``, ``DELETE`` and ``previous_response_id``,
word for word as an unknown id. Each is kept as compact JSON bytes of what a
continuation needs (the conversation's messages, calls and outputs as text; not
the body's other items) and the response object, so the bounds count what the
store really holds. Any model name is served by the one model. Fields
without meaning here (``reasoning``, ``include``, ``prompt_cache_key``,
``truncation``, ``service_tier``, ``user``, ``metadata``) are accepted.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from mlxpipe.server.api.errors import ApiError
from mlxpipe.server.api.generation import SSE_HEADERS, Generation, Generator
from mlxpipe.server.api.keys import caller_of
from mlxpipe.server.api.options import ApiOptions
from mlxpipe.server.api.request import GenerationRequest, image_part, request_sampling
from mlxpipe.server.api.responses_request import FunctionChoice, FunctionTool, ResponsesRequest, TextConfig
from mlxpipe.server.api.tenants import Tenant
from mlxpipe.server.core.streams import GenerationFailed, SequenceFailed

MAX_STORED = 1024
MAX_STORED_BYTES = 64 << 20


class Store:
    """Stored responses, each its owner's (the API key that made it: ``Tenant.key``):
    per owner, id -> the conversation's items and the response object, kept as compact
    JSON bytes, so the bounds count what the store really holds (a body's ignored items
    are never kept: only ``ResponsesRequest.items``). Each of ``owners`` (the server's
    keys; one without keys) has an equal share of ``max_count`` and ``max_bytes`` and
    drops its own oldest to stay inside it: one key never evicts another's. Another
    owner's id is not found, exactly as an unknown one."""

    ENTRY_OVERHEAD = 256  # bytes of an entry besides its JSON: the id, the dict's slot, the bytes object

    def __init__(self, max_count: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES, owners: int = 1):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.share_count, self.share_bytes = max(max_count // max(owners, 1), 1), max_bytes // max(owners, 1)
        self.shelves: Dict[bytes, "OrderedDict[str, bytes]"] = {}
        self.held: Dict[bytes, int] = {}  # bytes per owner
        self.nbytes = 0

    @classmethod
    def cost(cls, blob: bytes) -> int:
        return len(blob) + cls.ENTRY_OVERHEAD

    def __len__(self) -> int:
        return sum(len(shelf) for shelf in self.shelves.values())

    def put(self, owner: bytes, response: dict, conversation: list) -> None:
        blob = json.dumps([conversation, response], separators=(",", ":"), allow_nan=False).encode()
        shelf = self.shelves.setdefault(owner, OrderedDict())
        self._drop(owner, response["id"])
        shelf[response["id"]] = blob
        self._count(owner, self.cost(blob))
        while shelf and (len(shelf) > self.share_count or self.held[owner] > self.share_bytes):
            self._drop(owner, next(iter(shelf)))

    def get(self, owner: bytes, response_id: str, param: str = "previous_response_id") -> Tuple[list, dict]:
        blob = self.shelves.get(owner, {}).get(response_id)
        if blob is None:
            raise self.not_found(response_id, param)
        conversation, response = json.loads(blob)
        return conversation, response

    def delete(self, owner: bytes, response_id: str) -> None:
        if not self._drop(owner, response_id):
            raise self.not_found(response_id, "response_id")

    @staticmethod
    def not_found(response_id: str, param: str) -> ApiError:
        return ApiError(404, f"Response with id '{response_id}' not found.", param=param, code="not_found")

    def _drop(self, owner: bytes, response_id: str) -> bool:
        blob = self.shelves.get(owner, {}).pop(response_id, None)
        if blob is not None:
            self._count(owner, -self.cost(blob))
        return blob is not None

    def _count(self, owner: bytes, nbytes: int) -> None:
        self.held[owner] = self.held.get(owner, 0) + nbytes
        self.nbytes += nbytes


def _pictured(content, images: list, param: str):
    """Compact content as a chat message holds it: its image parts' refs appended to ``images``."""
    if not isinstance(content, list):
        return content
    return [image_part(images, p["url"], f"{param}.content.{j}") if p["type"] == "image" else p
            for j, p in enumerate(content)]


def _messages(items: List[Dict[str, Any]], images: list) -> List[Dict[str, Any]]:
    """Compact items (``ResponsesRequest.items``, outputs) as OpenAI chat messages; their images
    become image parts, their refs appended to ``images``."""
    out: List[Dict[str, Any]] = []
    for k, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            out.append({"role": {"developer": "system"}.get(item["role"], item["role"]),
                        "content": _pictured(item["content"], images, f"input.{k}")})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"] or "{}"}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("content") in (None, ""):
                out[-1].setdefault("tool_calls", []).append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _pictured(item["output"], images, f"input.{k}")})
    return out


def _output_items(output: List[dict]) -> List[dict]:
    """A stored response's output items in the compact form the conversation keeps."""
    out = []
    for o in output:
        if o["type"] == "message":
            out.append({"type": "message", "role": "assistant",
                        "content": "".join(c.get("text", "") for c in o["content"])})
        elif o["type"] == "function_call":
            out.append({"type": "function_call", "call_id": o["call_id"], "name": o["name"],
                        "arguments": o["arguments"]})
    return out


def _tool_choice(choice):
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(text: Optional[TextConfig]):
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                   "strict": fmt.strict}}


def to_request(req: ResponsesRequest, history: list, options: ApiOptions,
               tenant: Tenant) -> Tuple[GenerationRequest, list]:
    """The internal request, and the conversation's items (to store)."""
    conversation, images = history + req.items(), []
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + _messages(
        conversation, images)
    functions = [t.function() for t in req.tools or [] if isinstance(t, FunctionTool)]
    sampling = request_sampling(options, temperature=req.temperature, top_p=req.top_p)
    return GenerationRequest(
        messages=messages, tools=functions or None, sampling=sampling, max_tokens=req.max_output_tokens,
        response_format=_response_format(req.text),
        tool_choice=_tool_choice(req.tool_choice) if functions else None,
        parallel_tool_calls=req.parallel_tool_calls, tenant=tenant, prompt_param="input",
        images=images, priority=req.priority, service_tier=req.service_tier), conversation


def _echo(value):
    """A validated part of the request as the response object echoes it."""
    return value.model_dump(by_alias=True, exclude_none=True) if isinstance(value, BaseModel) else value


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
                    "store": req.store, "temperature": gen.req.sampling.temperature,  # what was used, as OpenAI's
                    "text": _echo(req.text) or {"format": {"type": "text"}},
                    "tool_choice": _echo(req.tool_choice) or "auto", "tools": [_echo(t) for t in req.tools or []],
                    "top_p": gen.req.sampling.top_p,
                    "truncation": "disabled", "usage": None, "metadata": req.metadata or {}}

    def finish(self, finish: Optional[str]) -> dict:
        u = self.gen.usage()
        self.obj["usage"] = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                             "cached_tokens_by_tier": u.by_tier(),
                             "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": u.prompt_tokens + u.completion_tokens}
        if finish == "length":  # the item being written when the budget ran out is incomplete too
            self.obj["status"], self.obj["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            if self.obj["output"] and "status" in self.obj["output"][-1]:
                self.obj["output"][-1]["status"] = "incomplete"
        else:
            self.obj["status"] = "completed"
        return self.obj


def _reasoning(text: str) -> dict:
    return {"type": "reasoning", "id": _id("rs"), "summary": [{"type": "summary_text", "text": text}]}


def _message(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call(c: dict) -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": c.get("id") or _id("call"),
            "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}


async def whole(resp: _Response, request: Request) -> dict:
    choice = (await resp.gen.until_done(request))[0]
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

    def close(self, status: str = "completed") -> List[str]:
        item, text, out = self.item, self.text, []
        if item is None:
            return out
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            out += [self.event("response.output_text.done", **self._where(), content_index=0, text=text, logprobs=[]),
                    self.event("response.content_part.done", **self._where(), content_index=0, part=part)]
            item = _message(text, status) | {"id": item["id"]}
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
                for e in ev.close("incomplete" if p.finish_reason == "length" else "completed"):
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
    store = Store(owners=len(options.api_keys))

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        tenant = caller_of(request).tenant(body.cache_salt)
        history = []
        if body.previous_response_id:
            items, previous = store.get(tenant.key, body.previous_response_id)
            history = items + _output_items(previous["output"])
        req, conversation = to_request(body, history, options, tenant)
        chosen = generator.pick(body.model)  # another model the head serves, by name; else the pipeline's
        resp = _Response(body, await chosen.start(req))

        def stored(obj: dict) -> None:
            if body.store:
                store.put(tenant.key, obj, conversation)

        if body.stream:
            return StreamingResponse(stream(resp, lambda e: chosen.error(req, e).body()["error"], stored),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        obj = await whole(resp, request)
        stored(obj)
        return obj

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request):
        return store.get(caller_of(request).identity, response_id, param="response_id")[1]

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request):
        store.delete(caller_of(request).identity, response_id)
        return {"id": response_id, "object": "response", "deleted": True}
