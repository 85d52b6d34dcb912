"""A request body as JSON, before any protocol reads it.

JSON readers let through what nothing downstream can take: ``NaN``, ``Infinity``
(``1e999`` too), lone surrogates (``"\\ud800"``), and nesting deeper than the
chat template's code and the JSON writers can walk. ``Body``, the base of every
protocol's top-level body, refuses them anywhere in it (``check_json``), naming
the field's path, so that what a reply echoes is always valid JSON. ``by_type``
makes the union of models a list of blocks or items is read with, told apart by
their "type"; ``cache_salt_field`` is the ``cache_salt`` every protocol takes.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Dict, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

MAX_NESTING = 256  # levels of arrays and objects in a body (a tool's schema of 64 levels takes about 130)


def _bad_value(value, path: str) -> Optional[Tuple[str, str]]:
    """(the path, what is wrong) of the first value JSON let through that nothing
    downstream can take: a non-finite number or a string (or key) with a lone surrogate."""
    stack = [(value, path)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return where, f"must be a finite number, got {v}"
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as err:
                return where, f"text contains an unpaired surrogate at position {err.start}: not valid Unicode"
        elif isinstance(v, dict):
            for k, item in reversed(v.items()):
                key = f"{where}.{k}" if where else str(k)
                if isinstance(k, str) and _bad_value(k, key) is not None:
                    return key, "a key contains an unpaired surrogate: not valid Unicode"
                stack.append((item, key))
        elif isinstance(v, list):
            stack.extend((item, f"{where}.{i}" if where else str(i)) for i, item in reversed(list(enumerate(v))))
    return None


def _too_deep(value) -> Optional[str]:
    """The path of the first array or object nested past ``MAX_NESTING`` levels, if any."""
    stack = [(value, 0, None)]  # (container, its depth, (key, parent's entry)), paths made only when needed
    while stack:
        entry = stack.pop()
        v, depth = entry[0], entry[1]
        for k, item in v.items() if isinstance(v, dict) else enumerate(v):
            if isinstance(item, (dict, list)):
                if depth >= MAX_NESTING:
                    path, at = [str(k)], entry
                    while at[2] is not None:
                        path.append(str(at[2][0]))
                        at = at[2][1]
                    return ".".join(reversed(path))
                stack.append((item, depth + 1, (k, entry)))
    return None


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_INNERMOST = re.compile(r"[\[{][^\[\]{}]*[\]}]")


def _deeper_than(text: str, levels: int) -> bool:
    """Whether JSON ``text`` nests arrays and objects past ``levels``: at C speed, by
    taking out its strings, then its innermost arrays and objects, ``levels`` times."""
    if text.count("[") + text.count("{") <= levels:
        return False
    text = _STRING.sub("", text)
    for _ in range(levels):
        text, n = _INNERMOST.subn("", text)
        if not n:
            return False
    return "[" in text or "{" in text


def check_json(value) -> None:
    """Refuse, naming the field's path, what JSON readers let through and no reply
    could echo: NaN, Infinity (``1e999`` too) and lone surrogates, anywhere in a body;
    and nesting past ``MAX_NESTING`` levels, which the chat template's code and the
    JSON writers could not walk. The common case is C-speed (``json.dumps``, regular
    expressions); only a failure walks the body for the path."""
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")
        deep = _too_deep(value) if _deeper_than(text, MAX_NESTING) else None
    except RecursionError:
        deep = _too_deep(value)
    except (ValueError, UnicodeEncodeError, TypeError):
        deep = None
        bad = _bad_value(value, "")
        if bad is not None:
            raise PydanticCustomError("json_value", "{path}: {why}",
                                      {"path": bad[0] or "the request body", "why": bad[1], "param": bad[0]})
    if deep is not None:
        raise PydanticCustomError("json_value", "{path}: {why}", {
            "path": deep, "why": f"nested deeper than {MAX_NESTING} levels of arrays and objects", "param": deep})


def by_type(kinds: Dict[str, type], default: Optional[str] = None) -> Any:
    """A union of models picked by a value's "type": ``kinds`` maps types to models; a
    value of any other type (a block, item or tool with nothing for this server: a
    server tool's, the model's reasoning) is accepted as it is, unread; a value without
    a type is of type ``default`` (None: refused). Members are tagged by their model's
    name, which an error's path leaves out (``errors.validation_message``)."""
    models = list(dict.fromkeys(kinds.values()))

    def tag(value) -> Optional[str]:
        if isinstance(value, BaseModel):
            return type(value).__name__
        kind = value.get("type", default) if isinstance(value, dict) else None
        if not isinstance(kind, str):
            return None  # pydantic: "unable to extract tag", at the value's path
        return kinds[kind].__name__ if kind in kinds else "Other"

    listed = ", ".join(repr(k) for k in kinds)
    # Any other type: unread (a dict: tag() saw to it).
    members = tuple(Annotated[m, Tag(m.__name__)] for m in models) + (Annotated[Any, Tag("Other")],)
    return Annotated[Union[members],
                     Discriminator(tag, custom_error_type="type_missing",
                                   custom_error_message=f'must be an object with a string "type" ({listed}, ...)')]


def cache_salt_field():
    """vLLM's ``cache_salt`` (every protocol takes it): prefixes are reused only between
    requests that send the same salt (under the same API key)."""
    return Field(default=None, min_length=1, max_length=256)


class Body(BaseModel):
    """A request body: every protocol's top-level model derives from it, so non-finite
    numbers and lone surrogates are refused anywhere in it (``check_json``) before
    its fields are read; what a reply echoes is then always valid JSON."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_json(cls, data):
        check_json(data)
        return data
