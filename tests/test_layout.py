"""One direction: ``proto/`` <- ``shards/`` <- ``server/`` (and ``bench/``). A stage never imports the head.

Each module is imported in a fresh interpreter with the packages it must not
reach blocked, and every import statement in its source, function-local ones
included, is checked too (an import inside a function runs only when called).
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import mlxpipe.proto
import mlxpipe.shards

# package -> the packages it must not import
FORBIDDEN = {
    "mlxpipe.proto": ("mlxpipe.shards", "mlxpipe.server", "mlxpipe.bench"),
    "mlxpipe.shards": ("mlxpipe.server", "mlxpipe.bench"),
}
PACKAGES = {"mlxpipe.proto": mlxpipe.proto, "mlxpipe.shards": mlxpipe.shards}


def _modules(package: str) -> list:
    return sorted(f"{package}.{m.name}" for m in pkgutil.iter_modules(PACKAGES[package].__path__))


def _imported_names(path: Path, module: str) -> set:
    """Every module name an import statement in ``path`` names, wherever the statement sits."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.rsplit(".", node.level)[0]
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def _within(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_statement_points_up(package):
    for module in _modules(package):
        path = Path(PACKAGES[package].__path__[0]) / (module.rsplit(".", 1)[1] + ".py")
        bad = sorted(n for n in _imported_names(path, module) if _within(n, FORBIDDEN[package]))
        assert not bad, f"{module} imports {bad}"


_IMPORT_BLOCKED = """
import importlib, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # any import of it or below raises ImportError
for module in sys.argv[2].split(","):
    importlib.import_module(module)
"""


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_modules_import_with_the_head_blocked(package):
    blocked = ",".join(FORBIDDEN[package])
    proc = subprocess.run([sys.executable, "-c", _IMPORT_BLOCKED, blocked, ",".join(_modules(package))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
