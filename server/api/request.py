"""The one internal request every HTTP protocol translates to.

A protocol module (``openai_chat.py``, ``openai_completions.py``, ...) reads its
own body, fills a ``GenerationRequest``, hands it to ``Generator.start``
(``generation.py``) and formats what comes back; the prompt's rendering, the
grammar, the token budget, sampling, stop strings, speculation and the
splitting of replies into content, reasoning and tool calls are shared. What a
request did not say is filled in here, or by ``Generator`` (the token budget),
never by a translator: ``request_sampling`` makes every protocol's ``Sampling``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from mlxpipe.server.api.options import ApiOptions
from mlxpipe.server.api.tenants import Tenant
from mlxpipe.server.core.drafting import DEFAULT_SPECULATION
from mlxpipe.shards.params.sampling import Sampling


def request_sampling(options: ApiOptions, **given) -> Sampling:
    """A request's ``Sampling``: the parameters it gave (None: not given), the server's
    default temperature (``ApiOptions.default_temperature``) and ``Sampling``'s own
    defaults for the rest."""
    given = {name: value for name, value in given.items() if value is not None}
    return Sampling(**{"temperature": options.default_temperature, **given})


@dataclass(frozen=True)
class ImageRef:
    """An image as a client sent it (``images.load_images`` checks and decodes it)."""

    source: str      # a data URL, an http(s) URL, or base64 (``base64``: it can be nothing else)
    param: str       # where the request put it, for errors ("messages.0.content.1")
    base64: bool = False


def image_part(images: List[ImageRef], source: Optional[str], param: str, is_base64: bool = False) -> dict:
    """The content part a message holds for an image, its ref appended to ``images``."""
    images.append(ImageRef(source or "", param, is_base64))
    return {"type": "image"}


@dataclass
class GenerationRequest:
    # The prompt: exactly one of these. ``messages`` and ``tools`` go through the
    # model's chat template (``chat_template.render``), as OpenAI's chat messages
    # ({"role", "content"} with text content; an assistant's "tool_calls" with JSON
    # text arguments; a tool result's "tool_call_id"; roles system, developer,
    # user, assistant, tool) and function tools ({"type": "function",
    # "function": {"name", "description", "parameters", "strict"}}).
    messages: Optional[List[Dict[str, Any]]] = None
    text: Optional[str] = None                 # tokenized as it is
    token_ids: Optional[List[int]] = None      # checked against the vocabulary
    tools: Optional[List[Dict[str, Any]]] = None
    template_kwargs: Dict[str, Any] = field(default_factory=dict)  # e.g. {"enable_thinking": False}
    # What to generate. Choices differ by seed only: choice i draws with seed + i.
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: Optional[int] = None           # None: the server's default, within the context
    clamp_max_tokens: bool = False             # a budget past the context becomes what it leaves (else a 400)
    n: int = 1
    stop: List[str] = field(default_factory=list)
    # What the output must follow (a grammar, built and checked on the head):
    # OpenAI's ``response_format`` ({"type": "json_object"} or {"type": "json_schema",
    # "json_schema": {"schema", "strict"}}), or a forced tool call: ``tool_choice``
    # "required" or {"type": "function", "function": {"name"}} ("auto", "none" or None: free).
    response_format: Optional[Dict[str, Any]] = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    # How the output is read back: split into content, reasoning (between the
    # template's think markers) and tool calls (between its tool-call markers), or,
    # without ``split_reply``, plain text.
    split_reply: bool = True
    # Speculative decoding (the output is the same either way): what to draft from
    # (``core/drafting.SOURCES``) and drafted positions in flight at most (0: none).
    speculation: str = DEFAULT_SPECULATION
    max_drafts: Optional[int] = None
    # Whose request it is: the API key the middleware found and the client's ``cache_salt``
    # (``tenants.py``): prefixes are reused only between requests of the same tenant, and
    # what is stored for a request is its key's. Set where a protocol builds the request,
    # from the route's ``keys.caller_of``; no default, so no request is silently untenanted.
    tenant: Tenant = field(kw_only=True)
    # Lowering its own priority class (``core/priority.py``; never above its key's): vLLM's
    # ``priority`` (above 0: batch) and OpenAI's ``service_tier`` ("flex": batch).
    priority: Optional[int] = None
    service_tier: Optional[str] = None
    # The body field that holds the prompt, for errors that name it (None: "messages" for
    # messages, "prompt" for text or token ids).
    prompt_param: Optional[str] = None
    # Images the messages hold ({"type": "image"} content parts, in order): as the client sent
    # them, checked and decoded by ``images.load_images`` (a vision model's; any other refuses them).
    images: List[ImageRef] = field(default_factory=list)

    @property
    def continues(self) -> bool:
        """A text or token-id prompt: the reply continues its text (a chat reply starts anew)."""
        return self.messages is None

    @property
    def prompt_field(self) -> str:
        return self.prompt_param or ("messages" if self.messages is not None else "prompt")

    @property
    def forced_tool_call(self) -> bool:
        return self.tool_choice not in (None, "auto", "none")

    def constrained_param(self) -> Optional[str]:
        """The request field that put a grammar on the output, for errors that name it."""
        if self.forced_tool_call:
            return "tool_choice"
        return "response_format" if self.response_format is not None else None
