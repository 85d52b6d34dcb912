"""The layout shows the architecture, and stays that way.

One direction: ``proto/`` <- ``shards/`` <- ``server/`` (and ``bench/``): a stage
never imports the head. Inside ``shards/``, five rooms on floors: ``params/`` <
``cache/`` < ``models/`` < ``net/`` < ``worker/``. Inside the head, four rooms:
``cli/`` -> ``api/`` -> ``core/`` <- ``cluster/``, and the config tree
(``server/config.py``) a leaf they all take; ``core/`` knows neither HTTP nor gRPC, and
``core/frames.py`` is its one door to the wire. No import cycles; no module or
function too long to read.

Each package's modules are imported in a fresh interpreter with what they must
not reach blocked, and every import statement in their source, function-local
ones included, is checked too (an import inside a function runs only when called).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import pytest

import mlxpipe.bench
import mlxpipe.proto
import mlxpipe.server
import mlxpipe.shards

ROOTS = {"mlxpipe.proto": mlxpipe.proto, "mlxpipe.shards": mlxpipe.shards, "mlxpipe.server": mlxpipe.server,
         "mlxpipe.bench": mlxpipe.bench}
GENERATED = ("pipeline_pb2.py", "pipeline_pb2_grpc.py")
WIRE = ("mlxpipe.proto.pipeline_pb2", "mlxpipe.proto.pipeline_pb2_grpc")


def _sources() -> Dict[str, Path]:
    """Every module of the four packages (subpackages included): name -> file."""
    out = {}
    for name, package in ROOTS.items():
        root = Path(package.__path__[0])
        for path in sorted(root.rglob("*.py")):
            if ".venv" in path.parts or path.name in GENERATED:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([name, *parts])] = path
    return out


SOURCES = _sources()


def _imported_names(path: Path, module: str) -> Set[str]:
    """Every module name an import statement in ``path`` names, wherever the statement sits."""
    names = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def _within(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _modules(package: str) -> List[str]:
    return [m for m in SOURCES if _within(m, [package])]


def _imports(module: str) -> Set[str]:
    return _imported_names(SOURCES[module], module)


# package -> what its modules must not import
FORBIDDEN = {
    "mlxpipe.proto": ("mlxpipe.shards", "mlxpipe.server", "mlxpipe.bench"),
    "mlxpipe.shards": ("mlxpipe.server", "mlxpipe.bench"),
    # shards/ on floors: params/ < cache/ < models/ < net/ < worker/ (each takes only rooms below it)
    "mlxpipe.shards.params": ("mlxpipe.shards.cache", "mlxpipe.shards.models", "mlxpipe.shards.net",
                              "mlxpipe.shards.worker"),
    "mlxpipe.shards.cache": ("mlxpipe.shards.models", "mlxpipe.shards.net", "mlxpipe.shards.worker"),
    "mlxpipe.shards.models": ("mlxpipe.shards.net", "mlxpipe.shards.worker"),
    "mlxpipe.shards.net": ("mlxpipe.shards.worker",),
    # the config tree, a leaf every room of the head takes: no room's parts, no engine, no I/O
    "mlxpipe.server.config": ("mlxpipe.server.api", "mlxpipe.server.cluster", "mlxpipe.server.cli", "grpc",
                              "fastapi", "starlette", "uvicorn", "mlxpipe.server.core.engine",
                              "mlxpipe.server.core.scheduler"),
    "mlxpipe.server.core": ("grpc", "fastapi", "starlette", "uvicorn", "mlxpipe.server.api",
                            "mlxpipe.server.cluster", "mlxpipe.server.cli", "mlxpipe.proto.pipeline_pb2_grpc",
                            "mlxpipe.proto.rpc"),
    "mlxpipe.server.cluster": ("mlxpipe.server.api", "mlxpipe.server.cli", "fastapi", "starlette", "uvicorn"),
    "mlxpipe.server.api": ("mlxpipe.server.cli",),
}
# In a fresh interpreter, with these blocked, every module of the package imports.
BLOCKED = {
    "mlxpipe.proto": FORBIDDEN["mlxpipe.proto"],
    "mlxpipe.shards": FORBIDDEN["mlxpipe.shards"],
    "mlxpipe.server.core": ("grpc", "fastapi", "starlette", "uvicorn", "mlxpipe.server.api",
                            "mlxpipe.server.cluster", "mlxpipe.server.cli"),
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_statement_points_the_wrong_way(package):
    for module in _modules(package):
        bad = sorted(n for n in _imports(module) if _within(n, FORBIDDEN[package]))
        assert not bad, f"{module} imports {bad}"


def test_the_api_takes_nothing_from_the_cluster():
    for module in _modules("mlxpipe.server.api"):
        bad = sorted(n for n in _imports(module) if _within(n, ["mlxpipe.server.cluster"]))
        assert not bad, f"{module} imports {bad}: the API gets the cluster's parts from the head it serves"


def test_only_frames_and_the_cluster_touch_the_wire_on_the_head():
    allowed = ["mlxpipe.server.core.frames", "mlxpipe.server.cluster"]
    touching = sorted(m for m in _modules("mlxpipe.server") if not _within(m, allowed)
                      and any(_within(n, WIRE) for n in _imports(m)))
    assert not touching, f"{touching} import pipeline_pb2: only core/frames.py and cluster/ speak the wire"


_IMPORT_BLOCKED = """
import importlib, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # any import of it or below raises ImportError
for module in sys.argv[2].split(","):
    importlib.import_module(module)
"""


@pytest.mark.parametrize("package", sorted(BLOCKED))
def test_modules_import_with_what_they_must_not_reach_blocked(package):
    blocked = ",".join(BLOCKED[package])
    proc = subprocess.run([sys.executable, "-c", _IMPORT_BLOCKED, blocked, ",".join(_modules(package))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


# -- no cycles --------------------------------------------------------------------------

CYCLES_ALLOWED: List[Set[str]] = []  # none: shards/models/layers.py broke the last (slicing <-> quantize)


def _graph() -> Dict[str, Set[str]]:
    """module -> the modules of ours its import statements name (a package's own
    __init__ is not implied by importing one of its modules)."""
    graph = {}
    for module in SOURCES:
        targets = set()
        for name in _imports(module):
            while name and name not in SOURCES:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[Set[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_modules():
    cycles = [c for c in _cycles(_graph()) if c not in CYCLES_ALLOWED]
    assert not cycles, f"import cycles: {[sorted(c) for c in cycles]}"


# -- sizes ----------------------------------------------------------------------------------

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
# Modules allowed over the limits (none now).
SIZE_ALLOWED: Set[str] = set()


def _sized() -> List[tuple]:
    """(path relative to the repository, source) of every module of server/, shards/, proto/."""
    out = []
    for module, path in SOURCES.items():
        if _within(module, ["mlxpipe.server", "mlxpipe.shards", "mlxpipe.proto"]):
            top = Path(ROOTS[".".join(module.split(".")[:2])].__path__[0])
            out.append((f"{top.name}/{path.relative_to(top)}", path.read_text()))
    return out


def test_no_module_is_too_long():
    long = [(rel, src.count("\n")) for rel, src in _sized()
            if rel not in SIZE_ALLOWED and src.count("\n") > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_too_long():
    long = []
    for rel, src in _sized():
        if rel in SIZE_ALLOWED:
            continue
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append((rel, node.name, lines))
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
