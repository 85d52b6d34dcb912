"""The OpenAI-compatible HTTP API: where a request enters.

Routes translate; the engine generates. The handlers only validate, tokenize
(in a worker thread, so a huge prompt never stalls the event loop), submit to
the ``Engine`` and format what comes back. No MLX work happens in this process.

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
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Dict, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlxpipe.server.engine import GenerationFailed, RequestStream
from mlxpipe.server.metrics import Metrics
from mlxpipe.server.scheduler import QueueFull
from mlxpipe.server.schemas import ChatCompletionRequest, CompletionRequest
from mlxpipe.server.textgen import TextChunk, sampling_params, stream_text
from mlxpipe.shards.sampling import SamplingError, validate as validate_sampling

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


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: Optional[str] = None, code: Optional[str] = None,
                   headers: Optional[Dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def _validation_message(err: RequestValidationError, content_type: str) -> Tuple[str, Optional[str]]:
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        if "json" not in content_type:
            return "send the request body as JSON, with the header Content-Type: application/json", None
        return "the request body must be a JSON object", None
    param = ".".join(loc) or None
    msg = first["msg"].removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Generation:
    """One request's n streams, their text, and their usage."""

    def __init__(self, prompt_tokens: int, streams: List[RequestStream]):
        self.prompt_tokens = prompt_tokens
        self.streams = streams
        self.completion_tokens = 0

    def cancel(self) -> None:
        for s in self.streams:
            s.cancel()

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def create_app(cluster, options: ApiOptions) -> FastAPI:
    """The FastAPI app serving ``cluster`` (a started ``Cluster``)."""
    app = FastAPI(title="mlxpipe", summary="OpenAI-compatible API over a pipeline of MLX stages")
    static = Path(__file__).parent / "static"

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(static / "index.html")

    app.mount("/static", StaticFiles(directory=static), name="static")
    tok = cluster.tokenizer
    vocab = int(cluster.model_config.get("vocab_size", 0)) or len(tok)
    names = {options.model_id, "default", *options.aliases}
    metrics = Metrics(cluster)
    cluster.engine.observer = metrics

    # Middleware added last runs first. From the outside in: counting (so 401s,
    # 413s and preflights count too), CORS (it answers preflights before the key
    # is asked for, and puts its headers on refusals), the API key, the body limit.
    app.add_middleware(BodyLimit, limit=options.max_body_bytes)

    @app.middleware("http")
    async def _api_key(request: Request, call_next):
        protected = request.url.path.startswith("/v1/") or request.url.path in ("/health", "/metrics", "/nodes")
        if options.api_key and protected:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {options.api_key}".encode()):
                return error_response(401, "this server needs an API key: send Authorization: Bearer <key>",
                                      code="invalid_api_key")
        return await call_next(request)

    if options.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(options.cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])

    @app.middleware("http")
    async def _count(request: Request, call_next):
        response = await call_next(request)
        route = request.scope.get("route")
        metrics.requests.labels(route.path if route is not None else "unmatched", str(response.status_code)).inc()
        return response

    engine = cluster.engine

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

    @app.exception_handler(Exception)
    async def _bug(request, exc: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}", type_="server_error")

    # -- helpers ------------------------------------------------------------

    def check_model(name: str) -> None:
        if name not in names:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{options.model_id}'",
                           param="model", code="model_not_found")

    def budget(req, prompt_len: int) -> int:
        context = engine.max_context
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

    retry_after = {"Retry-After": str(options.retry_after_s)}

    def unavailable(err: GenerationFailed) -> ApiError:
        return ApiError(503, str(err), type_="server_error", code="pipeline_unavailable", headers=retry_after)

    def submit(req, prompt: List[int], logprobs: bool, top_logprobs: int) -> Generation:
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}

        def sampling(i: int):
            return sampling_params(
                temperature=options.default_temperature if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0,
                min_p=req.min_p or 0.0,
                repetition_penalty=req.repetition_penalty,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                seed=None if req.seed is None else req.seed + i,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                logit_bias=bias,
            )

        try:  # the last stage's own check, here where it can still be a 400
            validate_sampling(sampling(0), vocab)
        except SamplingError as err:
            raise ApiError(400, str(err), param=err.param)
        max_tokens = budget(req, len(prompt))
        streams = []
        try:
            for i in range(req.n):
                streams.append(engine.submit(prompt, max_tokens, sampling(i)))
        except QueueFull as err:
            for s in streams:
                s.cancel()
            raise ApiError(429, f"the server is at capacity ({err}); retry shortly", type_="rate_limit_error",
                           code="server_busy", headers=retry_after)
        except GenerationFailed as err:
            raise unavailable(err)
        except ValueError as err:  # e.g. more KV cache than the stages hold
            for s in streams:
                s.cancel()
            raise ApiError(400, str(err), param="max_tokens")
        return Generation(len(prompt), streams)

    def token_text(token_id: int) -> str:
        return tok.decode([token_id])

    def token_logprob(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def chat_logprobs(chunk: TextChunk) -> dict:
        content = []
        for t in chunk.tokens:
            top = [token_logprob(i, lp) for i, lp in zip(*t.top)] if t.top else []
            content.append(token_logprob(t.id, t.logprob) | {"top_logprobs": top})
        return {"content": content}

    def completion_logprobs(chunk: TextChunk, offset: int) -> dict:
        tokens = [token_text(t.id) for t in chunk.tokens]
        offsets, pos = [], offset
        for text in tokens:
            offsets.append(pos)
            pos += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [t.logprob for t in chunk.tokens],
            "top_logprobs": [{token_text(i): lp for i, lp in zip(*t.top)} if t.top else None
                             for t in chunk.tokens],
            "text_offset": offsets,
        }

    async def chunks(gen: Generation, stops: List[str]) -> AsyncIterator[Tuple[int, TextChunk]]:
        """(choice index, chunk) from all n streams, as they come."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream):
            try:
                async for c in stream_text(tok, stream, stops):
                    await queue.put((i, c))
            except Exception as err:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, err))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(gen.streams)]
        try:
            open_ = len(tasks)
            while open_:
                i, item = await queue.get()
                if item is None:
                    open_ -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    gen.completion_tokens += len(item.tokens)
                    yield i, item
        finally:
            gen.cancel()
            for t in tasks:
                t.cancel()

    async def collect_all(request: Request, gen: Generation, stops: List[str]) -> List[List[TextChunk]]:
        """Every chunk of every choice; cancels the generation if the client goes away."""
        out: List[List[TextChunk]] = [[] for _ in gen.streams]

        async def gather():
            async for i, c in chunks(gen, stops):
                out[i].append(c)

        async def watch():
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)

        work, watcher = asyncio.ensure_future(gather()), asyncio.ensure_future(watch())
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
            work.result()
        except GenerationFailed as err:
            raise unavailable(err)
        return out

    def stream_response(gen: Generation, stops: List[str], first: List[dict], render, usage: Optional[dict]):
        """Server-sent events: ``first``, then ``render(choice, chunk)`` per chunk, an
        error event if the pipeline fails, the usage chunk when asked, ``[DONE]``."""

        async def events() -> AsyncIterator[str]:
            for obj in first:
                yield _sse(obj)
            try:
                async for i, c in chunks(gen, stops):
                    yield _sse(render(i, c))
            except GenerationFailed as err:
                yield _sse(unavailable(err).body())
                return
            if usage is not None:
                yield _sse(usage | {"choices": [], "usage": gen.usage()})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def encode(fn, *args):
        try:
            return await asyncio.to_thread(fn, *args)
        except (TypeError, ValueError, UnicodeError) as err:  # text the tokenizer cannot take
            raise ApiError(400, f"the text could not be tokenized: {err}", param="messages")

    # -- routes ---------------------------------------------------------------

    @app.get("/nodes")
    async def joined_nodes():
        from mlxpipe.server.join import joined_table

        in_plan = {st.address for st in cluster.pipeline.stages}
        return {"nodes": joined_table(cluster.joined, in_plan)}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(await metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": options.model_id, "object": "model", "created": int(time.time()), "owned_by": "mlxpipe"}]}

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
                            frames=st_.frames, tokens=st_.tokens)
                if reply.state != "ready":
                    reasons.append(f"stage {i} at {st.address} is {reply.state}: {reply.detail}")
            stages.append(info)
        body = {"status": "ok" if not reasons else "unavailable", "model": options.model_id,
                "state": engine.state, "stages": stages, "live_requests": engine.scheduler.live,
                "recoveries": engine.stats.recoveries}
        if reasons:
            body["reason"] = "; ".join(reasons)
        return JSONResponse(body, status_code=200 if not reasons else 503)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
        if tok.has_chat_template:
            prompt = await encode(lambda: tok.apply_chat_template(messages, add_generation_prompt=True))
        else:
            prompt = await encode(tok.encode, "\n".join(m["content"] for m in messages))
        top = req.top_logprobs or 0
        gen = submit(req, prompt, req.logprobs, top)
        rid, created, stops = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.stop_strings()
        base = {"id": rid, "created": created, "model": options.model_id}

        if req.stream:
            obj = dict(base, object="chat.completion.chunk")
            first = [obj | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]} for i in range(req.n)]

            def render(i, c):
                return obj | {"choices": [{"index": i, "delta": {"content": c.text} if c.text else {},
                                           "logprobs": chat_logprobs(c) if req.logprobs else None,
                                           "finish_reason": c.finish_reason}]}

            return stream_response(gen, stops, first, render, obj if req.include_usage() else None)

        out = await collect_all(request, gen, stops)
        choices = []
        for i, cs in enumerate(out):
            choice = {"index": i, "message": {"role": "assistant", "content": "".join(c.text for c in cs)},
                      "logprobs": None, "finish_reason": cs[-1].finish_reason if cs else "stop"}
            if req.logprobs:
                choice["logprobs"] = {"content": [e for c in cs for e in chat_logprobs(c)["content"]]}
            choices.append(choice)
        return dict(base, object="chat.completion", choices=choices, usage=gen.usage())

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        text = req.prompt_text()
        if text is not None:
            prompt = await encode(tok.encode, text)
        else:
            prompt = list(req.prompt)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"prompt token {bad[0]} is outside the vocabulary [0, {vocab})",
                               param="prompt")
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        top = req.logprobs or 0
        gen = submit(req, prompt, req.logprobs is not None, top)
        rid, created, stops = f"cmpl-{uuid.uuid4().hex}", int(time.time()), req.stop_strings()
        base = {"id": rid, "object": "text_completion", "created": created, "model": options.model_id}

        if req.stream:
            offsets = [0] * req.n

            def render(i, c):
                lp = completion_logprobs(c, offsets[i]) if req.logprobs is not None else None
                offsets[i] += len(c.text)
                return base | {"choices": [{"index": i, "text": c.text, "logprobs": lp,
                                            "finish_reason": c.finish_reason}]}

            return stream_response(gen, stops, [], render, base if req.include_usage() else None)

        out = await collect_all(request, gen, stops)
        choices = []
        for i, cs in enumerate(out):
            lp = None
            if req.logprobs is not None:
                parts, offset = [], 0
                for c in cs:
                    parts.append(completion_logprobs(c, offset))
                    offset += len(c.text)
                lp = {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                    "text_offset")}
            choices.append({"index": i, "text": "".join(c.text for c in cs), "logprobs": lp,
                            "finish_reason": cs[-1].finish_reason if cs else "stop"})
        return dict(base, choices=choices, usage=gen.usage())

    return app
