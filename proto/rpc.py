"""How stages and the head open gRPC channels and servers: options, the cluster
secret, TLS, and the stage service's registration. The one place that does it.

Keepalive pings every second, answered within two, on every channel: a
stage that dies, stalls (SIGSTOP) or drops off the network is noticed within
about three seconds even while no frame is moving, because an HTTP/2 PING
needs the peer's process, not just its kernel, to answer.

Security (``Security``): every call but ``Ping`` and ``Hello`` carries the cluster secret
(``authorization: Bearer ...`` metadata), which a node compares in constant
time; optional TLS (and mutual TLS when the node is given a CA) through grpc's
own credentials.
"""

from __future__ import annotations

import argparse
import hmac
import inspect
import os
import resource
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import grpc
from google.protobuf.message import DecodeError

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto import pipeline_pb2_grpc as pb_grpc

# Frames are bounded by the limits each stage checks; this only caps what gRPC
# itself will take for one message.
MAX_MESSAGE_BYTES = 256 << 20

KEEPALIVE_MS = 1000
KEEPALIVE_TIMEOUT_MS = 2000

_MESSAGES = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

CHANNEL_OPTIONS = _MESSAGES + [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect quickly to a stage that comes back (default backoff grows to 2 minutes).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]

SERVER_OPTIONS = _MESSAGES + [
    # Accept the clients' frequent pings instead of answering GOAWAY "too many pings".
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    # A connection must finish its handshake (TCP to the client's HTTP/2 SETTINGS,
    # TLS included) within 10 s, not grpc's default 120 s: a stranger's silent
    # sockets each hold a file descriptor only that long.
    ("grpc.server_handshake_timeout_ms", 10_000),
]

REPLAN_WAIT_S = 300.0  # how long a Join waits for the re-plan it causes: the node's deadline, the head's wait

SECRET_ENV = "MLXPIPE_SECRET"
# Ping (liveness) and Hello (who a node is, and its proof that it holds the secret: a head
# asks before it trusts a node it discovered with the secret; shards/net/hello.py).
UNAUTHENTICATED_METHODS = ("/mlxpipe.v1.Stage/Ping", "/mlxpipe.v1.Stage/Hello")


def read_file(path: str, what: str) -> bytes:
    """A credential file's bytes, or a ValueError whose one line says what is
    wrong with ``what`` (an option's name). An empty file is an error: taken as
    "no secret" it would silently run a node, or an API, open."""
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as err:
        raise ValueError(f"{what} {path}: {err.strerror or err}") from None
    if not data.strip():
        raise ValueError(f"{what} {path} is empty")
    return data


def read_secret(path: str, what: str) -> str:
    """A secret or key file's text, stripped (see read_file)."""
    try:
        return read_file(path, what).decode().strip()
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not text") from None


def _read(path: Optional[str], what: str) -> Optional[bytes]:
    return read_file(path, what) if path else None


@dataclass
class Security:
    """This process's credentials toward the cluster."""

    secret: Optional[str] = None  # the shared cluster secret
    ca: Optional[bytes] = None    # PEM: verify peers; on a node it also demands client certificates
    cert: Optional[bytes] = None  # PEM: our certificate (a node's server cert; a head's client cert)
    key: Optional[bytes] = None   # PEM: its private key

    @classmethod
    def from_options(cls, secret: Optional[str] = None, secret_file: Optional[str] = None,
                     ca: Optional[str] = None, cert: Optional[str] = None,
                     key: Optional[str] = None) -> "Security":
        """From command-line options; the secret may also come from $MLXPIPE_SECRET."""
        if secret_file:
            secret = read_secret(secret_file, "--secret-file")
        secret = secret or os.environ.get(SECRET_ENV) or None
        if secret is not None and len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 characters "
                             "(make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))')")
        if bool(cert) != bool(key):
            raise ValueError("give --tls-cert and --tls-key together")
        return cls(secret, _read(ca, "--tls-ca"), _read(cert, "--tls-cert"), _read(key, "--tls-key"))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Security":
        """From the options ``add_security_arguments`` defines."""
        return cls.from_options(secret=getattr(args, "secret", None), secret_file=args.secret_file,
                                ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)

    def metadata(self) -> Tuple[Tuple[str, str], ...]:
        """What every call (but Ping) carries."""
        return (("authorization", f"Bearer {self.secret}"),) if self.secret else ()

    def channel(self, address: str) -> grpc.aio.Channel:
        """A channel to a stage: TLS when we hold a CA (and a client cert for mutual TLS)."""
        if self.ca is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        creds = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                             certificate_chain=self.cert)
        return grpc.aio.secure_channel(address, creds, options=CHANNEL_OPTIONS)

    def add_port(self, server: grpc.aio.Server, listen: str) -> int:
        """Listen on ``listen``: TLS when we hold a certificate, mutual TLS when also a CA."""
        if self.cert is None:
            return server.add_insecure_port(listen)
        creds = grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                            require_client_auth=self.ca is not None)
        return server.add_secure_port(listen, creds)

    def accepts(self, metadata) -> bool:
        """Whether call metadata carries our secret (always, when we have none)."""
        if not self.secret:
            return True
        want = f"Bearer {self.secret}".encode()
        for k, v in metadata or ():
            if k == "authorization":
                got = v.encode() if isinstance(v, str) else v
                return hmac.compare_digest(got, want)
        return False


def add_security_arguments(parser: argparse.ArgumentParser, node: bool = False) -> None:
    """The cluster secret and TLS options: of a node (``node``: it serves TLS and may be given
    the secret itself), else of a head or a client that dials nodes."""
    if not node:
        parser.add_argument("--secret-file", default=None,
                            help=f"file with the cluster secret the nodes share (or set ${SECRET_ENV})")
        parser.add_argument("--tls-ca", default=None, help="PEM CA to verify the nodes' TLS certificates")
        parser.add_argument("--tls-cert", default=None,
                            help="PEM client certificate, for nodes demanding mutual TLS")
        parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
        return
    parser.add_argument("--secret-file", default=None,
                        help=f"file holding the cluster secret (or set ${SECRET_ENV})")
    parser.add_argument("--secret", default=None,
                        help="the cluster secret itself (visible to other users in `ps`: prefer --secret-file)")
    parser.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", default=None,
                        help="PEM CA: verify the next stage, and demand client certificates (mutual TLS)")


class _Malformed:
    """A request message that did not parse: handlers answer INVALID_ARGUMENT."""

    def __init__(self, kind: str, err: Exception):
        self.message = f"malformed {kind} message: {err}"


# What one request message of each method may weigh, checked before parsing.
# (gRPC has only the server-wide limit above, and has read the message by then:
# this keeps a peer that holds the secret from making a node parse what no head
# sends. Strangers' messages are never read at all: see _SecretCheck.)
_REQUEST_BYTES = {
    "Forward": MAX_MESSAGE_BYTES,         # frames: rows x tokens x hidden x 4 bytes, within the stage's limits
    "Receive": (4 << 20) + (64 << 10),    # a weights chunk (weights.CHUNK_BYTES) and its names and checksum
    "Have": 64 << 20,                     # safetensors headers of a stage's layers, config files
    "Load": 64 << 20,                     # the last stage's tokenizer (for grammars): vocabulary, merges, template
    "Fetch": 4 << 20,                     # prefix-block keys, 9 bytes each: a prefix of millions of tokens
    "Echo": (16 << 20) + (64 << 10),      # a prefill-sized probe of a hop (shards/net/links.py: MAX_PROBE)
}
_OTHER_REQUEST_BYTES = 64 << 10           # Profile, Free, Health, Results, Join: a few fields


def _parser(message_type, limit: int = MAX_MESSAGE_BYTES):
    def parse(data: bytes):
        if len(data) > limit:
            return _Malformed(message_type.__name__,
                              ValueError(f"{len(data)} bytes, more than the {limit} this call takes"))
        try:
            return message_type.FromString(data)
        except (DecodeError, RuntimeWarning, ValueError) as err:
            return _Malformed(message_type.__name__, err)

    return parse


def malformed(request) -> Optional[str]:
    """The complaint about a request that did not parse, or None."""
    return request.message if isinstance(request, _Malformed) else None


async def refuse_malformed(request, context: grpc.aio.ServicerContext) -> None:
    """End the call with INVALID_ARGUMENT when its request did not parse."""
    if (why := malformed(request)) is not None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)


# Trailing metadata of a Forward stream a stage ended because it could not run a
# frame: the frame's sequences, passed on upstream to the head (its poison guard).
CULPRITS_KEY = "mlxpipe-culprits"


def culprits_metadata(seq_ids) -> tuple:
    return ((CULPRITS_KEY, ",".join(str(int(i)) for i in seq_ids)),)


def culprits_of(err: grpc.aio.AioRpcError) -> list:
    """The sequences a failed stream's status names (none when it names none)."""
    for key, value in err.trailing_metadata() or ():
        if key == CULPRITS_KEY:
            return [int(x) for x in value.split(",") if x.isdigit()]
    return []


UNAUTHENTICATED_DETAILS = "this node needs the cluster secret (authorization: Bearer ...)"


async def _deny(request_iterator, context):
    """Refuse a call without reading its request: a stream handler that never
    iterates ``request_iterator`` makes grpc send the status (trailers only) and
    reset the stream, so a stranger's message body is never assembled, copied
    into Python or parsed. No ``context.abort``: no AbortError, whose traceback
    would tie the request to the call's state in a reference cycle."""
    context.set_code(grpc.StatusCode.UNAUTHENTICATED)
    context.set_details(UNAUTHENTICATED_DETAILS)


# The wire is the same for all four kinds of call: one stream-stream handler
# answers every refused method, unary or streaming.
_DENY = grpc.stream_stream_rpc_method_handler(_deny)


class _SecretCheck(grpc.aio.ServerInterceptor):
    """Refuse every call without the cluster secret, except the bare liveness check."""

    def __init__(self, security: Security):
        self.security = security

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method in UNAUTHENTICATED_METHODS:
            return handler
        if self.security.accepts(details.invocation_metadata):
            return handler
        return _DENY


# (request streaming, response streaming) -> grpc's handler constructor
_HANDLER_KIND = {(False, False): grpc.unary_unary_rpc_method_handler,
                 (True, False): grpc.stream_unary_rpc_method_handler,
                 (False, True): grpc.unary_stream_rpc_method_handler,
                 (True, True): grpc.stream_stream_rpc_method_handler}


def _forget_frames(err: BaseException) -> None:
    """Drop the locals of the frames an exception passed through (and those of
    the exceptions it chains to). context.abort stores its AbortError on the
    call's state, whose traceback holds the handler's frame, whose ``context``
    holds that state: a reference cycle that keeps the request, and whatever
    else the handler had (a Forward stream's queue of frames), until the garbage
    collector runs."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__


def _releasing(method):
    """``method`` (a servicer's handler), letting go of what it held when it fails."""
    if not (inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method)):
        return method  # grpc runs plain functions in its thread pool
    if inspect.isasyncgenfunction(method):
        async def stream(request, context):
            try:
                async for item in method(request, context):
                    yield item
            except BaseException as err:
                del request
                _forget_frames(err)
                raise

        return stream

    async def call(request, context):
        try:
            return await method(request, context)
        except BaseException as err:
            del request
            _forget_frames(err)
            raise

    return call


def _unread(method, request_type):
    """A unary method run with an empty request, its body never read."""
    async def call(request_iterator, context):
        return await method(request_type(), context)

    return call


def raise_fd_limit(want: int = 65536) -> int:
    """Raise this process's soft RLIMIT_NOFILE toward ``want`` (macOS shells
    start at 256, Linux at 1024): every connection, a stranger's half-open one
    too, holds a descriptor. Returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    for value in (target, 10240, 4096):  # macOS refuses more than kern.maxfilesperproc
        if value <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (value, hard))
            return value
        except (ValueError, OSError):
            continue
    return soft


def secured_server(security: Security) -> grpc.aio.Server:
    """A gRPC server with the stages' options that checks the cluster secret, no service yet."""
    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=[_SecretCheck(security)])


def _server(service: str, servicer, security: Security) -> grpc.aio.Server:
    """A gRPC server for ``servicer``'s implementation of ``service`` (from
    pipeline.proto) that checks the cluster secret. Each method parses its
    request itself, so that bytes that are no protobuf get INVALID_ARGUMENT
    rather than an internal error."""
    handlers = {}
    for m in pb.DESCRIPTOR.services_by_name[service].methods:
        reply = getattr(pb, m.output_type.name).SerializeToString
        if f"/mlxpipe.v1.{service}/{m.name}" in UNAUTHENTICATED_METHODS:
            # Anyone may call these: they take an empty request, so never read
            # one (a stream handler that ignores its iterator), whatever a
            # stranger sends as its body.
            handlers[m.name] = grpc.stream_unary_rpc_method_handler(
                _unread(getattr(servicer, m.name), getattr(pb, m.input_type.name)), None, reply)
            continue
        kind = _HANDLER_KIND[(m.client_streaming, m.server_streaming)]
        limit = _REQUEST_BYTES.get(m.name, _OTHER_REQUEST_BYTES)
        handlers[m.name] = kind(_releasing(getattr(servicer, m.name)),
                                _parser(getattr(pb, m.input_type.name), limit), reply)
    server = secured_server(security)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(f"mlxpipe.v1.{service}", handlers),))
    return server


def stage_server(servicer: pb_grpc.StageServicer, security: Security) -> grpc.aio.Server:
    """The stage worker's gRPC server."""
    return _server("Stage", servicer, security)


def head_server(servicer: pb_grpc.HeadServicer, security: Security) -> grpc.aio.Server:
    """The head's own small gRPC server, where nodes join."""
    return _server("Head", servicer, security)
