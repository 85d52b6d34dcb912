"""One log line per finished request, whatever its protocol.

``RequestLog`` (ASGI middleware, the outermost) opens a record for each HTTP
request; ``Generator.start`` attaches the request's ``Generation`` to it
(``attach``, through a context variable: no protocol module takes part). When
the response has been sent, a request that generated, or was refused (4xx,
5xx), gets one line at INFO:

    POST /v1/chat/completions 200 prompt=31 cached=16 completion=64 ttft=0.21s 48.7 tok/s 1.52s

(tok/s: completion tokens after the first over the time since the first, as
the chat page counts them). Polls of /health, /metrics and the page's files
get none. A refusal's line ends with the reason the client was given
(``POST /v1/chat/completions 400 0.00s: max_tokens: Input should be greater than or equal to 1``).
A client that went away before its response was complete is a 499 (nginx's
"client closed request"), whether it was streaming (the 200 already sent
notwithstanding) or waiting for the whole reply, with the tokens it was sent
(``POST /v1/chat/completions 499 prompt=31 cached=0 completion=5 ... 2.10s: the
client went away after 5 tokens were sent``).
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)


@dataclass
class _Record:
    started: float                 # time.monotonic() when the request came in
    generation: Any = None         # its Generation, once one started
    error: Optional[str] = None    # why it was refused, when it was


_current: contextvars.ContextVar[Optional[_Record]] = contextvars.ContextVar("mlxpipe_request", default=None)


def attach(generation) -> None:
    """Count ``generation`` in the line of the request being served (if any is logged)."""
    record = _current.get()
    if record is not None:
        record.generation = generation


def refused(message: str) -> None:
    """Say in the line of the request being served why it was refused."""
    record = _current.get()
    if record is not None:
        record.error = message


def printable(text: str) -> str:
    """``text`` with every control or format character escaped (``\\n``, ``\\x1b``,
    ``\\u202e``): a path or message a client chose cannot start a forged log line,
    colour a terminal, or reorder what it shows."""
    return "".join(ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode("ascii")
                   for ch in text) if not text.isprintable() else text


def _why(record: _Record) -> str:
    if record.error is None:
        return ""
    text = printable(" ".join(record.error.split()))
    return f": {text[:197] + '...' if len(text) > 200 else text}"


def line(method: str, path: str, status: Optional[int], record: _Record, now: float) -> str:
    """The request's log line (tokens and timings when it generated)."""
    text = f"{method} {printable(path)} {status or 500}"
    gen = record.generation
    if gen is None:
        return f"{text} {now - record.started:.2f}s{_why(record)}"
    u = gen.usage()
    text += f" prompt={u.prompt_tokens} cached={u.cached_tokens}"
    text += f" (disk {u.cached_disk_tokens})" if u.cached_disk_tokens else ""
    text += f" completion={u.completion_tokens}"
    firsts = [s.first_token_at for s in gen.streams if s.first_token_at is not None]
    lasts = [s.last_token_at for s in gen.streams if s.last_token_at is not None]
    if firsts:
        text += f" ttft={min(firsts) - record.started:.2f}s"
        decoded, span = u.completion_tokens - len(firsts), max(lasts) - min(firsts)
        if decoded > 0 and span > 0:
            text += f" {decoded / span:.1f} tok/s"
    return f"{text} {now - record.started:.2f}s{_why(record)}"


class ResponseWatch:
    """What became of one response, watched on its ASGI channels: its status, and 499 in
    its place when the client went away from a response it had begun (the stream it was
    reading) before the end. ``Outcomes`` (middleware.py) watches every response and
    leaves its watch on the request's scope (``ResponseWatch.of``) for the request log:
    ``/metrics`` and the log count it alike."""

    KEY = "mlxpipe.response"  # its place on the ASGI scope

    @classmethod
    def on(cls, scope) -> "ResponseWatch":
        """A new watch of the request ``scope``, left on it."""
        scope[cls.KEY] = watch = cls()
        return watch

    @classmethod
    def of(cls, scope) -> "ResponseWatch":
        """The watch left on ``scope`` (an empty one, status unknown, where none was)."""
        return scope.get(cls.KEY) or cls()

    def __init__(self) -> None:
        self.started: Optional[int] = None
        self.complete = self.gone = False

    @property
    def left(self) -> bool:
        return self.gone and not self.complete and self.started is not None and self.started < 400

    @property
    def status(self) -> Optional[int]:
        return 499 if self.left else self.started

    def watching(self, receive, send):
        """``receive`` and ``send`` as the app should call them, watched."""
        async def watched(message):
            if message["type"] == "http.response.start":
                self.started = message["status"]
            self.complete |= message["type"] == "http.response.body" and not message.get("more_body", False)
            try:
                await send(message)
            except OSError:  # (how a server of ASGI 2.4 says the client went away)
                self.gone = True
                raise

        async def listened():
            message = await receive()
            self.gone |= message["type"] == "http.disconnect" and not self.complete
            return message

        return listened, watched


class RequestLog:
    """ASGI middleware, outside ``Outcomes``: the log line of each request that generated
    or was refused, with the status ``Outcomes`` saw (``ResponseWatch``)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = _Record(time.monotonic())
        token = _current.set(record)
        try:
            await self.app(scope, receive, send)
        finally:
            _current.reset(token)
            seen = ResponseWatch.of(scope)  # (Outcomes, inside, watched the response)
            status = seen.status
            if seen.left:  # a stream the client left
                sent = record.generation.usage().completion_tokens if record.generation is not None else 0
                record.error = f"the client went away after {sent} tokens were sent"
            if record.generation is not None or status is None or status >= 400:
                logger.info("%s", line(scope.get("method", "?"), scope.get("path", ""), status, record,
                                       time.monotonic()))
