"""Errors the API answers, in OpenAI's shape: ``{"error": {"message", "type", "param",
"code"}}``, with a 4xx status for anything the client can fix (bad input never gets a
5xx). A protocol with another shape renders ``ApiError`` its own way."""

from __future__ import annotations

import json
from typing import Dict, Optional, Tuple

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


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
    """Every error in OpenAI's shape; bad input never gets a 5xx (and what no
    handler here takes, Outcomes answers)."""

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        message, param = validation_message(exc, request.headers.get("content-type", ""))
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        detail = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "the request body could not be read as JSON (malformed, or nested too deeply)"
        return error_response(exc.status_code, detail, code=None)
