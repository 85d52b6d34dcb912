"""The HTTP API: where a request enters.

``create_app`` puts together the middleware (``middleware.py``), OpenAI-shaped
errors (``errors.py``), the head's own routes (``health.py``: /health, /metrics,
/nodes; the web page in ``static/``; /v1/models) and one module per protocol
(``openai_chat.py``, ``openai_completions.py``, ``openai_responses.py``,
``anthropic_messages.py``, ``ollama.py``), each a translator to the one internal
request (``request.py``) that ``generation.py`` runs on the engine.
No MLX work happens in this process.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from mlxpipe.server.api import (anthropic_messages, health, ollama, openai_chat, openai_completions,
                                openai_responses)
from mlxpipe.server.api.errors import add_error_handlers
from mlxpipe.server.api.generation import Generator
from mlxpipe.server.api.keys import Keys
from mlxpipe.server.api.metrics import Metrics
from mlxpipe.server.api.middleware import add_middleware
from mlxpipe.server.api.options import ApiOptions

STATIC = Path(__file__).parent / "static"
# Each adds its routes: add_routes(app, generator, options).
PROTOCOLS = (openai_chat, openai_completions, openai_responses, anthropic_messages, ollama)


def create_app(head, options: ApiOptions, metrics: Optional[Metrics] = None) -> FastAPI:
    """The FastAPI app serving ``head`` (a started ``Cluster``: its ``engine``,
    ``tokenizer``, ``vocab_size`` and ``joined_nodes()``); ``metrics``: the observer
    its engine was given, if any."""
    app = FastAPI(title="mlxpipe", summary="OpenAI-compatible API over a pipeline of MLX stages")
    metrics = metrics or Metrics()
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    add_middleware(app, options, metrics, head.engine, Keys(options.api_keys))
    add_error_handlers(app)
    generator = Generator(head, options, metrics)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # HEAD: agents' connectivity check
    async def index():
        return FileResponse(STATIC / "index.html")

    health.add_routes(app, head, options, metrics)
    created = int(time.time())

    def card() -> dict:
        # The served context, as vLLM (max_model_len) and OpenRouter (context_length) report it.
        context = head.engine.max_context
        return {"id": options.model_id, "object": "model", "created": created, "owned_by": "mlxpipe",
                "context_length": context, "max_model_len": context,  # and what it reads (OpenRouter's field):
                "input_modalities": ["text", "image"] if generator.vision is not None else ["text"]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{name:path}")  # ":path": repo ids ("org/name") hold a slash
    async def model(name: str):
        generator.check_model(name)
        return card()

    for protocol in PROTOCOLS:
        protocol.add_routes(app, generator, options)
    return app
