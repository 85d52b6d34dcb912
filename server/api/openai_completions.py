"""OpenAI's ``/v1/completions``: a text (or token-id) prompt, as it is, translated to a
``GenerationRequest``, and what comes back as ``text_completion`` objects
(``openai_objects.TextFormat``)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from mlxpipe.server.api.generation import Generator
from mlxpipe.server.api.openai_objects import TextFormat, respond
from mlxpipe.server.api.request import GenerationRequest
from mlxpipe.server.api.schemas import CompletionRequest
from mlxpipe.server.cluster.config import ApiOptions


def completion_request(req: CompletionRequest, options: ApiOptions) -> GenerationRequest:
    text = req.prompt_text()
    return GenerationRequest(
        text=text, token_ids=list(req.prompt) if text is None else None,
        sampling=req.sampling(options), max_tokens=req.token_budget(), n=req.n,
        stop=req.stop_strings(), split_reply=False, speculation=req.speculation, max_drafts=req.num_draft_tokens,
        cache_salt=req.cache_salt)


def add_routes(app: FastAPI, generator: Generator, options: ApiOptions) -> None:
    @app.post("/v1/completions")
    async def text_completions(req: CompletionRequest, request: Request):
        generator.check_model(req.model)
        gen = await generator.start(completion_request(req, options))
        fmt = TextFormat(generator.tok, options.model_id, req.logprobs is not None, req.n)
        return await respond(request, gen, fmt, req.stream, req.include_usage())
