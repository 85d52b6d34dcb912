"""The HTTP API's section of the config tree (``ApiOptions``), and the API key file."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional, Tuple

from mlxpipe.server.config import count, knob

def read_api_keys(path: str) -> Tuple[str, ...]:
    """An API key file's lines, one key a line with its fields, ``KEY [field=value ...]``
    (``api/keys.py`` reads them; blank lines and lines starting with # left out)."""
    from mlxpipe.proto.rpc import read_secret

    keys = tuple(k for k in (line.strip() for line in read_secret(path, "--api-key-file").splitlines())
                 if k and not k.startswith("#"))
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key")
    return keys


def _api_keys(path: Optional[str]) -> Tuple[str, ...]:
    """--api-key-file, else $MLXPIPE_API_KEY, else no key."""
    if path:
        return read_api_keys(path)
    key = os.environ.get("MLXPIPE_API_KEY", "").strip()
    return (f"{key} role=operator",) if key else ()  # the one key: an operator's


@dataclass
class ApiOptions:
    """The HTTP API."""

    model_id: str = knob(help="the name /v1/models lists (the folder's name, or the repo id as given)", flag=None)
    aliases: Tuple[str, ...] = knob((), "other names accepted in `model`", flag=None)
    default_max_tokens: Optional[int] = knob(None, "tokens a reply may run to when its request names no limit "
                                             "(default: none, to the end of the context, as OpenAI's)",
                                             flag="--max-tokens", type=count)
    default_temperature: float = knob(1.0, "temperature when a request does not say (default %(default)s, as "
                                      "OpenAI)", flag="--temp", type=float)
    api_keys: Tuple[str, ...] = knob((), "file with the API keys clients must send as 'Authorization: Bearer "
                                     "<key>', one a line: one per user or app, each key's prompts cached and "
                                     "responses stored apart; 'KEY role=operator' for a key that sees every key's "
                                     "activity in /health and /metrics (or set $MLXPIPE_API_KEY, an operator's); "
                                     "default: no key", flag="--api-key-file",
                                     parse=_api_keys, cli_default=None)
    cors_origins: Tuple[str, ...] = knob((), "an origin browsers may call the API from (repeat; default: none)",
                                         flag="--cors-origin", action="append", parse=tuple, cli_default=[])
    max_body_bytes: int = knob(32 << 20, "largest request body, in bytes (default %(default)s: room for a "
                               "conversation's screenshots as base64)", type=count)
    max_prompt_tokens: Optional[int] = knob(None, "longest prompt a request may send (default: the model's "
                                            "context)", type=count)
    max_tokens_limit: Optional[int] = knob(None, "largest max_tokens a request may ask for (default: the model's "
                                           "context)", type=count)
    log_requests: bool = knob(True, "log one line per request that generates or is refused: method, path, status, "
                              "prompt/cached/completion tokens, time to first token, tok/s (default %(default)s)",
                              action=argparse.BooleanOptionalAction)
    embedding_max_inputs: int = knob(2048, "inputs one embeddings request may hold, at most (default %(default)s, "
                                     "as OpenAI's); tokens per input are bounded by the embedding model's own limit",
                                     type=count)
    otlp_endpoint: Optional[str] = knob(None, "send an OpenTelemetry trace of every API request (the HTTP span, "
                                        "its wait, each prefill chunk and decode step with every stage's part of it) "
                                        "to this OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (default: the "
                                        "standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT "
                                        "if set, else off; needs the 'otel' extra)")
    retry_after_s: int = knob(2, "seconds a client refused for load is told to wait (Retry-After)", flag=None)
    # Images (a vision model's; ``images.py``): checked before anything reaches the model.
    max_images: int = knob(32, "images one request may hold, in all its messages (default %(default)s)", type=count)
    max_image_bytes: int = knob(20 << 20, "largest image, in bytes (default %(default)s)", type=count)
    max_image_pixels: int = knob(40_000_000, "largest image, in pixels, read from its header before any is "
                                 "decoded (default %(default)s)", type=count)
    image_urls: bool = knob(False, "fetch images that requests give by http(s) URL (default %(default)s: only "
                            "data URLs and base64)", action=argparse.BooleanOptionalAction)
    image_private_urls: bool = knob(False, "with --image-urls, fetch from loopback, private and link-local "
                                    "addresses too (default %(default)s)", action=argparse.BooleanOptionalAction)
    image_fetch_timeout_s: float = knob(10.0, "seconds an image URL has to send the whole image (default "
                                        "%(default)s)", type=float)
