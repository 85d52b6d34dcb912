"""Embeddings: OpenAI's ``/v1/embeddings`` and Ollama's ``/api/embed`` and
``/api/embeddings``, translators to the head's embedding model
(``cluster/embedding_model.py``, ``--embedding-model``; reached through the head's
``embedder``).

``input`` is a string, a list of strings, a list of token ids or a list of such
lists (token ids are the embedding model's, taken as they are: no special tokens
added); ``encoding_format`` ``float`` or ``base64`` (little-endian float32, as
OpenAI's, which the openai SDK asks for by default); ``dimensions`` only for a model
whose card says it is trained for truncated vectors (Matryoshka: truncated, then
normalized again), else a 400 naming ``dimensions``. Bounded: inputs per request
(``ApiOptions.embedding_max_inputs``) and tokens per input (the model's own limit:
a 400 naming it; Ollama's ``truncate``, its default, cuts an input there instead).
Counted in ``usage`` and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import List, Literal, Optional, Union

import numpy as np
from fastapi import FastAPI, Request
from pydantic import Field

from mlxpipe.server.api.errors import ApiError
from mlxpipe.server.api.generation import Generator
from mlxpipe.server.api.json_body import Body
from mlxpipe.server.api.keys import caller_of
from mlxpipe.server.api.options import ApiOptions

Inputs = Union[str, List[str], List[int], List[List[int]]]


class EmbeddingRequest(Body):
    model: str
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)
    user: Optional[str] = None


class OllamaEmbed(Body):
    model: str
    input: Union[str, List[str]] = ""
    truncate: bool = True
    dimensions: Optional[int] = Field(None, ge=1)
    options: Optional[dict] = None
    keep_alive: Union[str, int, float, None] = None


class OllamaEmbeddings(Body):  # the older /api/embeddings
    model: str
    prompt: str = ""
    options: Optional[dict] = None
    keep_alive: Union[str, int, float, None] = None


class Embedder:
    """What the routes share: the head's embedding model, its checks, its counters."""

    def __init__(self, generator: Generator, options: ApiOptions):
        self.generator, self.options = generator, options

    @property
    def model(self):
        model = getattr(self.generator.head, "embedder", None)
        if model is None:
            raise ApiError(404, "this server has no embedding model: start it with --embedding-model default "
                                "(all-MiniLM-L6-v2), a folder or a Hugging Face repo id", param="model",
                           code="model_not_found")
        return model

    def check_model(self, name: str) -> None:
        """Any name but another served model's reaches the embedding model (clients name their own)."""
        model = self.model
        if name != model.facts.name and name in self.generator.served_names():
            raise ApiError(400, f"the model '{name}' makes no embeddings; this server's embedding model is "
                                f"'{model.facts.name}'", param="model")

    async def inputs(self, given: Inputs, truncate: bool = False) -> List[List[int]]:
        """The request's inputs as token ids, checked against the limits."""
        model, facts = self.model, self.model.facts
        if isinstance(given, str):
            given = [given]
        if not given:
            raise ApiError(400, "input is empty: give a string, a list of strings or of token ids", param="input")
        if len(given) > self.options.embedding_max_inputs and not isinstance(given[0], int):
            raise ApiError(400, f"input holds {len(given)} inputs; this server takes at most "
                                f"{self.options.embedding_max_inputs} per request", param="input")
        if isinstance(given[0], int):
            given = [given]
        if isinstance(given[0], str):
            if any(not s for s in given):
                raise ApiError(400, "input holds an empty string: nothing to embed", param="input")
            ids = await asyncio.to_thread(model.tokenize, given)
        else:
            ids = [list(x) for x in given]
            for i, x in enumerate(ids):
                if not x:
                    raise ApiError(400, f"input.{i} holds no token ids", param="input")
                bad = next((t for t in x if not 0 <= t < facts.vocab_size), None)
                if bad is not None:
                    raise ApiError(400, f"input.{i}: token {bad} is outside the embedding model's vocabulary "
                                        f"[0, {facts.vocab_size})", param="input")
        for i, x in enumerate(ids):
            if len(x) > facts.max_tokens:
                if not truncate:
                    raise ApiError(400, f"input.{i} is {len(x)} tokens; the embedding model '{facts.name}' takes at "
                                        f"most {facts.max_tokens} tokens per input", param="input",
                                   code="context_length_exceeded")
                ids[i] = x[: facts.max_tokens]
        return ids

    async def embed(self, ids: List[List[int]], dimensions: Optional[int], identity: bytes) -> np.ndarray:
        """The vectors, within the calling key's limits (``quotas.py``: its models, requests and
        tokens a minute, requests at once)."""
        facts, quotas = self.model.facts, self.generator.quotas
        quotas.check_model(identity, facts.name)
        if dimensions is not None and dimensions != facts.dimensions:
            if not facts.matryoshka:
                raise ApiError(400, f"dimensions: the embedding model '{facts.name}' makes {facts.dimensions}-"
                                    "dimensional vectors and is not trained for shorter ones", param="dimensions")
            if dimensions > facts.dimensions:
                raise ApiError(400, f"dimensions is {dimensions}; the embedding model '{facts.name}' makes at most "
                                    f"{facts.dimensions}", param="dimensions")
        admission = quotas.admit(identity, sum(map(len, ids)))
        try:
            return await self.model.embed(ids, dimensions)
        finally:
            admission.release()


def _encoded(vector: np.ndarray, fmt: str):
    if fmt == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def add_routes(app: FastAPI, generator: Generator, options: ApiOptions) -> None:
    embedder = Embedder(generator, options)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request):
        embedder.check_model(req.model)
        ids = await embedder.inputs(req.input)
        vectors = await embedder.embed(ids, req.dimensions, caller_of(request).identity)
        tokens = sum(map(len, ids))
        return {"object": "list", "model": embedder.model.facts.name,
                "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def ollama(request, name: str, given, truncate: bool, dimensions: Optional[int]):
        started = time.monotonic()
        embedder.check_model(name.removesuffix(":latest"))
        ids = await embedder.inputs(given, truncate)
        vectors = await embedder.embed(ids, dimensions, caller_of(request).identity)
        return vectors, sum(map(len, ids)), started

    @app.post("/api/embed")
    async def ollama_embed(body: OllamaEmbed, request: Request):
        vectors, tokens, started = await ollama(request, body.model, body.input, body.truncate, body.dimensions)
        elapsed = int((time.monotonic() - started) * 1e9)
        return {"model": body.model, "embeddings": vectors.tolist(), "total_duration": elapsed,
                "load_duration": 0, "prompt_eval_count": tokens}

    @app.post("/api/embeddings")
    async def ollama_embeddings(body: OllamaEmbeddings, request: Request):
        if not body.prompt:  # (Ollama answers an empty prompt with an empty vector)
            return {"embedding": []}
        vectors, _, _ = await ollama(request, body.model, body.prompt, True, None)
        return {"embedding": vectors[0].tolist()}
