"""``mlxpipe serve``: a pipeline behind the OpenAI-compatible HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path

from mlxpipe.server import config as tree
from mlxpipe.server.api.options import ApiOptions
from mlxpipe.server.cli.running import announced, reachable
from mlxpipe.server.config import ClusterConfig, Listen
from mlxpipe.shards.models.store import is_repo_id

logger = logging.getLogger(__name__)


def model_id(model_arg: str, path: Path) -> str:
    """What /v1/models calls the model: a repo id as given, else the folder's name."""
    if model_arg and not Path(model_arg).expanduser().exists() and is_repo_id(model_arg):
        return model_arg
    return path.name


def _uvicorn_server(config):
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # serve() handles SIGINT/SIGTERM itself: uvicorn would re-raise the
            # signal after its shutdown, killing the process before the stage
            # processes it started are stopped.
            yield

    return _Server(config)


def listening_socket(host: str, port: int) -> socket.socket:
    """The API's socket, bound before anything loads: a port in use is a one-line
    error at once, not after the whole model has loaded (and not a race with
    whoever takes the port meanwhile)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()  # taken from now on (uvicorn sets its own backlog later)
    except (OSError, OverflowError) as err:
        raise ValueError(f"cannot listen on {host}:{port}: {getattr(err, 'strerror', None) or err}") from None
    return sock


async def serve(config: ClusterConfig, sock: socket.socket, options: ApiOptions) -> int:
    """Serve until SIGINT or SIGTERM; return the exit code the shell expects (130, 143)."""
    # (imported here: `serve --help` needs none of it, and it takes seconds)
    import uvicorn

    from mlxpipe.proto.rpc import raise_fd_limit
    from mlxpipe.server.api.app import create_app
    from mlxpipe.server.api.http_guard import GuardedH11Protocol, quiet_accept_errors, size_for_fd_limit
    from mlxpipe.server.api.metrics import Metrics
    from mlxpipe.server.cluster.assembly import Cluster

    metrics = Metrics()
    cluster = await Cluster(config, observer=metrics, listening=[sock.getsockname()[:2]]).start()
    app = None
    try:
        api = replace(options, model_id=model_id(config.model, cluster.model_path), aliases=(config.model,))
        app = create_app(cluster, api, metrics)
        # http: pinned (not "auto", which picks httptools when installed): uvicorn has no
        # deadline for a request's headers; GuardedH11Protocol adds one, and a cap.
        host, port = sock.getsockname()[:2]
        server = _uvicorn_server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                        lifespan="off", timeout_graceful_shutdown=5,
                                        http=GuardedH11Protocol,
                                        backlog=size_for_fd_limit(raise_fd_limit())))
        loop = asyncio.get_running_loop()
        quiet_accept_errors(loop)
        exit_code = 0

        def stop(sig: int) -> None:
            # In order: live requests end with an error event that says so, the HTTP
            # server closes, then (below) the stages stop; nothing is "recovered".
            nonlocal exit_code
            if not exit_code:
                exit_code = 128 + sig
                logger.warning("%s: shutting down", signal.Signals(sig).name)
                cluster.engine.shut_down("the server is shutting down")
                server.should_exit = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop, sig)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                await task  # raises why it could not start
                raise SystemExit(f"could not listen on {host}:{port}")
            await asyncio.sleep(0.05)
        # What a user (or a test) reads to know where to connect: the first line stays as it is.
        print(f"mlxpipe serving {api.model_id} on http://{host}:{port}/v1", flush=True)
        url = reachable(host, port)
        for line in [*banner(url, api.model_id, cluster.model_path), *cluster.describe()[1:]]:
            print(f"  {line}", flush=True)
        with announced(url):  # for `mlxpipe status` and `nodes`
            await task
        return exit_code
    finally:
        exporter = getattr(app.state, "traces", None) if app is not None else None
        if exporter is not None:  # what is still queued goes now
            await asyncio.to_thread(exporter.close)
        await cluster.stop()


def banner(url: str, model: str, path: Path) -> list:
    """The lines after the first: where to chat, where the APIs are, which model."""
    return [f"chat page: {url}/",
            f"API:       {url}/v1 (OpenAI; Anthropic at /v1/messages, Ollama at /api)",
            f"model:     {model} ({path})"]


def add_arguments(p) -> None:
    tree.add_arguments(p, ClusterConfig)
    tree.add_arguments(p, Listen)
    tree.add_arguments(p, ApiOptions)


def run(args) -> int:
    config = tree.from_args(ClusterConfig, args)
    options = tree.from_args(ApiOptions, args, model_id="")
    listen = tree.from_args(Listen, args)
    from mlxpipe.server.api.keys import parse_key_lines

    parse_key_lines(options.api_keys)  # a malformed key file line: one line now, not after the model loads
    if options.log_requests:  # at INFO, whatever -v says
        from mlxpipe.server.api.request_log import logger as request_logger

        request_logger.setLevel(logging.INFO)
    sock = listening_socket(listen.host, listen.port)
    try:
        code = asyncio.run(serve(config, sock, options))
    except KeyboardInterrupt:  # before the handlers were set: while loading
        code = 130
    # Everything is stopped in order by now. Leave without the interpreter's teardown:
    # gRPC's and MLX's C++ threads can only abort it noisily ("terminate called
    # without an active exception", one exit in two).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
