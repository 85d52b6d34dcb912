"""A request's token budget: what its ``max_tokens`` may be within the served context, the
stages' KV caches, the server's limits (``--max-tokens``, ``--max-tokens-limit``,
``--max-prompt-tokens``) and its API key's (``max_tokens`` in the key file: ``quotas.py``).
Every protocol's request goes through it (``Generator.budget``)."""

from __future__ import annotations

from typing import Optional

from mlxpipe.server.api.errors import ApiError
from mlxpipe.server.api.options import ApiOptions
from mlxpipe.server.api.request import GenerationRequest


def token_budget(options: ApiOptions, engine, key_limit: Optional[int], req: GenerationRequest,
                 prompt_len: int) -> int:
    """The request's token budget, or a 400 saying what to change. ``engine``: its ``max_context``,
    ``kv_tokens`` and ``context_limit()``; ``key_limit``: the longest ``max_tokens`` its API key
    may ask for (the key file's ``max_tokens``; None: no limit)."""
    context, asked = engine.max_context, req.max_tokens
    if options.max_prompt_tokens and prompt_len > options.max_prompt_tokens:
        raise ApiError(400, f"the prompt is {prompt_len} tokens; this server takes at most "
                            f"{options.max_prompt_tokens}", param=req.prompt_field, code="prompt_too_long")
    limit = options.max_tokens_limit
    if limit and (asked or 0) > limit and not req.clamp_max_tokens:
        raise ApiError(400, f"max_tokens is {asked}; this server allows at most {limit}", param="max_tokens")
    if key_limit and (asked or 0) > key_limit and not req.clamp_max_tokens:
        raise ApiError(400, f"max_tokens is {asked}; this API key allows at most {key_limit} (max_tokens in "
                            "the key file)", param="max_tokens", code="key_limit")
    limit = min(limit or key_limit or 0, key_limit or limit or 0) or None  # the smaller of the two
    served = f"{context} tokens ({engine.context_limit()})"
    if prompt_len >= context:
        raise ApiError(400, f"This model's maximum context length is {served}. However, your "
                            f"prompt is {prompt_len} tokens. Please shorten it.",
                       param=req.prompt_field, code="context_length_exceeded")
    if asked is None:  # to the end of the context (and of what the stages' KV caches hold), or the cap
        room = min(context, engine.kv_tokens) - prompt_len
        return max(min(options.default_max_tokens or context, limit or context, room), 1)
    if req.clamp_max_tokens:
        return min(asked, limit or context, context - prompt_len)
    if prompt_len + asked > context:
        raise ApiError(400, f"This model's maximum context length is {served}. However, you "
                            f"requested {prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} "
                            f"for the completion). Please reduce the prompt or max_tokens.",
                       param="max_tokens", code="context_length_exceeded")
    return asked
