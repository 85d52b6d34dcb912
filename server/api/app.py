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
from dataclasses import dataclass, replace
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

from mlxpipe.server.api.chat_template import Reply, render, thinks_first
from mlxpipe.server.api.openai_objects import ChatFormat, Generation, TextFormat, events
from mlxpipe.server.core.streams import GenerationFailed, SequenceFailed
from mlxpipe.server.cluster.join import joined_table
from mlxpipe.server.api.metrics import Metrics
from mlxpipe.server.core.sequence import QueueFull
from mlxpipe.server.api.schemas import ChatCompletionRequest, CompletionRequest
from mlxpipe.server.api.structured import (GrammarError, Grammars, forced_functions, response_format_grammar,
                                       tool_call_grammar)
from mlxpipe.shards.grammar import in_worker
from mlxpipe.shards.sampling import SamplingError

logger = logging.getLogger(__name__)


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
                                  code="request_too_large")
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error shape: in a response, or as a stream's last event."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: a message may echo what the
    client sent, and a lone surrogate ("\\ud800") cannot be encoded as UTF-8,
    but it can be written back as the same escape."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: Optional[str] = None, code: Optional[str] = None,
                   headers: Optional[Dict[str, str]] = None) -> JSONResponse:
    return AsciiJSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


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
            await self._failure()(scope, receive, watched)
        self._count(scope, status)

    def _failure(self) -> JSONResponse:
        if self.engine.state != "ready":
            return error_response(503, f"pipeline {self.engine.state}: {self.engine.failure}", type_="server_error",
                                  code="pipeline_unavailable", headers={"Retry-After": str(self.retry_after_s)})
        logger.exception("unhandled error")
        return error_response(500, "internal error", type_="server_error")

    def _count(self, scope, status: Optional[int]) -> None:
        route = scope.get("route")  # set by the router on the shared scope
        self.metrics.requests.labels(route.path if route is not None else "unmatched", str(status or 500)).inc()


class ApiKey:
    """ASGI middleware: /v1/*, /health, /metrics and /nodes need the API key, when one is set."""

    PROTECTED = ("/health", "/metrics", "/nodes")

    def __init__(self, app, key: str):
        self.app, self.want = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1/") or path in self.PROTECTED):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.want):
                response = error_response(401, "this server needs an API key: send Authorization: Bearer <key>",
                                          code="invalid_api_key")
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
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        message, param = _validation_message(exc, request.headers.get("content-type", ""))
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        detail = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "the request body could not be read as JSON (malformed, or nested too deeply)"
        return error_response(exc.status_code, detail, code=None)


class _Completions:
    """What the two completion routes share: from a validated request to a
    ``Generation`` on the engine, and from the generation to a response."""

    def __init__(self, cluster, options: ApiOptions):
        self.options = options
        self.engine = cluster.engine
        self.tok = cluster.tokenizer
        self.vocab = cluster.vocab_size
        self.names = {options.model_id, "default", *options.aliases}
        self.retry_after = {"Retry-After": str(options.retry_after_s)}
        self.grammars = Grammars(cluster.tokenizer, self.vocab)

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves "
                                f"'{self.options.model_id}'", param="model", code="model_not_found")

    def budget(self, req, prompt_len: int) -> int:
        """The request's token budget, or a 400 saying what to change."""
        options, context = self.options, self.engine.max_context
        if options.max_prompt_tokens and prompt_len > options.max_prompt_tokens:
            raise ApiError(400, f"the prompt is {prompt_len} tokens; this server takes at most "
                                f"{options.max_prompt_tokens}", param="messages", code="prompt_too_long")
        limit = options.max_tokens_limit
        if limit and (req.token_budget() or 0) > limit:
            raise ApiError(400, f"max_tokens is {req.token_budget()}; this server allows at most {limit}",
                           param="max_tokens")
        if prompt_len >= context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens. However, your "
                                f"prompt is {prompt_len} tokens. Please shorten it.",
                           param="messages", code="context_length_exceeded")
        asked = req.token_budget()
        if asked is None:
            return min(options.default_max_tokens, limit or context, context - prompt_len)
        if prompt_len + asked > context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you "
                                f"requested {prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} "
                                f"for the completion). Please reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        return asked

    def unavailable(self, err: GenerationFailed) -> ApiError:
        return ApiError(503, str(err), type_="server_error", code="pipeline_unavailable",
                        headers=self.retry_after)

    @staticmethod
    def failed(req, err: SequenceFailed) -> ApiError:
        """This request's own failure on a stage (its grammar, its sampling): a 400 naming
        what the request asked; no other request noticed."""
        param = None
        if getattr(req, "response_format", None) is not None:
            param = "response_format"
        if getattr(req, "tool_choice", None) not in (None, "auto", "none"):
            param = "tool_choice"
        return ApiError(400, f"generation failed for this request: {err}", param=param, code="generation_failed")

    def error_event(self, req, err: Exception) -> dict:
        """The last event of a stream that failed."""
        return (self.failed(req, err) if isinstance(err, SequenceFailed) else self.unavailable(err)).body()

    async def encode(self, fn, *args) -> List[int]:
        try:
            return await asyncio.to_thread(fn, *args)
        except (TypeError, ValueError, UnicodeError, TemplateError) as err:  # what the template or tokenizer refuse
            raise ApiError(400, f"the messages could not be rendered and tokenized: {err}", param="messages")

    async def grammar(self, req: ChatCompletionRequest) -> str:
        """The grammar the request's output must follow ("" for none), or a 400. Built,
        compiled and checked on the grammar thread (a deep stack, off the event loop)."""
        forced = req.choice() not in (None, "auto", "none")
        param = "tool_choice" if forced else "response_format"

        def build() -> str:
            functions = forced_functions(req.tool_dicts() or [], req.choice())
            if functions is not None:
                grammar = tool_call_grammar(self.tok, functions, req.parallel_tool_calls)
            else:
                grammar = response_format_grammar(req.response_format.as_dict() if req.response_format else None)
            return self.grammars.check(grammar)

        try:
            return await in_worker(build)
        except GrammarError as err:
            raise ApiError(400, f"{param} cannot be enforced: {err}", param=param)

    def submit(self, req, prompt: List[int], grammar: str = "") -> Generation:
        """The request's n streams on the engine; ``grammar``: what their output must follow."""
        def sampling(choice: int = 0):
            return replace(req.sampling(self.options.default_temperature, choice), grammar=grammar)

        try:  # the last stage's own check, here where it can still be a 400
            sampling().validate(self.vocab)
        except SamplingError as err:
            raise ApiError(400, str(err), param=err.param)
        try:
            self.engine.check_speculation(req.speculation)
        except ValueError as err:
            raise ApiError(400, str(err), param="speculation")
        max_tokens = self.budget(req, len(prompt))
        streams = []
        try:
            for i in range(req.n):
                streams.append(self.engine.submit(prompt, max_tokens, sampling(i), speculation=req.speculation,
                                                  max_drafts=req.num_draft_tokens))
        except QueueFull as err:
            for s in streams:
                s.cancel()
            raise ApiError(429, f"the server is at capacity ({err}); retry shortly", type_="rate_limit_error",
                           code="server_busy", headers=self.retry_after)
        except GenerationFailed as err:
            raise self.unavailable(err)
        except ValueError as err:  # e.g. more KV cache than the stages hold
            for s in streams:
                s.cancel()
            raise ApiError(400, str(err), param="max_tokens")
        return Generation(self.tok, len(prompt), streams, req.stop_strings())

    async def respond(self, request: Request, req, gen: Generation, fmt):
        """Server-sent events, or the whole response once every choice is done
        (cancelled if the client goes away first)."""
        if req.stream:
            return StreamingResponse(events(gen, fmt, req.include_usage(), lambda e: self.error_event(req, e)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def watch():
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)

        work, watcher = asyncio.ensure_future(gen.collect()), asyncio.ensure_future(watch())
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
                gen.cancel()
        if work not in done:
            raise ApiError(499, "client closed the request")
        try:
            out = work.result()
        except GenerationFailed as err:
            raise self.unavailable(err)
        except SequenceFailed as err:
            raise self.failed(req, err)
        return fmt.response(out, gen.usage())


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
    completions = _Completions(cluster, options)

    @app.get("/", include_in_schema=False)
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
                                         engine.scheduler.drafts),
                        media_type=CONTENT_TYPE_LATEST)

    card = {"id": options.model_id, "object": "model", "created": int(time.time()), "owned_by": "mlxpipe"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")  # ":path": repo ids ("org/name") hold a slash
    async def model(name: str):
        completions.check_model(name)
        return card

    @app.get("/health")
    async def health():
        reasons = []
        if engine.state != "ready":
            reasons.append(f"pipeline {engine.state}: {engine.failure}")
        stages = []
        for i, (st, reply, err) in enumerate(await cluster.pipeline.health()):
            info = {"stage": i, "address": st.address, "layers": [st.start, st.end]}
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
                "recoveries": engine.stats.recoveries, "speculation": engine.speculation()}
        if reasons:
            body["reason"] = "; ".join(reasons)
        return JSONResponse(body, status_code=200 if not reasons else 503)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        completions.check_model(req.model)
        tok, tools = cluster.tokenizer, req.tool_dicts()
        prompt = await completions.encode(render, tok, [m.for_template() for m in req.messages], tools,
                                          req.chat_template_kwargs or {})
        grammar = await completions.grammar(req)
        gen = completions.submit(req, prompt, grammar)
        thinking = thinks_first(tok, prompt) and not grammar  # a grammar leaves no room to think
        replies = [Reply(tok, tools, thinking, req.parallel_tool_calls, req.stream) for _ in range(req.n)]
        return await completions.respond(request, req, gen, ChatFormat(tok, options.model_id, req.logprobs, replies))

    @app.post("/v1/completions")
    async def text_completions(req: CompletionRequest, request: Request):
        completions.check_model(req.model)
        tok = cluster.tokenizer
        text = req.prompt_text()
        if text is not None:
            prompt = await completions.encode(tok.encode, text)
        else:
            prompt = list(req.prompt)
            bad = [t for t in prompt if not 0 <= t < completions.vocab]
            if bad:
                raise ApiError(400, f"prompt token {bad[0]} is outside the vocabulary [0, {completions.vocab})",
                               param="prompt")
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        gen = completions.submit(req, prompt)
        fmt = TextFormat(tok, options.model_id, req.logprobs is not None, req.n)
        return await completions.respond(request, req, gen, fmt)

    return app
