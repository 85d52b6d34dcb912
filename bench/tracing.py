"""``mlxpipe bench tracing``: what OpenTelemetry tracing costs a decode token, off and on.

Two ``mlxpipe serve`` of the same model and stages, started side by side: tracing off
(as served by default) and tracing on (``--otlp-endpoint`` at a receiver this bench
runs on loopback, which counts what arrives), and with ``--before PYTHON`` a third:
the same ``serve`` from another install (a checkout from before tracing existed, in
its own venv), tracing off. One stream at a time, greedy, speculation off, the same
prompts, the servers taken in turn each round so the machine's drift falls on all
alike: decode tokens/s after the first token (medians) and each against tracing off;
texts checked identical. With tracing off the head tests one empty dict per frame
(``server/core/tracing.py``) and imports no OpenTelemetry module.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, List, Optional

import httpx

from mlxpipe.bench.common import (DEFAULT_PROMPT, HttpServer, add_common_arguments, median, pin_flags,
                                  progress_bar, stream_chat)
from mlxpipe.server.config import ClusterConfig

PROMPTS = [DEFAULT_PROMPT, "Write a short story about a lighthouse keeper and a storm."]


class Sink:
    """An OTLP/HTTP receiver on loopback that answers 200 and counts the exports and bytes;
    ``keep`` (if given) gets each export's body too (``tests/otlp_receiver.py`` parses them)."""

    def __init__(self, keep: Optional[Callable[[bytes], None]] = None) -> None:
        self.posts = self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                sink.posts, sink.bytes = sink.posts + 1, sink.bytes + len(body)
                if keep is not None:
                    keep(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def _serve(python: str, args, extra: List[str]) -> List[str]:
    return ([python, "-m", "mlxpipe.server.cli", "serve", "--port", "0", "--model", args.model, "--stages",
             str(args.stages)] + pin_flags(args.pin) + shlex.split(args.serve_args) + extra)


async def _one(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int):
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "speculation": "none"}
    times, text, usage = await stream_chat(http, url, body)
    span = times[-1] - times[0] if len(times) > 1 else float("nan")
    tokens = usage.get("completion_tokens") or 0
    return (tokens - 1) / span if span > 0 else float("nan"), text


async def bench_tracing(args) -> dict:
    sink = Sink()
    configs = [("tracing off", sys.executable, []), ("tracing on", sys.executable, ["--otlp-endpoint", sink.url])]
    if args.before:
        configs.append(("before", args.before, []))
    servers: Dict[str, HttpServer] = {}
    series: Dict[str, Dict[str, list]] = {p: {name: [] for name, _, _ in configs} for p in args.prompt}
    try:
        for name, python, extra in configs:
            servers[name] = HttpServer(name, _serve(python, args, extra))
        bar = progress_bar(args.runs * len(args.prompt) * len(configs), "tracing")
        async with httpx.AsyncClient(timeout=1200) as http:
            for prompt in args.prompt:  # warm: the first requests compile kernels
                for name in servers:
                    await _one(http, servers[name].url, prompt, 8)
            for r in range(args.runs):
                for prompt in args.prompt:
                    order = list(servers) if r % 2 == 0 else list(reversed(servers))  # (no server always first)
                    for name in order:
                        series[prompt][name].append(await _one(http, servers[name].url, prompt, args.max_tokens))
                        if bar:
                            bar.update(1)
        if bar:
            bar.close()
    finally:
        for server in servers.values():
            server.close()
        sink.close()
    return _report(args, series, sink)


def _report(args, series: Dict[str, Dict[str, list]], sink: Sink) -> dict:
    names = list(next(iter(series.values())))
    lines = [f"one stream through `mlxpipe serve --stages {args.stages}` on {args.model}, {args.max_tokens} tokens "
             f"at most, greedy, speculation off, {args.runs} runs; decode tok/s (medians), and against tracing off",
             f"  {'prompt':40}" + "".join(f"{n:>14}" for n in names) + "  text"]
    out: Dict[str, dict] = {"otlp_exports": sink.posts, "otlp_bytes": sink.bytes, "prompts": {}}
    for prompt, runs in series.items():
        med = {n: median([r[0] for r in runs[n]]) for n in names}
        same = all(r[1] == runs[names[0]][0][1] for rs in runs.values() for r in rs)
        cells = "".join(f"{med[n]:8.2f} {med[n] / med['tracing off']:4.3f}x" if n != "tracing off"
                        else f"{med[n]:14.2f}" for n in names)
        lines.append(f"  {prompt[:39]:40}{cells}  {'identical' if same else 'DIFFERS'}")
        out["prompts"][prompt] = {"tok_s": {n: [r[0] for r in runs[n]] for n in names}, "median": med,
                                  "against_off": {n: med[n] / med["tracing off"] for n in names},
                                  "identical": same}
    lines.append(f"  the receiver got {sink.posts} OTLP exports ({sink.bytes / 1e3:.0f} kB) from tracing on")
    print("\n".join(lines))
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = add_common_arguments(sub.add_parser("tracing"))
    q.add_argument("--stages", type=int, default=ClusterConfig.stages, help="local stage processes (default %(default)s)")
    q.add_argument("--max-tokens", type=int, default=128, help="tokens per answer, at most (default %(default)s)")
    q.add_argument("--prompt", action="append", default=None, help="a chat prompt (again for more; default: two)")
    q.add_argument("--before", default=None, metavar="PYTHON",
                   help="also serve from this Python's mlxpipe (another install: a checkout from before tracing, in "
                        "its own venv), tracing off")
    q.add_argument("--serve-args", default="", help="more options for every mlxpipe serve it starts")
    q.set_defaults(measure=_measure)


async def _measure(args) -> dict:
    args.prompt = args.prompt or PROMPTS
    return await bench_tracing(args)
