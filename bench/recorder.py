"""A recording pass-through on loopback: every request a client sends is forwarded
to ``upstream`` unchanged (body and headers, less the hop-by-hop ones) and the
response streamed back as it comes; the method, path and JSON body of each request
are kept. ``mlxpipe bench openwebui`` puts it between Open WebUI and ``mlxpipe
serve``, so what mlxpipe received (the prompt Open WebUI built from the retrieved
document) can be read back and checked, not guessed from token counts."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass
from typing import Any, List, Optional

import httpx

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length",
              "proxy-authorization", "proxy-authenticate"}


@dataclass
class Recorded:
    method: str
    path: str
    body: Any          # the parsed JSON body (None when there was none or it was not JSON)
    status: int = 0    # the upstream's answer


class Recorder:
    """``url``: where clients reach it (``http://127.0.0.1:PORT``); ``requests``: what they sent."""

    def __init__(self, upstream: str):
        import uvicorn

        self.upstream = upstream.rstrip("/")
        self.requests: List[Recorded] = []
        self._lock = threading.Lock()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self._app, log_level="warning", lifespan="off",
                                                    interface="asgi3"))
        self._client: Optional[httpx.AsyncClient] = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._server.serve(sockets=[sock]),), daemon=True)
        self._thread.start()

    def seen(self, path: str) -> List[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.path == path]

    async def _app(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        record = Recorded(scope["method"], scope["path"], parsed)
        with self._lock:
            self.requests.append(record)
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10))
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k.decode().lower() not in HOP_BY_HOP]
        query = scope.get("query_string", b"").decode()
        url = self.upstream + scope["path"] + (f"?{query}" if query else "")
        request = self._client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as err:
            record.status = 502
            await send({"type": "http.response.start", "status": 502, "headers": []})
            await send({"type": "http.response.body", "body": f"upstream: {err}".encode()})
            return
        record.status = response.status_code
        out = [(k.encode(), v.encode()) for k, v in response.headers.items()
               if k.lower() not in HOP_BY_HOP]  # content-encoding kept: the bytes go on as they came
        await send({"type": "http.response.start", "status": response.status_code, "headers": out})
        try:
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await response.aclose()
        await send({"type": "http.response.body", "body": b""})

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
