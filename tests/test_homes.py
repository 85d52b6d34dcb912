"""One home for each fact.

- The head's core, the sampling parameters and the config tree are pure: importing
  any of them (each on its own, from an interpreter that has loaded nothing of
  ours) loads neither MLX, the grammar engine nor gRPC (nor the HTTP stack); the
  config tree loads no other module of the cluster's room. A command the CLI names
  by string never imports the CLI (an edge no import statement shows).
- Each default of the config tree (``server/config.py``, and its API section in
  ``server/api/options.py``) is written once:
  no other place of the head or the benchmarks binds the knob's name to the same
  literal value (a field, a parameter's default, a keyword, an option's default),
  no help text writes a default out by hand, and every command's option of a
  knob's name defaults to the tree's value. (``shards/`` cannot import the tree:
  a stage's own limits, ``ShardLimits``, are its own.)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

import mlxpipe.server
from mlxpipe.server import config as tree
from mlxpipe.server.api import options as api_options

REPO = Path(mlxpipe.server.__path__[0]).parent
HEAVY = ("mlx", "mlx_lm", "llguidance", "grpc", "transformers", "fastapi", "starlette", "uvicorn")
# The vocabulary both sides agree on: every module of shards/params/ but its wire form.
PARAMS = sorted("mlxpipe.shards.params." + p.stem for p in (REPO / "shards" / "params").glob("*.py")
                if p.stem not in ("__init__", "wire"))
PURE = sorted(["mlxpipe.server.core." + p.stem for p in (REPO / "server" / "core").glob("*.py")
               if p.stem != "__init__"] + PARAMS + ["mlxpipe.server.config", "mlxpipe.server.api.schemas"])

# One interpreter, nothing of ours loaded; each module imported in a child forked from it.
_LOADED = """
import importlib, json, os, sys
out = {}
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(name)
            loaded = sorted(sys.modules)
        except BaseException as err:
            loaded = {"error": repr(err)}
        with os.fdopen(w, "w") as f:
            json.dump(loaded, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out[name] = json.load(f)
    os.waitpid(pid, 0)
print(json.dumps(out))
"""


def _loaded(modules: List[str]) -> Dict[str, List[str]]:
    """module -> the modules importing it loads, in an interpreter that had loaded none of ours."""
    proc = subprocess.run([sys.executable, "-c", _LOADED, *modules], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    failed = {m: v["error"] for m, v in out.items() if isinstance(v, dict)}
    assert not failed, failed
    return out


def test_pure_modules_load_no_mlx_grammar_or_grpc():
    loaded = _loaded(PURE)
    heavy = {m: sorted(n for n in mods if n.split(".")[0] in HEAVY)[:6] for m, mods in loaded.items()}
    assert not any(heavy.values()), {m: h for m, h in heavy.items() if h}
    config = "mlxpipe.server.config"  # the tree is a leaf of the head
    others = sorted(m for m in loaded[config] if m.startswith(("mlxpipe.server.cluster", "mlxpipe.server.api",
                                                               "mlxpipe.server.cli", "mlxpipe.server.core.engine",
                                                               "mlxpipe.server.core.scheduler.")))
    others += [m for m in loaded[config] if m == "mlxpipe.server.core.scheduler"]
    assert not others, f"the config tree imports {others}"


def test_the_api_schemas_and_the_vocabulary_load_no_protobuf():
    """What the HTTP edge validates a body with, and the parameters it fills in, need no wire."""
    loaded = _loaded(["mlxpipe.server.api.schemas", *PARAMS])
    wire = {m: sorted(n for n in mods if n.split(".")[0] in ("google", "grpc") or n.endswith("_pb2"))[:4]
            for m, mods in loaded.items()}
    assert not any(wire.values()), {m: w for m, w in wire.items() if w}


def _imported(path: Path) -> Set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_commands_named_by_string_do_not_import_the_cli():
    from mlxpipe.server.cli.main import COMMANDS

    for _, module, _ in COMMANDS:
        if module.startswith("mlxpipe.server.cli."):
            continue
        path = REPO / Path(*module.split(".")[1:]).with_suffix(".py")
        bad = sorted(n for n in _imported(path) if n == "mlxpipe.server.cli" or n.startswith("mlxpipe.server.cli."))
        assert not bad, f"{module} imports {bad}, and the CLI imports it by name: a cycle"


# -- each default written once --------------------------------------------------------------

SCANNED = ("server", "bench")  # the rooms that can take a default from the tree (shards/ cannot import it)
# Other names under which a knob's default goes (a constant of the tree names the knob it is for).
ALIASES = {"chunk_size": {"chunk_tokens", "chunk"}, "PLANNED_CONTEXT": {"context"}}
# The same name and value, another fact.
NOT_THE_KNOB = {
    ("server/cluster/local.py", "host"): "the address local stage processes listen on, not the HTTP API's",
    ("server/cluster/cost.py", "kv_bits"): "the precision a fresh cost's KV is at (the model's dtype), not the knob",
}


def _literal(node):
    """(value, True) for a literal expression (constants and operators on them), else (None, False)."""
    if node is None or any(isinstance(n, (ast.Name, ast.Attribute, ast.Call, ast.JoinedStr, ast.Subscript))
                           for n in ast.walk(node)):
        return None, False
    try:
        return eval(compile(ast.Expression(node), "<literal>", "eval"), {"__builtins__": {}}), True
    except Exception:  # noqa: BLE001 - not a value we can read
        return None, False


def _trivial(value) -> bool:
    """Values that mean "off" or "unset" everywhere, not one knob's choice."""
    return value is None or isinstance(value, bool) or value in (0, "") or value in ((), [])


def _dest(call: ast.Call) -> str:
    kw = {k.arg: k.value for k in call.keywords}
    if isinstance(kw.get("dest"), ast.Constant):
        return kw["dest"].value
    flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    longs = [f for f in flags if f.startswith("--")] or flags or ["?"]
    return longs[0].lstrip("-").replace("-", "_")


def _call_name(call: ast.Call) -> str:
    return getattr(call.func, "attr", None) or getattr(call.func, "id", None) or ""


def _bindings(tree_: ast.AST) -> Iterator[Tuple[int, str, object]]:
    """(line, name, value) wherever a literal is bound to a name: fields and assignments,
    parameters' defaults, keyword arguments, options' defaults, knobs' defaults."""
    for n in ast.walk(tree_):
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None:
            value = n.value
            if isinstance(value, ast.Call) and _call_name(value) == "knob" and value.args:
                value = value.args[0]
            yield (n.lineno, n.target.id, *_literal(value))
        elif isinstance(n, ast.Assign):
            for target in n.targets:
                if isinstance(target, ast.Name):
                    yield (n.lineno, target.id, *_literal(n.value))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = n.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            for arg, default in pairs:
                yield (default.lineno, arg.arg, *_literal(default))
        elif isinstance(n, ast.Call) and _call_name(n) == "add_argument":
            for k in n.keywords:
                if k.arg == "default":
                    yield (n.lineno, _dest(n), *_literal(k.value))
        elif isinstance(n, ast.Call):
            for k in n.keywords:
                if k.arg:
                    yield (k.value.lineno, k.arg, *_literal(k.value))


def _text(node) -> str:
    """A help written as plain text (constants, joined with +); "" for anything computed."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left) + _text(node.right)
    return ""


def _helps(tree_: ast.AST) -> Iterator[Tuple[int, str, str, object]]:
    """(line, name, help text, the option's own literal default) of every
    ``add_argument``, and every ``knob`` of a field, whose help is plain text."""
    for n in ast.walk(tree_):
        if isinstance(n, ast.AnnAssign) and isinstance(n.value, ast.Call) and _call_name(n.value) == "knob" \
                and isinstance(n.target, ast.Name):
            call, name = n.value, n.target.id
            kw = {k.arg: k.value for k in call.keywords}
            default = call.args[0] if call.args else kw.get("default")
            help_ = call.args[1] if len(call.args) > 1 else kw.get("help")
        elif isinstance(n, ast.Call) and _call_name(n) == "add_argument":
            call, name = n, _dest(n)
            kw = {k.arg: k.value for k in call.keywords}
            default, help_ = kw.get("default"), kw.get("help")
        else:
            continue
        text = _text(help_)
        if text:
            yield call.lineno, name, text, _literal(default)[0]


def _renderings(value) -> Set[str]:
    if isinstance(value, bool):
        return {str(value), "on" if value else "off"}
    out = {str(value)}
    if isinstance(value, float):
        out.add(f"{value:g}")
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        out.add(f"{value >> 20} MiB")
    return out


@functools.lru_cache(maxsize=None)
def _facts() -> List[Tuple[str, Set[str], object, str]]:
    """(knob, names it goes by, default, the file that writes the literal: the tree, or
    the module whose field or constant the tree takes it from)."""
    facts = []
    for section, module in ((tree.ClusterConfig, tree), (api_options.ApiOptions, api_options), (tree.Listen, tree)):
        rel = "/".join(module.__name__.split(".")[1:]) + ".py"
        parsed = ast.parse((REPO / rel).read_text())
        imported = {a.asname or a.name: n.module for n in ast.walk(parsed) if isinstance(n, ast.ImportFrom)
                    for a in n.names}
        expr = {n.target.id: n.value.args[0] for n in ast.walk(parsed) if isinstance(n, ast.AnnAssign)
                and isinstance(n.target, ast.Name) and isinstance(n.value, ast.Call) and n.value.args}

        def home(node) -> str:
            root = node.value if isinstance(node, ast.Attribute) else node
            return "/".join(imported.get(getattr(root, "id", ""), module.__name__).split(".")[1:]) + ".py"

        for f in dataclasses.fields(section):
            if f.default is dataclasses.MISSING or _trivial(f.default):
                continue
            names = {f.name} | ALIASES.get(f.name, set())
            flag = f.metadata.get("flag")
            if flag and not f.name.startswith("default_"):  # (--max-tokens names a request's, not this default)
                names.add(flag.lstrip("-").replace("-", "_"))
            facts.append((f"{section.__name__}.{f.name}", names, f.default, home(expr.get(f.name))))
    for name, value in vars(tree).items():
        if name.isupper() and not name.startswith("_") and isinstance(value, (int, float, str)) and not _trivial(value):
            facts.append((name, {name} | ALIASES.get(name, set()), value, "server/config.py"))
    return facts


def _same(a, b) -> bool:
    return not isinstance(a, bool) and not isinstance(b, bool) and type(a) in (type(b), int, float) and a == b


@functools.lru_cache(maxsize=None)
def _sources() -> Dict[str, ast.AST]:
    return {str(p.relative_to(REPO)): ast.parse(p.read_text(), str(p))
            for d in SCANNED for p in sorted((REPO / d).rglob("*.py"))}


def test_each_default_of_the_tree_is_written_once():
    bound = [(rel, line, name, value) for rel, parsed in _sources().items()
             for line, name, value, ok in _bindings(parsed) if ok and not _trivial(value)]
    twice = []
    for knob, names, value, home in _facts():
        twice += [f"{rel}:{line} {name}={v!r} ({knob}'s default, written in {home})" for rel, line, name, v in bound
                  if name in names and _same(v, value) and rel != home and (rel, name) not in NOT_THE_KNOB]
    assert not twice, "a default written again: take it from the tree\n" + "\n".join(twice)


def test_no_help_text_writes_its_default_by_hand():
    facts = {name: value for _, names, value, _ in _facts() for name in names}
    by_hand = []
    for rel, parsed in _sources().items():
        for line, name, text, own in _helps(parsed):
            values = [v for v in (own, facts.get(name)) if v is not None and (isinstance(v, bool) or not _trivial(v))]
            for said in re.findall(r"default:?\s+([^\s;,()]+(?: MiB)?)", text):
                if any(said.rstrip(".") in _renderings(v) for v in values):
                    by_hand.append(f"{rel}:{line} {name}: {text[:60]!r}")
    assert not by_hand, "help texts that write their default by hand (use %(default)s, or the value)\n" + \
        "\n".join(by_hand)


def _parsers() -> Iterator[Tuple[str, argparse.ArgumentParser]]:
    """Every command's parser, bench's modes included, loaded."""
    from mlxpipe.server.cli.main import build_parser

    todo = [("mlxpipe", build_parser())]
    while todo:
        name, parser = todo.pop()
        parser.format_help()  # (a lazy command loads its module, and with it its options)
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{name} {sub}", p) for sub, p in action.choices.items()]


def test_every_commands_options_default_to_the_tree():
    defaults = {n: value for _, names, value, _ in _facts() for n in names if not n.isupper()}
    wrong = []
    for command, parser in _parsers():
        for action in parser._actions:
            want = defaults.get(action.dest)
            if want is not None and action.default is not None and type(action.default) in (type(want), int, float) \
                    and not isinstance(action.default, bool) and action.default != want:
                wrong.append(f"{command} {'/'.join(action.option_strings)}: {action.default!r}, the tree's {want!r}")
    assert not wrong, "options whose default is not the tree's\n" + "\n".join(wrong)
