"""The OpenAI-compatible HTTP API: where a request enters.

Routes translate; the engine generates. A route validates (``schemas.py``),
tokenizes (in a worker thread, so a huge prompt never stalls the event loop),
submits to the ``Engine`` and hands the streams to ``completions.py``, which
formats what comes back. No MLX work happens in this process.

Errors always have OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, with a 4xx status for anything the client can fix: bad input never
gets a 5xx.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlxpipe.server import anthropic_api, ollama_api, responses_api
from mlxpipe.server.completions import ChatFormat, Generation, TextFormat, events
from mlxpipe.server.errors import ApiError, error_response
from mlxpipe.server.join import joined_table
from mlxpipe.server.metrics import Metrics
from mlxpipe.server.schemas import ChatCompletionRequest, CompletionRequest
from mlxpipe.server.turns import SSE_HEADERS, Turns

logger = logging.getLogger(__name__)


# What the 404 for an unknown path lists.
SERVED = ("POST /v1/chat/completions, POST /v1/completions, GET /v1/models (OpenAI); POST /v1/responses, "
          "GET /v1/responses/{id} (OpenAI Responses); POST /v1/messages, POST /v1/messages/count_tokens "
          "(Anthropic); POST /api/chat, POST /api/generate, GET /api/tags, POST /api/show, GET /api/ps, "
          "GET /api/version (Ollama); GET /health, GET /metrics, GET / (the web page)")


@dataclass
class ApiOptions:
    model_id: str                      # the name /v1/models lists
    aliases: Tuple[str, ...] = ()      # other names accepted in `model`
    default_max_tokens: int = 512      # when a request gives none (capped by the context)
    default_temperature: float = 1.0   # OpenAI's default
    retry_after_s: int = 2             # told to clients refused for load
    api_key: Optional[str] = None      # when set, /v1/* and /health need "Authorization: Bearer <key>"
    cors_origins: Tuple[str, ...] = () # origins browsers may call from (none: no CORS headers)
    max_body_bytes: int = 4 << 20      # larger request bodies get 413
    max_prompt_tokens: Optional[int] = None  # default: the model's context
    max_tokens_limit: Optional[int] = None   # largest max_tokens a request may ask (default: the context)


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``limit`` bytes with 413, by
    Content-Length or while they stream in, before anything parses them."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._refuse(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send):
        response = error_response(413, f"the request body is larger than {self.limit} bytes",
                                  code="request_too_large", path=scope.get("path", ""))
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def _validation_message(err: RequestValidationError, content_type: str) -> Tuple[str, Optional[str]]:
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    if not loc and first.get("type") == "missing":
        return "the request body is empty: send a JSON object", None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        if "json" not in content_type:
            return "send the request body as JSON, with the header Content-Type: application/json", None
        return "the request body must be a JSON object", None
    param = ".".join(loc) or None
    msg = first["msg"].removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


class Outcomes:
    """ASGI middleware, the outermost of ours: counts every response by route and
    status, and answers what a route let escape. (A middleware built on
    ``call_next`` sees no response for an exception, so 5xx went uncounted.)
    While the pipeline is recovering, routes fail because its channels close
    under them: that is a 503 with the reason, as for a request that waits too
    long for the recovery; anything else is a bug, logged, and a 500."""

    def __init__(self, app, metrics: Metrics, engine, retry_after_s: int):
        self.app, self.metrics, self.engine, self.retry_after_s = app, metrics, engine, retry_after_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None

        async def watched(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            if status is not None:  # mid-response (a stream): too late to answer; count what was sent
                self._count(scope, status)
                raise
            await self._failure(scope.get("path", ""))(scope, receive, watched)
        self._count(scope, status)

    def _failure(self, path: str) -> JSONResponse:
        if self.engine.state != "ready":
            return error_response(503, f"pipeline {self.engine.state}: {self.engine.failure}", type_="server_error",
                                  code="pipeline_unavailable", headers={"Retry-After": str(self.retry_after_s)},
                                  path=path)
        logger.exception("unhandled error")
        return error_response(500, "internal error", type_="server_error", path=path)

    def _count(self, scope, status: Optional[int]) -> None:
        route = scope.get("route")  # set by the router on the shared scope
        self.metrics.requests.labels(route.path if route is not None else "unmatched", str(status or 500)).inc()


class ApiKey:
    """ASGI middleware: every API (/v1/*, Anthropic's /messages, Ollama's /api/*),
    /health, /metrics and /nodes need the API key, when one is set: as
    ``Authorization: Bearer <key>`` or (Anthropic's SDKs) ``x-api-key: <key>``."""

    PROTECTED = ("/health", "/metrics", "/nodes")

    def __init__(self, app, key: str):
        self.app, self.bearer, self.key = app, f"Bearer {key}".encode(), key.encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith(("/v1/", "/api/", "/messages")) or path in self.PROTECTED):
            headers = dict(scope.get("headers") or [])
            if not (hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
                    or hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)):
                response = error_response(401, "this server needs an API key: send Authorization: Bearer <key> "
                                               "(or x-api-key: <key>)", code="invalid_api_key", path=path)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def _add_middleware(app: FastAPI, options: ApiOptions, metrics: Metrics, engine) -> None:
    """Middleware added last runs first. From the outside in: outcomes (so 401s,
    413s, preflights and failures count too), CORS (it answers preflights before
    the key is asked for, and puts its headers on refusals), the API key, the
    body limit. All plain ASGI: none buffers or re-wraps a response."""
    app.add_middleware(BodyLimit, limit=options.max_body_bytes)
    if options.api_key:
        app.add_middleware(ApiKey, key=options.api_key)
    if options.cors_origins:
        # Any request header: browser SDKs send their own (the OpenAI JS SDK's x-stainless-*),
        # and the origin is what CORS guards. Retry-After is read by SDKs that back off.
        app.add_middleware(CORSMiddleware, allow_origins=list(options.cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"], expose_headers=["Retry-After"])
    app.add_middleware(Outcomes, metrics=metrics, engine=engine, retry_after_s=options.retry_after_s)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape; bad input never gets a 5xx (and what no
    handler here takes, Outcomes answers)."""

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers,
                              path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        message, param = _validation_message(exc, request.headers.get("content-type", ""))
        return error_response(400, message, param=param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        detail = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "the request body could not be read as JSON (malformed, or nested too deeply)"
        if exc.status_code in (404, 405) and detail in ("Not Found", "Method Not Allowed"):
            detail = (f"{request.method} {request.url.path} is not served here. This server serves: "
                      f"{SERVED}")
        return error_response(exc.status_code, detail, code="not_found" if exc.status_code == 404 else None,
                              path=request.url.path)


def create_app(cluster, options: ApiOptions, metrics: Optional[Metrics] = None) -> FastAPI:
    """The FastAPI app serving ``cluster`` (a started ``Cluster``); ``metrics``: the
    observer its engine was given, if any."""
    app = FastAPI(title="mlxpipe", summary="OpenAI-compatible API over a pipeline of MLX stages")
    metrics = metrics or Metrics()
    engine = cluster.engine
    static = Path(__file__).parent / "static"
    app.mount("/static", StaticFiles(directory=static), name="static")
    _add_middleware(app, options, metrics, engine)
    _add_error_handlers(app)
    turns = Turns(cluster, options)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # HEAD: agents' connectivity check
    async def index():
        return FileResponse(static / "index.html")

    @app.get("/nodes")
    async def joined_nodes():
        in_plan = {st.address for st in cluster.pipeline.stages}
        return {"nodes": joined_table(cluster.joined, in_plan)}

    @app.get("/metrics")
    async def prometheus_metrics():
        health = await cluster.pipeline.health(timeout=2.0)
        return Response(metrics.render(health, engine.scheduler.live, engine.stats.recoveries,
                                         engine.scheduler.drafts, budget=cluster.pipeline.budget),
                        media_type=CONTENT_TYPE_LATEST)

    card = {"id": options.model_id, "object": "model", "created": int(time.time()), "owned_by": "mlxpipe"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")  # ":path": repo ids ("org/name") hold a slash
    async def model(name: str):
        turns.check_model(name)
        return card

    @app.get("/health")
    async def health():
        reasons = []
        if engine.state != "ready":
            reasons.append(f"pipeline {engine.state}: {engine.failure}")
        stages = []
        for i, (st, reply, err) in enumerate(await cluster.pipeline.health()):
            info = {"stage": i, "address": st.address, "layers": [st.start, st.end]}
            if st.load is not None and st.load.memory_warning:  # close to what the Mac's GPU may wire
                info["memory_warning"] = st.load.memory_warning
            if reply is None:
                info["state"] = "unreachable"
                reasons.append(f"stage {i} at {st.address} is unreachable: {err}")
            else:
                st_ = reply.stats
                info.update(state=reply.state, live_sequences=len(reply.live_seqs),
                            weight_bytes=reply.weight_bytes, cache_bytes=reply.cache_bytes,
                            busy_seconds=st_.busy_seconds, uptime_seconds=st_.uptime_seconds,
                            busy_fraction=st_.busy_fraction,
                            tokens_per_s=st_.tokens_per_s, queue_depth=st_.queue_depth,
                            frames=st_.frames, tokens=st_.tokens,
                            prefix_cache_bytes=reply.prefix_bytes, prefix_cache_blocks=reply.prefix_blocks,
                            prefix_hit_rate=st_.reused_tokens / max(st_.reused_tokens + st_.prefilled_tokens, 1))
                if reply.state != "ready":
                    reasons.append(f"stage {i} at {st.address} is {reply.state}: {reply.detail}")
            stages.append(info)
        body = {"status": "ok" if not reasons else "unavailable", "model": options.model_id,
                "state": engine.state, "stages": stages, "live_requests": engine.scheduler.live,
                "recoveries": engine.stats.recoveries, "generated_tokens": engine.stats.generated_tokens,
                "speculation": engine.speculation()}
        if reasons:
            body["reason"] = "; ".join(reasons)
        return JSONResponse(body, status_code=200 if not reasons else 503)

    async def respond(request: Request, req, gen: Generation, fmt):
        """Server-sent events, or the whole response once every choice is done."""
        if req.stream:
            return StreamingResponse(events(gen, fmt, req.include_usage(), lambda e: turns.error(req, e).body()),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return fmt.response(await turns.whole(request, req, gen, gen.collect()), gen.usage())

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        turns.check_model(req.model)
        turn = await turns.chat(req)
        return await respond(request, req, turn.gen, ChatFormat(turns.tok, options.model_id, req.logprobs,
                                                                turn.replies))

    @app.post("/v1/completions")
    async def text_completions(req: CompletionRequest, request: Request):
        turns.check_model(req.model)
        tok = cluster.tokenizer
        text = req.prompt_text()
        if text is not None:
            prompt = await turns.encode(tok.encode, text)
        else:
            prompt = list(req.prompt)
            bad = [t for t in prompt if not 0 <= t < turns.vocab]
            if bad:
                raise ApiError(400, f"prompt token {bad[0]} is outside the vocabulary [0, {turns.vocab})",
                               param="prompt")
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        gen = turns.submit(req, prompt)
        return await respond(request, req, gen, TextFormat(tok, options.model_id, req.logprobs is not None, req.n))

    for protocol in (anthropic_api, responses_api, ollama_api):
        protocol.add_routes(app, turns, cluster)
    return app
