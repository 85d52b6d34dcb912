"""The API's ASGI middleware, all plain ASGI (none buffers or re-wraps a response):
counting and answering failures (``Outcomes``), CORS, the API key, the body limit.
(``http_guard.py`` guards the connection below them: deadlines for reading a request.)"""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlxpipe.server.api import traces
from mlxpipe.server.api.errors import error_response
from mlxpipe.server.api.keys import SCOPE_KEY, Keys
from mlxpipe.server.api.metrics import Metrics
from mlxpipe.server.api.options import ApiOptions
from mlxpipe.server.api.request_log import RequestLog, ResponseWatch

logger = logging.getLogger(__name__)


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
                if seen > self.limit:  # sent without a Content-Length (chunked), or more than it said
                    raise BodyTooLarge(self.limit)
            return message

        try:
            await self.app(scope, limited, send)
        except BodyTooLarge:  # raised where no handler answered it
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send):
        response = error_response(413, BodyTooLarge(self.limit).detail, code="request_too_large",
                                  path=scope.get("path", ""))
        await response(scope, receive, send)


class BodyTooLarge(StarletteHTTPException):
    """A body that grew past the limit while it was read: an HTTPException, so the
    route's body parsing lets it through (any other error there becomes a 400) and
    the API's handler answers 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes")


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
        seen = ResponseWatch.on(scope)  # (a stream its client left is a 499; the request log reads it here)
        listened, watched = seen.watching(receive, send)
        try:
            await self.app(scope, listened, watched)
        except Exception:
            if seen.started is not None:  # mid-response (a stream): too late to answer; count what was sent
                self._count(scope, seen.status)
                raise
            await self._failure(scope.get("path", ""))(scope, listened, watched)
        self._count(scope, seen.status)

    def _failure(self, path: str) -> JSONResponse:
        if self.engine.state != "ready":
            return error_response(503, f"pipeline {self.engine.state}: {self.engine.failure}", type_="server_error",
                                  code="pipeline_unavailable", headers={"Retry-After": str(self.retry_after_s)},
                                  path=path)
        logger.exception("unhandled error")
        return error_response(500, "internal error", type_="server_error", path=path)

    def _count(self, scope, status: Optional[int]) -> None:
        route, caller = scope.get("route"), scope.get(SCOPE_KEY)  # set by the router, ApiKey, on the shared scope
        self.metrics.request(route.path if route is not None else "unmatched", str(status or 500),
                             caller.identity if caller is not None else None)


class ApiKey:
    """ASGI middleware: finds who each request is served as (``keys.Caller``) and leaves
    it on the request's scope, where routes read it (``keys.caller_of``). When keys are
    set, every path but the web page (``/`` and ``/static/``, which ask for the key
    themselves) needs one of them: the APIs, /health, /metrics, /nodes, and the OpenAPI
    pages (/docs, /openapi.json), as ``Authorization: Bearer <key>`` (the scheme in any
    case) or (Anthropic's SDKs) ``x-api-key: <key>``. Without keys, every request is
    ``keys.LOCAL``'s (one user, an operator)."""

    def __init__(self, app, keys: Keys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        caller = self.keys.caller(dict(scope.get("headers") or []))
        if caller is None and not (path == "/" or path.startswith("/static/")):
            response = error_response(401, "this server needs an API key: send Authorization: Bearer <key> "
                                           "(or x-api-key: <key>)", code="invalid_api_key", path=path)
            return await response(scope, receive, send)
        scope[SCOPE_KEY] = caller
        return await self.app(scope, receive, send)


def add_middleware(app: FastAPI, options: ApiOptions, metrics: Metrics, engine, keys: Keys) -> None:
    """Middleware added last runs first. From the outside in: the request log
    (``request_log.py``), outcomes (so 401s, 413s, preflights and failures count
    too), CORS (it answers preflights before the key is asked for, and puts its
    headers on refusals), the API key, the body limit. All plain ASGI: none
    buffers or re-wraps a response."""
    app.add_middleware(BodyLimit, limit=options.max_body_bytes)
    app.add_middleware(ApiKey, keys=keys)
    if options.cors_origins:
        # Any request header: browser SDKs send their own (the OpenAI JS SDK's x-stainless-*),
        # and the origin is what CORS guards. Retry-After is read by SDKs that back off.
        app.add_middleware(CORSMiddleware, allow_origins=list(options.cors_origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"], expose_headers=["Retry-After"])
    app.add_middleware(Outcomes, metrics=metrics, engine=engine, retry_after_s=options.retry_after_s)
    if options.log_requests:
        app.add_middleware(RequestLog)  # it sees the status Outcomes answers
    url = traces.endpoint(options.otlp_endpoint)
    if url:  # outermost: the HTTP span covers all the rest
        app.state.traces = traces.Exporter(url)
        app.add_middleware(traces.Traces, exporter=app.state.traces)
