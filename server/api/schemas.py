"""OpenAI request bodies, validated at the HTTP edge (pydantic lives only in the API),
and the pieces other protocols' bodies may share (``bounded``, ``unicode_text``,
``Function``, ``ResponseFormat``; ``json_body.py`` has ``Body``, their base).

Sampling bounds come from ``Sampling.BOUNDS`` (OpenAI's where it has them;
the extensions mlx_lm.server accepts, ``top_k``, ``min_p`` and
``repetition_penalty``, are accepted too); ``sampling()`` turns a request into
the ``Sampling`` the engine takes (and checks). Unknown fields are ignored, as
OpenAI-compatible servers do, except the ones whose meaning we cannot honour,
which are refused.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from mlxpipe.server.api.json_body import Body, cache_salt_field
from mlxpipe.server.api.options import ApiOptions
from mlxpipe.server.api.request import image_part, request_sampling
from mlxpipe.server.core.drafting import DEFAULT_SPECULATION, SOURCES
from mlxpipe.shards.params.sampling import INT32, Sampling

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_N = 8
MAX_MESSAGES = 1024
MAX_LOGIT_BIAS = 300


def bounded(name: str, default=None):
    """A field bounded as ``Sampling.BOUNDS`` says."""
    b = Sampling.BOUNDS[name]
    low = {"gt": b.lo} if b.lo_open else {"ge": b.lo}
    return Field(default=default, le=b.hi, **low)


def stop_strings(v: Union[str, List[str], None]) -> List[str]:
    """Stop strings as every protocol bounds them (a pydantic validator's body)."""
    stops = [v] if isinstance(v, str) else (v or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
    if any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise ValueError(f"stop strings are at most {MAX_STOP_LENGTH} characters")
    if any(s == "" for s in stops):
        raise ValueError("stop strings must not be empty")
    for s in stops:
        unicode_text(s)
    return stops


def unicode_text(s: str) -> str:
    """Refuse text that is not valid Unicode (JSON lets an unpaired surrogate through)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"text contains an unpaired surrogate at position {err.start}: not valid Unicode") from None
    return s


# Content parts this server takes no model for, by what they hold.
NOT_TEXT_PARTS = {"input_audio": "audio", "audio": "audio", "file": "file", "input_file": "file"}


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: str = Field(min_length=1)
    detail: Optional[str] = None  # the processor sizes every image its own way: read, not used


class ContentPart(BaseModel):
    """One part of a message's content: text (or an assistant's refusal), or an image
    (``image_url``: a data URL, or an http(s) URL where the server fetches them); any
    other part is refused in words that name it."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str = ""
    refusal: str = ""
    image_url: Optional[ImageUrl] = None

    @field_validator("image_url", mode="before")
    @classmethod
    def _url(cls, v):
        return {"url": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _known(self):
        if self.type in NOT_TEXT_PARTS:
            raise ValueError(f"{NOT_TEXT_PARTS[self.type]} parts are not supported: this server takes text and images")
        if self.type == "image_url" and self.image_url is None:
            raise ValueError('an image_url part is {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}')
        if self.type not in ("text", "refusal", "image_url"):
            raise ValueError(f"unknown content part type '{self.type}': this server takes "
                             '{"type": "text", "text": "..."} and {"type": "image_url", "image_url": {"url": ...}} parts')
        return self


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[List[ContentPart]] = None  # a string arrives as one text part

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v):
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        if v is not None and not isinstance(v, list):
            raise ValueError("content is a string or a list of content parts")
        return v
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None  # assistant: the calls it made
    tool_call_id: Optional[str] = None           # tool: the call this answers

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        unicode_text(self.text())
        return self

    def for_template(self, images: Optional[list] = None, param: str = "messages") -> Dict[str, Any]:
        """The message as chat templates take it (``chat.template_messages`` does the rest): its
        text, or, where it holds images, its parts in order, each image's ref appended to ``images``."""
        m = {"role": self.role, "content": self.text()}
        if any(p.type == "image_url" for p in self.content or ()):
            m["content"] = [image_part(images, p.image_url.url, f"{param}.content.{j}")
                            if p.type == "image_url" else {"type": "text", "text": p.text or p.refusal}
                            for j, p in enumerate(self.content)]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                m[key] = getattr(self, key)
        if self.tool_calls:
            m["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return m

    def text(self) -> str:
        return "".join(p.text or p.refusal for p in self.content or ())


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class OpenAIRequest(Body):
    """What chat and text completions share: the model, sampling, stops, streaming."""

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = bounded("temperature")
    top_p: Optional[float] = bounded("top_p")
    top_k: Optional[int] = bounded("top_k")
    min_p: Optional[float] = bounded("min_p")
    repetition_penalty: Optional[float] = bounded("repetition_penalty")
    presence_penalty: float = bounded("presence_penalty", 0.0)
    frequency_penalty: float = bounded("frequency_penalty", 0.0)
    seed: Optional[int] = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    stop: Union[str, List[str], None] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[Dict[str, float]] = None
    # Speculative decoding (output is the same either way): what to draft from, and
    # mlx_lm.server's cap on drafted tokens (0: do not speculate).
    speculation: Literal[SOURCES] = DEFAULT_SPECULATION
    num_draft_tokens: Optional[int] = Field(default=None, ge=0, le=64)
    cache_salt: Optional[str] = cache_salt_field()
    # A request may lower its own priority (core/priority.py): vLLM's ``priority`` (above 0:
    # batch) and OpenAI's ``service_tier`` ("flex": batch); it never rises above its key's class.
    priority: Optional[int] = Field(default=None, ge=-(1 << 31), lt=1 << 31)
    service_tier: Optional[str] = Field(default=None, max_length=32)

    @field_validator("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty")
    @classmethod
    def _finite(cls, v):
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return stop_strings(v)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v and len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries")
        for k, b in (v or {}).items():
            if not k.removeprefix("-").isdecimal() or not -INT32 <= int(k) < INT32:
                raise ValueError(f"logit_bias keys are token ids, got {k!r}")
            if not Sampling.LOGIT_BIAS.holds(b):
                raise ValueError(f"logit_bias values are in {Sampling.LOGIT_BIAS.describe()}, got {b}")
        return v

    def stop_strings(self) -> List[str]:
        return list(self.stop or [])

    def want_logprobs(self) -> Tuple[bool, int]:
        """(report the chosen tokens' log-probabilities, alternatives per token)."""
        raise NotImplementedError

    def sampling(self, options: ApiOptions) -> Sampling:
        """The request's ``Sampling`` (its choices differ by seed: ``Generator.start``)."""
        logprobs, top = self.want_logprobs()
        return request_sampling(
            options,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            logprobs=logprobs,
            top_logprobs=top,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
        )

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class Function(BaseModel):
    # OpenAI's rule for function names; it also keeps the chat template's markers
    # and quotes out of them (a name is written into the prompt and the grammar).
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None  # a JSON schema
    strict: Optional[bool] = None


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchema(BaseModel):
    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchema] = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema response_format needs its json_schema")
        return self

    def as_dict(self) -> Dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


# Arguments of apply_chat_template that chat_template_kwargs must not set.
RESERVED_TEMPLATE_ARGS = frozenset({"conversation", "messages", "tools", "documents", "add_generation_prompt",
                                    "tokenize", "return_dict", "return_tensors", "chat_template", "tokenizer_kwargs",
                                    "continue_final_message", "padding", "truncation", "max_length"})


class ChatCompletionRequest(OpenAIRequest):
    messages: List[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[int] = bounded("top_logprobs")
    tools: Optional[List[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: StrictBool = True
    response_format: Optional[ResponseFormat] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None

    @model_validator(mode="after")
    def _supported(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice asks for a tool call, and no tools were given")
        forced = self.tool_choice not in (None, "none", "auto")
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("a forced tool call and a response_format cannot both be enforced")
        reserved = sorted(RESERVED_TEMPLATE_ARGS & (self.chat_template_kwargs or {}).keys())
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r}")
        return self

    def tool_dicts(self) -> Optional[List[Dict[str, Any]]]:
        """The tools for the chat template (none when tool_choice is "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def choice(self) -> Any:
        """tool_choice as plain data."""
        return self.tool_choice.model_dump() if isinstance(self.tool_choice, BaseModel) else self.tool_choice

    def token_budget(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    def want_logprobs(self) -> Tuple[bool, int]:
        return self.logprobs, self.top_logprobs or 0


class CompletionRequest(OpenAIRequest):
    # Text or token ids; a list of one of either (a batch of one, as lm-evaluation-harness
    # sends) is that prompt. Larger batches are refused.
    prompt: Union[str, List[int]]
    max_tokens: Optional[int] = Field(default=None, ge=0)  # 0, with echo: score the prompt, generate nothing
    logprobs: Optional[int] = Field(default=None, ge=0, le=5)
    echo: StrictBool = False  # the prompt first, with its tokens' log-probabilities when logprobs is set
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"batched prompts are not served: send one prompt per request, not {len(v)}")
            v = v[0]
        if not isinstance(v, (str, list)) or (isinstance(v, list) and not all(type(t) is int for t in v)):
            raise ValueError("the prompt is a string, a list of token ids, or a list of one of either")
        return v

    @model_validator(mode="after")
    def _supported(self):
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported by this server")
        if not self.prompt:
            raise ValueError("the prompt is empty")
        if self.prompt_text() is not None:
            unicode_text(self.prompt_text())
        return self

    def prompt_text(self) -> Optional[str]:
        """The prompt as text to tokenize; None when it is already token ids."""
        return self.prompt if isinstance(self.prompt, str) else None

    def sampling(self, default_temperature: float) -> Sampling:
        return replace(super().sampling(default_temperature), prompt_logprobs=self.echo and self.logprobs is not None)

    def token_budget(self) -> Optional[int]:
        return self.max_tokens

    def want_logprobs(self) -> Tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0
