"""Errors as each protocol's clients expect them.

One ``ApiError`` (a status, a message a person can act on, OpenAI's type,
param and code) is written in the dialect of the path it answers: OpenAI's
``{"error": {...}}`` (chat, completions, Responses), Anthropic's
``{"type": "error", "error": {"type", "message"}}`` (``/v1/messages``) and
Ollama's ``{"error": "..."}`` (``/api/*``), so that every SDK raises its own
error class with the message in it.
"""

from __future__ import annotations

import json
from typing import Dict, Optional

from fastapi.responses import JSONResponse

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


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
    """The error in a dialect's shape: in a response, or as a stream's last event."""
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
