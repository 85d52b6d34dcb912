"""OpenAI's ``/v1/chat/completions``: its body (``schemas.ChatCompletionRequest``)
translated to a ``GenerationRequest``, and what comes back as ``chat.completion``
objects (``openai_objects.ChatFormat``)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from mlxpipe.server.api.generation import Generator
from mlxpipe.server.api.keys import caller_of
from mlxpipe.server.api.openai_objects import ChatFormat, respond
from mlxpipe.server.api.options import ApiOptions
from mlxpipe.server.api.request import GenerationRequest
from mlxpipe.server.api.schemas import ChatCompletionRequest
from mlxpipe.server.api.tenants import Tenant


def chat_request(req: ChatCompletionRequest, options: ApiOptions, tenant: Tenant) -> GenerationRequest:
    images = []  # the messages' images, in order
    messages = [m.for_template(images, f"messages.{i}") for i, m in enumerate(req.messages)]
    return GenerationRequest(
        messages=messages, tools=req.tool_dicts(), images=images,
        template_kwargs=req.chat_template_kwargs or {},
        sampling=req.sampling(options), max_tokens=req.token_budget(), n=req.n,
        stop=req.stop_strings(),
        response_format=req.response_format.as_dict() if req.response_format is not None else None,
        tool_choice=req.choice(), parallel_tool_calls=req.parallel_tool_calls,
        speculation=req.speculation, max_drafts=req.num_draft_tokens,
        tenant=tenant, priority=req.priority, service_tier=req.service_tier)


def add_routes(app: FastAPI, generator: Generator, options: ApiOptions) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        chosen = generator.check_model(req.model)  # the pipeline's model, or another the head serves
        gen = await chosen.start(chat_request(req, options, caller_of(request).tenant(req.cache_salt)))
        fmt = ChatFormat(chosen.tok, chosen.options.model_id, req.logprobs)
        return await respond(request, gen, fmt, req.stream, req.include_usage())
