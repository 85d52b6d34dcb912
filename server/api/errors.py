"""Errors the API answers, with a 4xx status for anything the client can fix (bad
input never gets a 5xx), each in the shape of the protocol its path speaks: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (chat, completions, Responses),
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (``/v1/messages``)
and Ollama's ``{"error": "..."}`` (``/api/*``), so that every SDK raises its own
error class with the message in it."""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple

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
SERVED = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings, GET /v1/models (OpenAI); "
          "POST /v1/responses, GET and DELETE /v1/responses/{id} (OpenAI Responses); POST /v1/messages, "
          "POST /v1/messages/count_tokens (Anthropic); POST /api/chat, POST /api/generate, POST /api/embed, "
          "POST /api/embeddings, GET /api/tags, POST /api/show, GET /api/ps, "
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


def _json_path(loc, body) -> List[str]:
    """A pydantic error's location as the path into the body it was read from: the
    labels pydantic adds for a union's members ("str", "list[...]", a tag) are not
    keys of the body, so they are left out."""
    path, node = [], body
    for part in loc:
        if isinstance(part, str) and _label(part):
            continue
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            node = None  # a missing field (or one past what the body holds): still its path
        path.append(str(part))
    return path


def _label(part: str) -> bool:
    """Whether a location part is pydantic's label of a union's member ("str",
    "list[...]", a tag: the translators tag members by their model's name) rather
    than a field."""
    return "[" in part or part[:1].isupper() or part in ("str", "int", "float", "bool", "dict", "list", "none")


def validation_message(err: RequestValidationError, content_type: str) -> Tuple[str, Optional[str]]:
    errors = err.errors()
    body = getattr(err, "body", None)
    paths = [_json_path([p for p in e.get("loc", ()) if p != "body"], body) for e in errors]
    # Of a union's alternatives, the error of the one that went deepest says what is wrong.
    depth = max(range(len(errors)), key=lambda i: (len(paths[i]), -i))
    first = errors[depth]
    if first.get("type") == "json_value":  # schemas.check_json: the path is in the message
        return first["msg"], first["ctx"]["param"] or None
    loc = paths[depth]
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
        code = {404: "not_found", 413: "request_too_large"}.get(exc.status_code)
        return error_response(exc.status_code, detail, code=code, path=request.url.path)
