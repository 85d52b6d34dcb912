"""Bounds on a JSON schema, checked on the head before native code sees it.

llguidance compiles a schema recursively and builds a parser whose rows grow
with what one object may hold: a 3,000-link ``$ref`` chain overflowed the stack
of the thread that compiled it (and took the head down), and an object of 500
optional properties compiles, then fails at the second token of the output
("ParserTooComplex"). So every schema that would become a grammar
(``response_format``, a forced tool's ``parameters``, the Responses API's
``text.format``) passes ``check_schema`` first, and one over a limit is a 400
that names the limit. The walk is iterative and memoized: no schema makes it
recurse deeply or take long.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Tuple

from mlxpipe.shards.models.grammar import GrammarError


@dataclass(frozen=True)
class SchemaLimits:
    max_bytes: int = 256 << 10        # the schema as compact JSON
    max_depth: int = 64               # nesting of subschemas, each $ref followed counting as a level
    max_ref_chain: int = 16           # $refs in a row that point at a $ref
    max_nodes: int = 20_000           # subschemas in the whole schema
    max_properties: int = 256         # properties of one object (llguidance's parser fails near 500 optional)
    max_total_properties: int = 5_000  # properties in the whole schema (OpenAI's structured-output limit)
    max_alternatives: int = 128       # entries of one anyOf / oneOf / allOf
    max_enum: int = 1_000             # values of one enum


LIMITS = SchemaLimits()

# Keywords whose value is a subschema, a list of them, or a map of them.
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class SchemaTooComplex(GrammarError):
    """A schema over one of ``SchemaLimits``; the message names the limit."""


def _children(node: Mapping[str, Any]) -> List[Any]:
    out = [node[k] for k in _ONE if isinstance(node.get(k), (dict, list))]
    for k in _LIST:
        if isinstance(node.get(k), list):
            out += node[k]
    for k in _MAP:
        if isinstance(node.get(k), dict):
            out += list(node[k].values())
    return [c for c in out if isinstance(c, (dict, list))]


def _count(schema: Any, limits: SchemaLimits) -> None:
    """Sizes that need no $ref resolution: nodes, properties, alternatives, enums."""
    todo, nodes, props = [schema], 0, 0
    while todo:
        node = todo.pop()
        if isinstance(node, list):  # "items": [schema, ...] (draft 4)
            todo += [c for c in node if isinstance(c, (dict, list))]
            continue
        nodes += 1
        if nodes > limits.max_nodes:
            raise SchemaTooComplex(f"the schema has more than {limits.max_nodes} subschemas")
        n = len(node["properties"]) if isinstance(node.get("properties"), dict) else 0
        if n > limits.max_properties:
            raise SchemaTooComplex(f"an object of the schema has {n} properties; at most "
                                   f"{limits.max_properties} can be enforced")
        props += n
        for k in ("anyOf", "oneOf", "allOf"):
            if isinstance(node.get(k), list) and len(node[k]) > limits.max_alternatives:
                raise SchemaTooComplex(f"a {k} of the schema has {len(node[k])} entries; at most "
                                       f"{limits.max_alternatives} can be enforced")
        if isinstance(node.get("enum"), list) and len(node["enum"]) > limits.max_enum:
            raise SchemaTooComplex(f"an enum of the schema has {len(node['enum'])} values; at most "
                                   f"{limits.max_enum}")
        todo += _children(node)
    if props > limits.max_total_properties:
        raise SchemaTooComplex(f"the schema has {props} properties in all; at most {limits.max_total_properties}")


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` ("#", "#/$defs/a", any JSON pointer) names."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise GrammarError(f"$ref {ref!r} is not a reference within the schema (only '#...' refs are enforced)")
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise GrammarError(f"$ref {ref!r} points at nothing in the schema")
    return node


class _Depth:
    """Nesting depth through $refs, memoized per subschema and cut off past the limit,
    so that recursion never goes deeper than ``limit`` frames."""

    def __init__(self, root: Any, limits: SchemaLimits):
        self.root, self.limits = root, limits
        self.memo: Dict[int, int] = {}
        self.on_path: set = set()

    def below(self, node: Any, level: int) -> int:
        if not isinstance(node, (dict, list)) or id(node) in self.on_path:
            return 0  # a leaf, or recursion (the grammar keeps it lazy)
        if level > self.limits.max_depth:
            raise SchemaTooComplex(f"the schema nests deeper than {self.limits.max_depth} levels "
                                   f"(each $ref followed counts as one)")
        if id(node) in self.memo:
            return self.memo[id(node)]
        self.on_path.add(id(node))
        try:
            kids = list(node) if isinstance(node, list) else _children(node)
            if isinstance(node, dict) and "$ref" in node:
                kids.append(_resolve(self.root, node["$ref"]))
            depth = 1 + max((self.below(k, level + 1) for k in kids), default=0)
        finally:
            self.on_path.discard(id(node))
        self.memo[id(node)] = depth
        return depth


def _ref_chains(root: Any, limits: SchemaLimits) -> None:
    """No run of more than ``max_ref_chain`` $refs that each point at another $ref."""
    todo, seen = [root], set()
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo += node
            continue
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        hops, at, visited = 0, node, set()
        while isinstance(at, dict) and "$ref" in at and id(at) not in visited:
            visited.add(id(at))
            at = _resolve(root, at["$ref"])
            hops += 1
            if hops > limits.max_ref_chain:
                raise SchemaTooComplex(f"the schema has a chain of more than {limits.max_ref_chain} $refs "
                                       f"that each refer to another $ref")
        todo += _children(node)


def _json_size_over(node: Any, limit: int) -> bool:
    """Whether ``node`` written as compact JSON takes more than ``limit`` bytes (about:
    escapes not counted), walked only until it does: unlike ``json.dumps``, which
    holds the GIL (and so the event loop) for the whole of a multi-megabyte schema."""
    size, todo = 0, [node]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            size += 1 + sum(len(k) + 4 for k in node)  # braces, "key": and a comma each
            todo += node.values()
        elif isinstance(node, list):
            size += 1 + len(node)
            todo += node
        else:
            size += len(node) + 2 if isinstance(node, str) else len(str(node))
        if size > limit:
            return True
    return False


def check_schema(schema: Any, limits: SchemaLimits = LIMITS) -> None:
    """Raise ``SchemaTooComplex`` (a GrammarError) for a schema over ``limits``, or
    GrammarError for one that is no schema at all. Cost: linear in its size."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema is an object, not {type(schema).__name__}")
    if _json_size_over(schema, limits.max_bytes):
        raise SchemaTooComplex(f"the schema is more than {limits.max_bytes} bytes as JSON")
    _count(schema, limits)
    _ref_chains(schema, limits)
    _Depth(schema, limits).below(schema, 1)


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which an object that lists its ``properties`` and says
    nothing of others (no ``additionalProperties``, ``patternProperties`` or
    ``unevaluatedProperties``) allows no others: strict by default, as xgrammar compiles
    schemas and OpenAI's strict mode requires, so that a sampled model cannot pad a
    call with keys nobody declared. An object that lists no properties stays open, and
    so do an ``allOf`` and its members (closing one would refuse the others' keys).
    Iterative; run after ``check_schema``."""
    schema = copy.deepcopy(schema)
    todo = [(schema, False)]
    while todo:
        node, in_all_of = todo.pop()
        if isinstance(node, list):
            todo += [(c, False) for c in node]
            continue
        if (not in_all_of and isinstance(node.get("properties"), dict)
                and not {"additionalProperties", "patternProperties", "unevaluatedProperties", "allOf"} & node.keys()):
            node["additionalProperties"] = False
        members = node.get("allOf") if isinstance(node.get("allOf"), list) else []
        todo += [(c, any(c is m for m in members)) for c in _children(node)]
    return schema


def check_schemas(schemas: List[Tuple[str, Any]], limits: SchemaLimits = LIMITS) -> None:
    """``check_schema`` on each (name, schema); the error names which one failed."""
    for name, schema in schemas:
        try:
            check_schema(schema, limits)
        except GrammarError as err:
            raise type(err)(f"{name}: {err}") from err
