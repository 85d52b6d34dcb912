"""A local stand-in for the Hugging Face hub: the endpoints huggingface_hub's
``snapshot_download`` calls, serving model folders as repos. Point ``HF_ENDPOINT``
at ``FakeHub.url``.

    GET       /api/models/{repo}/revision/{rev}    the repo's commit and files
    GET       /api/models/{repo}/tree/{rev}        the files, with sizes
    HEAD, GET /{repo}/resolve/{rev}/{file}         a file (X-Repo-Commit, ETag, Range)

An unknown repo gets 404 with ``X-Error-Code: RepoNotFound``, as the hub answers.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, List, Tuple

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the one revision of every repo
_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/(?P<what>revision|tree)/(?P<rev>[^/?]+)")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>[^?]+)")


class FakeHub:
    def __init__(self, repos: Dict[str, Path]):
        self.repos = repos                           # repo id -> the folder it serves
        self.requests: List[Tuple[str, str, str]] = []  # (method, path, Range header) of every request
        self.cut_once: Dict[str, int] = {}           # file name -> bytes to send before dropping, once
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def files(self, repo: str) -> List[Path]:
        root = self.repos[repo]
        return sorted(p for p in root.rglob("*") if p.is_file())


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            hub.requests.append((self.command, self.path, self.headers.get("Range", "")))
            if m := _API.match(self.path):
                return self._api(m["repo"], m["what"]) if m["repo"] in hub.repos else self._no_repo()
            if (m := _RESOLVE.match(self.path)) and m["repo"] in hub.repos:
                path = hub.repos[m["repo"]] / m["file"]
                if path.is_file():
                    return self._file(path, body)
            self._no_repo()

        def _no_repo(self) -> None:
            self._send(404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"})

        def _api(self, repo: str, what: str) -> None:
            root = hub.repos[repo]
            names = [p.relative_to(root).as_posix() for p in hub.files(repo)]
            if what == "revision":
                out = {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": n} for n in names]}
            else:
                out = [{"type": "file", "path": n, "size": (root / n).stat().st_size,
                        "oid": hashlib.sha1((root / n).read_bytes()).hexdigest()} for n in names]
            self._send(200, json.dumps(out).encode(), {"Content-Type": "application/json"})

        def _file(self, path: Path, body: bool) -> None:
            data = path.read_bytes()
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                       "Accept-Ranges": "bytes"}
            start = 0
            if m := re.match(r"bytes=(\d+)-", self.headers.get("Range", "")):
                start = int(m[1])
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            cut = hub.cut_once.pop(path.name, None) if body else None
            self._send(206 if start else 200, data[start:], headers, body, cut)

        def _send(self, status: int, data: bytes, headers: dict, body: bool = True, cut=None) -> None:
            self.send_response(status)
            for k, v in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(k, v)
            self.end_headers()
            if body:
                self.wfile.write(data if cut is None else data[:cut])
            if cut is not None:  # a connection lost mid-file
                self.wfile.flush()
                self.close_connection = True

    return Handler
