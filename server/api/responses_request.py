"""The Responses API's request body (``POST /v1/responses``), validated at the HTTP
edge: every nested shape (input items and their content parts, tools, ``tool_choice``,
``text.format``) a pydantic model, so a malformed body is a 400 naming the field's
path before any work. Items with nothing for the model (reasoning, item references,
server tools' items) are accepted unread; ``ResponsesRequest.items`` gives the input
as the compact items a conversation keeps (``openai_responses.py``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from mlxpipe.server.api.json_body import Body, by_type, cache_salt_field

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
NOT_TEXT = ("input_file", "input_audio")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal[TEXT_PARTS]
    text: str


class ImagePart(BaseModel):
    """An image: ``image_url`` a data URL, or an http(s) URL where the server fetches them."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["input_image"]
    image_url: Optional[str] = None
    file_id: Optional[str] = None
    detail: Optional[str] = None  # the processor sizes every image its own way: read, not used

    @model_validator(mode="after")
    def _url(self):
        if not self.image_url:
            raise ValueError("an input_image part carries its image_url (a data URL or an http(s) URL); this "
                             "server keeps no files, so file_id is not taken")
        return self


class NotTextPart(BaseModel):
    """A part this server takes no model for: refused, in words that name it."""

    model_config = ConfigDict(extra="ignore")

    type: Literal[NOT_TEXT]

    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError(f"{self.type} parts are not supported: this server takes text and input_image parts")


Part = by_type({**dict.fromkeys(TEXT_PARTS, TextPart), "input_image": ImagePart,
                **dict.fromkeys(NOT_TEXT, NotTextPart)})  # refusals: left out


def _text(content: Union[str, List[Part]]):
    """Content in the compact form a conversation keeps: its text, or, where it holds images,
    its parts in order (``{"type": "text", "text"}``, ``{"type": "image", "url"}``)."""
    if isinstance(content, str):
        return content
    if any(isinstance(p, ImagePart) for p in content):
        return [{"type": "image", "url": p.image_url} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                for p in content if isinstance(p, (TextPart, ImagePart))]
    return "".join(p.text for p in content if isinstance(p, TextPart))


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, List[Part]]

    def item(self) -> dict:
        return {"type": "message", "role": self.role, "content": _text(self.content)}


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str = ""
    id: Optional[str] = None
    name: str
    arguments: str  # JSON text, as the model wrote it

    def item(self) -> dict:
        return {"type": "function_call", "call_id": self.call_id or self.id or "", "name": self.name,
                "arguments": self.arguments}


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, List[Part]]

    def item(self) -> dict:
        return {"type": "function_call_output", "call_id": self.call_id, "output": _text(self.output)}


# Reasoning items (the model's own), item references and server tools' items: nothing to show
# the model, so accepted, unread and not kept.
Item = by_type({"message": MessageItem, "function_call": FunctionCallItem,
                "function_call_output": FunctionCallOutputItem}, default="message")


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    # The rule the README states (OpenAI's): a name is written into the prompt and the grammar.
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None

    def function(self) -> dict:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


ToolSpec = by_type({"function": FunctionTool})  # other tools (web search, ...): not served, left out


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs its schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # verbosity, ...: echoed, not used

    format: Optional[TextFormat] = None


class ResponsesRequest(Body):
    """The Responses API's request body; fields not listed are accepted and ignored."""

    model: str
    input: Union[str, List[Item]] = Field(min_length=1)
    instructions: Optional[str] = None
    tools: Optional[List[ToolSpec]] = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, None] = None
    parallel_tool_calls: StrictBool = True
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    text: Optional[TextConfig] = None
    priority: Optional[int] = Field(default=None, ge=-(1 << 31), lt=1 << 31)  # above 0: batch (core/priority.py)
    service_tier: Optional[str] = Field(default=None, max_length=32)  # "flex": batch
    store: StrictBool = True
    previous_response_id: Optional[str] = None
    stream: StrictBool = False
    metadata: Optional[Dict[str, str]] = None
    reasoning: Optional[Dict[str, Any]] = None
    cache_salt: Optional[str] = cache_salt_field()

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):  # OpenAI's bounds: it is echoed and stored
        if v and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("at most 16 pairs, keys of at most 64 characters, values of at most 512")
        return v

    def items(self) -> List[dict]:
        """The input as the items that mean something to the model, in their compact form."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [i.item() for i in self.input if isinstance(i, BaseModel)]
