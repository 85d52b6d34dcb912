"""Slow-header protection for the head's HTTP API under uvicorn (0.55, h11).

uvicorn has no deadline for a request's headers (its only timer is the keep-alive
one, armed after a response), so a connection that sends half a request line
holds a file descriptor for ever. This subclass of uvicorn's h11 protocol:

* gives every request a deadline for its headers (HEADER_TIMEOUT_S, counted from
  the moment the connection is ready for a request: an absolute deadline, so
  trickling a byte at a time does not extend it) and, once the headers are in,
  a deadline for its body (BODY_TIMEOUT_S);
* caps the connections that are still sending a request (MAX_READING): when a
  new one would pass the cap, the oldest connection of the client address that
  holds the most is closed. Connections whose request is being answered (a long
  streamed completion) are not touched.

So however fast strangers open sockets, the process holds at most MAX_READING
of theirs, well under its file-descriptor limit, and a real client's request
(the newest connection) is served.

Use: uvicorn.Config(app, ..., http=GuardedH11Protocol)  (pin it: "auto" would
pick httptools when that is installed), and call rpc.raise_fd_limit() at start-up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Dict, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0   # request line and headers, from connection (or previous response) on
BODY_TIMEOUT_S = 30.0     # the body, once the headers are in (bodies are at most a few MiB)
MAX_READING = 512         # connections still sending their request; beyond it the oldest goes...
MIN_AGE_S = 1.0           # ...if it has had this long to send it (a new connection's request is read
                          # a few loop turns after it is accepted, later under a flood)...
HARD_CAP = 2 * MAX_READING  # ...and whatever its age past this


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines for reading a request and a cap on
    connections that are still sending one."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._phase: Optional[str] = None
        self._ip = self.client[0] if self.client else ""
        # Shared by all connections of this server: per client address, the
        # connections still sending a request, oldest first.
        self._pool: _ReadingPool = self.server_state.__dict__.setdefault("_mlxpipe_reading", _ReadingPool())
        self._arm("headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._check_progress()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next cycle (keep-alive, pipelining)
        self._check_progress()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    # -- the deadlines ------------------------------------------------------

    def _check_progress(self) -> None:
        if self.transport.is_closing():
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.IDLE:          # waiting for (the rest of) a request line and headers
            if self._phase != "headers":
                self._arm("headers")
        elif state is h11.SEND_BODY:   # headers in, body still coming
            if self._phase != "body":
                self._arm("body")
        else:                          # DONE, MUST_CLOSE, CLOSED, ERROR: nothing left to read
            self._disarm()

    def _arm(self, phase: str) -> None:
        self._disarm()
        while len(self._pool) >= MAX_READING:  # make room: see _ReadingPool.victim
            victim = self._pool.victim()
            if self.loop.time() - victim._since < MIN_AGE_S and len(self._pool) < HARD_CAP:
                break
            victim._expire()
        self._phase = phase
        self._since = self.loop.time()
        seconds = HEADER_TIMEOUT_S if phase == "headers" else BODY_TIMEOUT_S
        self._pool.add(self, self.loop.call_later(seconds, self._expire))

    def _disarm(self) -> None:
        if getattr(self, "_phase", None) is not None:
            self._phase = None
            self._pool.remove(self)

    def _expire(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            # No response: a client this slow (or this old) gets the connection
            # closed, as nginx does at client_header_timeout.
            self.transport.abort()


class _ReadingPool:
    """Connections still sending a request, by client address, oldest first."""

    def __init__(self) -> None:
        self.by_ip: Dict[str, Dict[GuardedH11Protocol, asyncio.TimerHandle]] = {}
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, proto: GuardedH11Protocol, timer: asyncio.TimerHandle) -> None:
        self.by_ip.setdefault(proto._ip, {})[proto] = timer
        self.count += 1

    def remove(self, proto: GuardedH11Protocol) -> None:
        conns = self.by_ip.get(proto._ip)
        timer = conns.pop(proto, None) if conns is not None else None
        if timer is not None:
            timer.cancel()
            self.count -= 1
            if not conns:
                del self.by_ip[proto._ip]

    def victim(self) -> GuardedH11Protocol:
        """The oldest connection of the address holding the most: a flood from a
        few addresses pays for itself, and a client elsewhere keeps its one
        connection."""
        conns = max(self.by_ip.values(), key=len)
        return next(iter(conns))


def size_for_fd_limit(nofile: int, reserve: int = 256) -> int:
    """Fit the caps to the file-descriptor limit in force; returns the listen
    backlog to give uvicorn. A burst of accepts (up to the backlog) plus the
    connections still sending requests (up to HARD_CAP) take at most 3/4 of
    what is left after ``reserve`` (logs, gRPC channels to the stages); the
    rest is for requests being answered."""
    global MAX_READING, HARD_CAP
    budget = max(nofile - reserve, 64)
    MAX_READING = min(512, budget // 8)
    HARD_CAP = 2 * MAX_READING
    return min(2048, budget // 2)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, every_s: float = 60.0) -> None:
    """Log asyncio's 'socket.accept() out of system resource' once a minute, without
    a traceback. (CPython 3.11-3.13 log it once per pending connection and
    re-arm the listener once per failed accept: a full backlog of 2048 gives
    thousands of tracebacks a second, 150 MB of log in 20 s.)"""
    log = logging.getLogger("mlxpipe.server")
    last = [0.0]
    suppressed = [0]
    previous = loop.get_exception_handler()

    def handler(loop, context):
        if context.get("message") == "socket.accept() out of system resource":
            now = time.monotonic()
            if now - last[0] < every_s:
                suppressed[0] += 1
                return
            log.warning("out of file descriptors: cannot accept connections (%s; %d more like it since)",
                        context.get("exception"), suppressed[0])
            last[0], suppressed[0] = now, 0
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
