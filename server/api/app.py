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

from mlxpipe.server.api import (anthropic_messages, embeddings, health, ollama, openai_chat, openai_completions,
                                openai_responses)
from mlxpipe.server.api.errors import add_error_handlers
from mlxpipe.server.api.generation import Generator
from mlxpipe.server.api.keys import Keys
from mlxpipe.server.api.quotas import Quotas
from mlxpipe.server.api.metrics import Metrics
from mlxpipe.server.api.middleware import add_middleware
from mlxpipe.server.api.options import ApiOptions

STATIC = Path(__file__).parent / "static"
# Each adds its routes: add_routes(app, generator, options).
PROTOCOLS = (openai_chat, openai_completions, openai_responses, anthropic_messages, ollama, embeddings)


def create_app(head, options: ApiOptions, metrics: Optional[Metrics] = None) -> FastAPI:
    """The FastAPI app serving ``head`` (a started ``Cluster``: its ``engine``,
    ``tokenizer``, ``vocab_size`` and ``joined_nodes()``); ``metrics``: the observer
    its engine was given, if any."""
    app = FastAPI(title="mlxpipe", summary="OpenAI-compatible API over a pipeline of MLX stages")
    metrics = metrics or Metrics()
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    keys = Keys(options.api_keys)
    add_middleware(app, options, metrics, head.engine, keys)
    add_error_handlers(app)
    generator = Generator(head, options, metrics, getattr(head, "extras", ()), Quotas(keys))  # (extras: models
    # the head runs; quotas: each key's limits)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # HEAD: agents' connectivity check
    async def index():
        return FileResponse(STATIC / "index.html")

    health.add_routes(app, head, options, metrics)
    created = int(time.time())

    def card(g: Generator) -> dict:
        # The served context, as vLLM (max_model_len) and OpenRouter (context_length) report it.
        context = g.engine.max_context
        return {"id": g.options.model_id, "object": "model", "created": created, "owned_by": "mlxpipe",
                "context_length": context, "max_model_len": context, "capabilities": ["chat", "completion"],
                "runs_on": "pipeline" if g is generator else "head",  # and what it reads (OpenRouter's field):
                "input_modalities": ["text", "image"] if g.vision is not None else ["text"]}

    def cards() -> list:
        out = [card(g) for g in (generator, *generator.others.values())]
        embedder = getattr(head, "embedder", None)
        if embedder is not None:
            f = embedder.facts
            out.append({"id": f.name, "object": "model", "created": created, "owned_by": "mlxpipe",
                        "context_length": f.max_tokens, "max_model_len": f.max_tokens, "capabilities": ["embedding"],
                        "dimensions": f.dimensions, "runs_on": "head", "input_modalities": ["text"]})
        return out

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": cards()}

    @app.get("/v1/models/{name:path}")  # ":path": repo ids ("org/name") hold a slash
    async def model(name: str):
        found = next((c for c in cards() if c["id"] == name), None)
        return found if found is not None else card(generator.check_model(name))

    for protocol in PROTOCOLS:
        protocol.add_routes(app, generator, options)
    return app
