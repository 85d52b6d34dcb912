"""OpenAI's ``/v1/completions``: a text (or token-id) prompt, as it is, translated to a
``GenerationRequest``, and what comes back as ``text_completion`` objects
(``openai_objects.TextFormat``). With ``echo`` the prompt comes first, and with
``logprobs`` too its tokens' log-probabilities, scored by the last stage in the
prefill that fills the caches (``Sampling.prompt_logprobs``); ``max_tokens`` 0
scores the prompt alone: lm-evaluation-harness's loglikelihood requests."""

from __future__ import annotations

from fastapi import FastAPI, Request

from mlxpipe.server.api.errors import ApiError
from mlxpipe.server.api.generation import Generator
from mlxpipe.server.api.keys import caller_of
from mlxpipe.server.api.openai_objects import TextFormat, respond
from mlxpipe.server.api.options import ApiOptions
from mlxpipe.server.api.request import GenerationRequest
from mlxpipe.server.api.schemas import CompletionRequest
from mlxpipe.server.api.tenants import Tenant


def completion_request(req: CompletionRequest, options: ApiOptions, tenant: Tenant) -> GenerationRequest:
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens 0 generates nothing: it is for scoring a prompt, with echo",
                       param="max_tokens")
    text = req.prompt_text()
    return GenerationRequest(
        text=text, token_ids=list(req.prompt) if text is None else None,
        sampling=req.sampling(options), max_tokens=req.token_budget(), n=req.n,
        stop=req.stop_strings(), split_reply=False, speculation=req.speculation, max_drafts=req.num_draft_tokens,
        tenant=tenant, priority=req.priority, service_tier=req.service_tier)


def add_routes(app: FastAPI, generator: Generator, options: ApiOptions) -> None:
    @app.post("/v1/completions")
    async def text_completions(req: CompletionRequest, request: Request):
        chosen = generator.check_model(req.model)  # the pipeline's model, or another the head serves
        gen = await chosen.start(completion_request(req, options, caller_of(request).tenant(req.cache_salt)))
        fmt = TextFormat(chosen.tok, chosen.options.model_id, req.logprobs is not None, req.n,
                         echo=gen.echo if req.echo else None)
        return await respond(request, gen, fmt, req.stream, req.include_usage())
