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
Counted in ``usage`` and ``/metrics``. A request that names the pipeline's own model
is embedded by it (``PipelinePooling``): its last stage pools the final hidden state,
``pooling`` ``last`` (default, as vLLM pools a decoder) or ``mean``, normalized.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass
from typing import List, Literal, Optional, Sequence, Union

import numpy as np
from fastapi import FastAPI, Request
from pydantic import Field

from mlxpipe.server.api.errors import ApiError
from mlxpipe.server.api.generation import Generator
from mlxpipe.server.api.json_body import Body
from mlxpipe.server.api.keys import caller_of
from mlxpipe.server.api.options import ApiOptions
from mlxpipe.server.core.sequence import QueueFull
from mlxpipe.server.core.streams import GenerationFailed, SequenceFailed
from mlxpipe.shards.params.sampling import Sampling

Inputs = Union[str, List[str], List[int], List[List[int]]]
POOLINGS = {"mean": 1, "last": 2}  # the pipeline's own model, pooled on its last stage (``SeqEntry.pool``)


class EmbeddingRequest(Body):
    model: str
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)
    user: Optional[str] = None
    pooling: Literal["last", "mean"] = "last"  # ours: how the pipeline's own model pools (see PipelinePooling)


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


@dataclass
class PipelineFacts:
    """The pipeline's model seen as an embedding model (``EmbeddingFacts``' fields the API reads)."""

    name: str
    vocab_size: int
    max_tokens: int
    dimensions: Optional[int] = None  # its hidden size (known from the first vector)
    matryoshka: bool = False


class PipelinePooling:
    """The pipeline's own model as an embedding model: each input a sequence the last stage pools
    (``Engine.submit(pool=...)``: its final hidden state, the mean of every position or the last
    one's, normalized), prefilled beside the other requests, never from the prefix cache."""

    def __init__(self, generator: Generator, pooling: str):
        self.generator, self.mode = generator, POOLINGS[pooling]
        self.facts = PipelineFacts(generator.options.model_id, generator.vocab, generator.engine.max_context - 1)

    def tokenize(self, texts: Sequence[str]) -> List[List[int]]:
        return [list(self.generator.tok.encode(t)) for t in texts]

    async def embed(self, ids: List[List[int]], dimensions: Optional[int], salt: bytes = b"") -> np.ndarray:
        engine, streams = self.generator.engine, []
        try:
            for x in ids:
                streams.append(engine.submit(x, 0, Sampling(), speculation="none", cache_salt=salt, pool=self.mode))
            for stream in streams:
                async for _ in stream:
                    pass
        except QueueFull as err:
            raise ApiError(429, f"the server is at capacity ({err}); retry shortly", type_="rate_limit_error",
                           code="server_busy", headers=self.generator.retry_after)
        except (GenerationFailed, SequenceFailed) as err:
            raise ApiError(503, f"the pipeline could not embed this input: {err}", type_="server_error",
                           headers=self.generator.retry_after)
        except ValueError as err:  # what the engine refuses (an input longer than the context)
            raise ApiError(400, str(err), param="input")
        finally:
            for stream in streams:
                stream.cancel()
        return np.array([s.embedding for s in streams], dtype=np.float32)


class Embedder:
    """What the routes share: which model embeds (the head's embedding model, or the pipeline's
    when a request names it), the checks, the counters."""

    def __init__(self, generator: Generator, options: ApiOptions):
        self.generator, self.options = generator, options

    def pick(self, name: str, pooling: str = "last"):
        """The pipeline's model when ``name`` is its id; another served model's name is a 400;
        any other name reaches the head's embedding model (clients name their own)."""
        g = self.generator
        if name == g.options.model_id:
            return PipelinePooling(g, pooling)
        model = getattr(g.head, "embedder", None)
        if model is None:
            raise ApiError(404, f"this server has no embedding model: start it with --embedding-model default "
                                f"(all-MiniLM-L6-v2), a folder or a Hugging Face repo id; or name the pipeline's "
                                f"model '{g.options.model_id}' to pool its final hidden state", param="model",
                           code="model_not_found")
        if name != model.facts.name and (name in g.names or name in g.served()):
            raise ApiError(400, f"the model '{name}' makes no embeddings; this server's embedding model is "
                                f"'{model.facts.name}' (and the pipeline's '{g.options.model_id}' pools its own)",
                           param="model")
        return model

    async def inputs(self, model, given: Inputs, truncate: bool = False) -> List[List[int]]:
        """The request's inputs as token ids, checked against the limits."""
        facts = model.facts
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

    async def embed(self, model, ids: List[List[int]], dimensions: Optional[int], request) -> np.ndarray:
        """The vectors, within the calling key's limits (``quotas.py``: its models, requests and
        tokens a minute, requests at once)."""
        facts, quotas, caller = model.facts, self.generator.quotas, caller_of(request)
        quotas.check_model(caller.identity, facts.name)
        if dimensions is not None and dimensions != facts.dimensions:
            if not facts.matryoshka:
                raise ApiError(400, f"dimensions: the model '{facts.name}' makes vectors of "
                                    f"{facts.dimensions or 'its hidden size'} and is not trained for shorter ones",
                               param="dimensions")
            if dimensions > facts.dimensions:
                raise ApiError(400, f"dimensions is {dimensions}; the embedding model '{facts.name}' makes at most "
                                    f"{facts.dimensions}", param="dimensions")
        admission = quotas.admit(caller.identity, sum(map(len, ids)))
        try:
            if isinstance(model, PipelinePooling):
                return await model.embed(ids, dimensions, caller.tenant(None).salt())
            return await model.embed(ids, dimensions)
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
        model = embedder.pick(req.model, req.pooling)
        ids = await embedder.inputs(model, req.input)
        vectors = await embedder.embed(model, ids, req.dimensions, request)
        tokens = sum(map(len, ids))
        return {"object": "list", "model": model.facts.name,
                "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def ollama(request, name: str, given, truncate: bool, dimensions: Optional[int]):
        started = time.monotonic()
        model = embedder.pick(name.removesuffix(":latest"))
        ids = await embedder.inputs(model, given, truncate)
        vectors = await embedder.embed(model, ids, dimensions, request)
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
