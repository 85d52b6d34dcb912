"""How stages and the head open gRPC channels and servers: one set of options."""

from __future__ import annotations

# Frames are bounded by the limits each stage checks; this only caps what gRPC
# itself will take for one message.
MAX_MESSAGE_BYTES = 256 << 20

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
