"""Grammars for structured output, built and checked on the head.

A request's ``response_format`` (``json_object``, ``json_schema``) or forced
``tool_choice`` (``required``, a named function) becomes an llguidance grammar
string here (objects that list their properties allow no others unless the
schema says so: ``schema_limits.closed_objects``); it travels with the sequence's sampling parameters and the last
stage enforces it (``shards/models/grammar.py``). A schema or grammar that cannot be
enforced raises ``GrammarError`` while the request can still get a 400.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any, List, Mapping, Optional, Sequence

import llguidance as llg

from mlxpipe.server.api.schema_limits import check_schema, check_schemas, closed_objects
from mlxpipe.shards.models.grammar import GrammarError, check_output, tokenizer_from_json
from mlxpipe.shards.models.tokenizer_json import tokenizer_json  # (re-exported: bench and tests take it from here)

# One separator style and no free whitespace: a sampled model cannot pad with
# spaces or newlines until it runs out of tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _schema_grammar(schema: Mapping[str, Any], strict: bool) -> str:
    options = dict(JSON_OPTIONS, lenient=not strict)  # strict: a keyword it cannot enforce is an error
    try:
        return llg.LLMatcher.grammar_from_json_schema(closed_objects(dict(schema)), overrides=options)
    except ValueError as err:
        raise GrammarError(str(err)) from err


def response_format_grammar(response_format: Optional[Mapping[str, Any]]) -> str:
    """OpenAI's ``response_format`` as a grammar ("" for plain text). Call on
    ``shards.grammar.worker()``: a schema within the limits still compiles recursively."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return ""
    if kind == "json_object":
        return _schema_grammar({"type": "object"}, strict=True)
    spec = response_format.get("json_schema") or {}
    schema = spec.get("schema") or {"type": "object"}
    check_schema(schema)
    return _schema_grammar(schema, bool(spec.get("strict")))


def _marker(text: str, tokenizer) -> str:
    """A tool-call marker in Lark: the special token itself when it is one, else its text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and ids[0] in set(tokenizer.all_special_ids):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def marked_calls(tokenizer) -> bool:
    """Whether the chat template writes tool calls as JSON between markers (mlx-lm's
    ``json_tools`` parser: Qwen, Hermes and the like): then a forced call is written
    in that format; for any other model it is bare JSON (``bare_call_grammar``)."""
    return getattr(tokenizer.tool_parser, "__module__", "").endswith(".json_tools")


def _call_variants(functions: Sequence[Mapping[str, Any]]) -> List[dict]:
    return [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}}}
            for f in functions]


def bare_call_grammar(functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
    """A forced call for a model whose template has no JSON tool-call markers (vLLM's
    way): one function's output is its arguments, a JSON object following its schema;
    a choice among several is ``{"name", "arguments"}``, and with ``parallel`` a JSON
    array of one or more of those. ``chat.ForcedReply`` reads it back."""
    check_schemas([(f"function {f['name']!r}", f.get("parameters") or {}) for f in functions])
    if len(functions) == 1:
        schema = dict(functions[0].get("parameters") or {"type": "object"})
    else:
        call = {"anyOf": _call_variants(functions)}
        schema = {"type": "array", "items": call, "minItems": 1} if parallel else call
    return _schema_grammar(schema, all(f.get("strict") for f in functions))


def tool_call_grammar(tokenizer, functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
    """A grammar for one (or, with ``parallel``, one or more) calls of ``functions``
    in the chat template's format: JSON ``{"name", "arguments"}`` between the tool
    parser's markers (``marked_calls``)."""
    check_schemas([(f"function {f['name']!r}", f.get("parameters") or {}) for f in functions])
    variants = _call_variants(functions)
    strict = all(f.get("strict") for f in functions)
    schema = dict(closed_objects(variants[0] if len(variants) == 1 else {"anyOf": variants}),
                  **{"x-guidance": dict(JSON_OPTIONS, lenient=not strict)})
    begin, end = _marker(tokenizer.tool_call_start, tokenizer), _marker(tokenizer.tool_call_end, tokenizer)
    start = "start: call+" if parallel else "start: call"
    lark = f'{start}\ncall: {begin} "\\n" %json {json.dumps(schema)} "\\n" {end}\n'
    try:
        return llg.LLMatcher.grammar_from_lark(lark)
    except ValueError as err:
        raise GrammarError(str(err)) from err


class Grammars:
    """Checks grammars against the model's tokenizer (llguidance's, built at once:
    building it holds the GIL for 0.2-2 s, which, on a serving head, would stall
    every stream; so it happens before the server takes requests)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock = threading.Lock()
        self._ll  # noqa: B018 - built now, see above

    @functools.cached_property
    def _ll(self) -> llg.LLTokenizer:
        return tokenizer_from_json(tokenizer_json(self.tokenizer), self.vocab_size,
                                   sorted(self.tokenizer.eos_token_ids))

    def check(self, grammar: str) -> str:
        """``grammar``, once it compiles for this model and admits some output (call on
        ``shards.grammar.worker()``: the first call builds the tokenizer, ~0.3 s)."""
        if grammar:
            with self._lock:
                ll = self._ll
            check_output(grammar, ll)
        return grammar


def forced_functions(tools: List[Mapping[str, Any]], tool_choice: Any) -> Optional[List[Mapping[str, Any]]]:
    """The functions one of which must be called (None: the model may answer in text)."""
    if tool_choice in (None, "auto", "none"):
        return None
    functions = [t["function"] for t in tools]
    if tool_choice == "required":
        return functions
    name = tool_choice["function"]["name"]
    named = [f for f in functions if f["name"] == name]
    if not named:
        raise GrammarError(f"tool_choice names the function {name!r}, which is not among the tools")
    return named
