"""How stages and the head open gRPC channels and servers: one set of options.

Keepalive pings every second, answered within two, on every channel: a
stage that dies, stalls (SIGSTOP) or drops off the network is noticed within
about three seconds even while no frame is moving, because an HTTP/2 PING
needs the peer's process, not just its kernel, to answer.
"""

from __future__ import annotations

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
]
