"""Errors the API answers, with a 4xx status for anything the client can fix (bad
input never gets a 5xx), each in the shape of the protocol its path speaks: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (chat, completions, Responses),
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (``/v1/messages``)
and Ollama's ``{"error": "..."}`` (``/api/*``), so that every SDK raises its own
error class with the message in it."""

from __future__ import annotations

import json
from typing import Dict, Optional, Tuple

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlxpipe.server.api import request_log


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}
# What the 404 for an unknown path lists.
SERVED = ("POST /v1/chat/completions, POST /v1/completions, GET /v1/models (OpenAI); POST /v1/responses, "
          "GET /v1/responses/{id} (OpenAI Responses); POST /v1/messages, POST /v1/messages/count_tokens "
          "(Anthropic); POST /api/chat, POST /api/generate, GET /api/tags, POST /api/show, GET /api/ps, "
          "GET /api/version (Ollama); GET /health, GET /metrics, GET / (the web page)")


def dialect(path: str) -> str:
    """Whose error shape a path answers in: "anthropic", "ollama" or "openai"."""
    if path.startswith(("/v1/messages", "/messages")):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    return "openai"


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self, speaks: str = "openai") -> dict:
        return error_body(self.message, self.type, self.param, self.code, self.status, speaks)


def error_body(message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None, status: int = 400, speaks: str = "openai") -> dict:
    """The error in a dialect's shape: in a response, or as a stream's last event (either
    way what the client is told, so it also ends the request's log line)."""
    request_log.refused(message)
    if speaks == "anthropic":
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    if speaks == "ollama":
        return {"error": message}
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: a message may echo what the
    client sent, and a lone surrogate ("\\ud800") cannot be encoded as UTF-8,
    but it can be written back as the same escape."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: Optional[str] = None, code: Optional[str] = None,
                   headers: Optional[Dict[str, str]] = None, path: str = "") -> JSONResponse:
    """An error response in the dialect of ``path``."""
    return AsciiJSONResponse(error_body(message, type_, param, code, status, dialect(path)), status_code=status,
                             headers=headers)


def validation_message(err: RequestValidationError, content_type: str) -> Tuple[str, Optional[str]]:
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


def add_error_handlers(app: FastAPI) -> None:
    """Every error in its path's shape; bad input never gets a 5xx (and what no
    handler here takes, Outcomes answers)."""

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers,
                              path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        message, param = validation_message(exc, request.headers.get("content-type", ""))
        return error_response(400, message, param=param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        detail = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "the request body could not be read as JSON (malformed, or nested too deeply)"
        if exc.status_code in (404, 405) and detail in ("Not Found", "Method Not Allowed"):
            detail = f"{request.method} {request.url.path} is not served here. This server serves: {SERVED}"
        return error_response(exc.status_code, detail, code="not_found" if exc.status_code == 404 else None,
                              path=request.url.path)
