"""docs/ARCHITECTURE.md names what exists, where it says, and places every module.

Every backticked ``module.py`` or ``path/module.py`` is a module of the project
(a bare name in a row of a table, of the folder the row is about); every
``Class.attribute`` is an attribute of one of our classes or a field of a wire
message; every ``module.name`` is defined in that module of ours; and a name
followed by its place, "`Class.method` (`path/module.py`)", or a module followed
by what it holds, "`module.py` (`Class`", is defined in that module.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import mlxpipe.server
from mlxpipe.proto import pipeline_pb2 as pb

REPO = Path(mlxpipe.server.__path__[0]).parent
DOC = REPO / "docs" / "ARCHITECTURE.md"
PACKAGES = ("proto", "shards", "server", "bench", "tests")
# First parts of dotted names that are not modules of ours: MLX, mlx-lm, a model's
# blocks and the protocols' JSON fields, which the text names as examples.
NOT_OURS = {"mx", "mlx_lm", "layer", "text", "output_config", "usage"}
FILES = re.compile(r"\.(json|md|txt|js|proto|safetensors|png|yaml|toml)$")


def _modules() -> Dict[str, Path]:
    """path relative to the repository -> file, for every module of the project."""
    return {str(p.relative_to(REPO)): p for d in PACKAGES for p in sorted((REPO / d).rglob("*.py"))
            if ".venv" not in p.parts}


MODULES = _modules()


class _Defs:
    """What a module defines: top-level names, and per class its attributes and bases."""

    def __init__(self, path: Path):
        parsed = ast.parse(path.read_text(), str(path))
        self.top: Set[str] = set()
        self.classes: Dict[str, Tuple[Set[str], List[str]]] = {}
        for node in parsed.body:
            self.top.update(_targets(node))
        for node in ast.walk(parsed):
            if isinstance(node, ast.ClassDef):
                attrs: Set[str] = set()
                for item in node.body:
                    attrs.update(_targets(item))
                for item in ast.walk(node):  # instance attributes: self.x = ...
                    if isinstance(item, (ast.Assign, ast.AnnAssign)):
                        for t in item.targets if isinstance(item, ast.Assign) else [item.target]:
                            if isinstance(t, ast.Attribute) and getattr(t.value, "id", "") == "self":
                                attrs.add(t.attr)
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                self.classes[node.name] = (attrs, bases)


def _targets(node) -> Set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    return set()


DEFS = {rel: _Defs(path) for rel, path in MODULES.items()}


def _has(cls: str, attr: Optional[str], where: Optional[str] = None, seen=()) -> bool:
    """Whether one of our classes named ``cls`` (in ``where``, if given) has ``attr``
    (its own, an instance attribute, or a base class's of ours)."""
    for rel, defs in DEFS.items():
        if (where is None or rel == where) and cls in defs.classes:
            attrs, bases = defs.classes[cls]
            if attr is None or attr in attrs or any(_has(b, attr, None, seen + (cls,)) for b in bases
                                                    if b not in seen):
                return True
    return False


def _message_has(name: str, attr: str) -> bool:
    msg = pb.DESCRIPTOR.message_types_by_name.get(name)
    if msg is None:
        return False
    return attr in msg.fields_by_name or attr in msg.nested_types_by_name or attr in msg.enum_values_by_name


def _resolve(path: str, folder: Optional[str]) -> Optional[str]:
    """The module a path in the text names: from the repository's root, a room of the
    head (``core/frames.py``), or, bare, the table row's folder."""
    for candidate in ([f"{folder}{path}"] if folder and "/" not in path else []) + [path, f"server/{path}"]:
        if candidate in MODULES:
            return candidate
    if "/" not in path and folder is None:
        found = [rel for rel in MODULES if rel.endswith("/" + path)]
        return found[0] if found else None
    return None


def _tokens(doc: Path = DOC) -> Iterator[Tuple[str, str, Optional[str], str]]:
    """(token, the text right after it, lines joined, the folder of the table row it
    sits in, and its line), for every backticked name of ``doc`` outside code blocks."""
    text = re.sub(r"```.*?```", lambda m: " " * len(m.group(0)), doc.read_text(), flags=re.S)
    flat, starts = text.replace("\n", " "), [m.start() for m in re.finditer(r"^", text, flags=re.M)]
    lines = text.splitlines()
    for m in re.finditer(r"`([^`\s]+)`", flat):
        line = lines[sum(1 for s in starts if s <= m.start()) - 1]
        row = re.match(r"\|\s*`([\w/]+/)`", line)
        yield m.group(1), flat[m.end():m.end() + 200], row.group(1) if row else None, line.strip()[:80]


def _follows(after: str) -> Optional[str]:
    """The module named right after a token: " (`path/module.py`", ", from `path/module.py`"."""
    m = re.match(r"\s*(?:\(|,\s*from\s+)`([\w/]+\.py)`", after)
    return m.group(1) if m else None


def _check(token: str, after: str, folder: Optional[str]) -> Optional[str]:
    """What is wrong with one token (None: nothing)."""
    if token.endswith(".py"):
        rel = _resolve(token, folder)
        if rel is None:
            return "no such module"
        holds = re.match(r"\s*\(`([A-Z]\w*)", after)  # `module.py` (`Class`: ...
        if holds and holds.group(1) not in DEFS[rel].top:
            return f"{holds.group(1)} is not defined there"
        return None
    m = re.fullmatch(r"([A-Za-z_]\w*)\.([A-Za-z_]\w*)", token)
    if m is None or FILES.search(token):
        cls = re.fullmatch(r"[A-Z]\w*", token)
        place = _follows(after)
        if cls and place and _has(token, None) and not _has(token, None, _resolve(place, None)):
            return f"is not in {place}"
        return None
    first, name = m.groups()
    if first[0].isupper():
        place = _follows(after)
        if place and _has(first, None):
            where = _resolve(place, None)
            return None if where and _has(first, name, where) else f"is not in {place}"
        return None if _has(first, name) or _message_has(first, name) else "no such class attribute or field"
    if first == "pb":
        return None if name in pb.DESCRIPTOR.message_types_by_name else "no such message"
    if first == "mlxpipe":
        return None if importlib.util.find_spec(token) else "no such package"
    if first in NOT_OURS:
        return None
    owners = [rel for rel in MODULES if Path(rel).stem == first]
    if not owners:
        return f"{first} is no module of ours"
    return None if any(name in DEFS[rel].top for rel in owners) else f"{first} defines no {name}"


def test_the_architecture_names_what_exists_where_it_says():
    wrong = [f"`{token}` {why}: {line}" for token, after, folder, line in _tokens()
             if (why := _check(token, after, folder))]
    assert not wrong, "docs/ARCHITECTURE.md names what is not there:\n" + "\n".join(wrong)


def test_the_architecture_names_every_module():
    named = {_resolve(token, folder) for token, _, folder, _ in _tokens() if token.endswith(".py")}
    unnamed = [rel for rel in MODULES if not rel.startswith("tests/") and Path(rel).name != "__init__.py"
               and rel not in named]
    assert not unnamed, f"modules docs/ARCHITECTURE.md does not place: {unnamed}"


def test_the_checker_catches_what_the_text_got_wrong_once():
    assert _check("rebuild.py", "", "server/cluster/") is None
    assert _check("budget.py", "", "server/api/") == "no such module"
    assert _check("Cluster.rebuild", " (`server/cluster/rebuild.py`)", None) == "is not in server/cluster/rebuild.py"
    assert _check("Cluster.rebuild", " (`server/cluster/assembly.py`)", None) is None
    assert _check("draft.Either", "", None) == "draft is no module of ours"
    assert _check("drafting.Either", "", None) is None
    assert _check("engine.py", " (`StageCaches`: ...", "server/core/") == "StageCaches is not defined there"
    assert _check("Speculator.nothing", "", None) == "no such class attribute or field"
    assert _check("LoadReply.starts", "", None) is None
