"""Every doc names what exists: README.md, docs/*.md and proto/pipeline.proto's comments.

What a doc names, and where it is looked for:

- a file or folder of the repository (``docs/planning.md``, ``server/api/``, a
  relative Markdown link), and a module (``planner.py``, ``core/frames.py``): it
  exists (``test_architecture_doc``'s resolution: from the root, a room of the
  head, or bare, anywhere);
- a class (``KvBudget``): one of ours, a wire message, enum or RPC, or a class of
  mlx-lm's; ``Class.attribute`` and ``module.name`` as docs/ARCHITECTURE.md's are
  checked (``test_architecture_doc._check``);
- a flag (``--max-stall``, ``mlxpipe serve --kv-bits 4``, a command line in a code
  block): an option of the command it follows, or of some mlxpipe command when
  it stands alone (every parser, bench's modes included, as ``test_homes`` builds
  them). A flag in a token that starts with another program's name is that
  program's: the program must be in ``OTHER_PROGRAMS``;
- a default stated next to a flag ("`--max-stall` (0.2)", "`--quantized-kv-start`,
  default 5000 positions", "default (`--prompt-ratio 10`)", "(`--max-image-bytes`,
  20 MiB)"): the option's default (which ``test_homes`` holds to the config tree), in
  the unit the doc writes (sizes as ``shards/params/sizes.py`` reads them: MB 1e6,
  MiB 2**20), or the default its help states where the option's is derived.

Also: a word after ``mlxpipe`` or ``mlxpipe bench`` is one of their commands, and
every table row sits under a table's header. Names that look like ours but are
someone else's are in ``NOT_OURS``, deliberate non-flags in ``NOT_FLAGS``, each with
its reason; an allowance no doc needs any more fails.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set

from test_architecture_doc import DEFS, MODULES, REPO, _check, _has, _resolve
from test_homes import _parsers
from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.shards.params import sizes

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PROTO = REPO / "proto" / "pipeline.proto"
# Programs other than mlxpipe whose flags the docs name, and why they do.
OTHER_PROGRAMS = {
    "mlx-lm": "named in prose (\"mlx-lm's `--prefill-step-size`\"): the library the pipeline must equal",
    "mlx_lm.generate": "mlx-lm's generate, whose --kv-bits serve's mirrors",
    "mlx_lm.convert": "mlx-lm's converter, whose -q output a quantized stage equals",
    "mlx.distributed_config": "MLX's tool that gives the interfaces a Thunderbolt cable joins their addresses (JACCL)",
}
# Names in backticks that look like ours but are someone else's, and why the docs name them
# (a dotted name: its first part).
NOT_OURS = {
    "Authorization": "the HTTP header API keys come in",
    "Range": "the HTTP header a resumed download sends",
    "ETag": "the HTTP header the hub answers with",
    "VmRSS": "Linux's /proc/<pid>/status field of resident memory",
    "ParserTooComplex": "llguidance's error for a grammar too costly to follow",
    "grpc": "gRPC's channel options (grpc.server_handshake_timeout_ms ...)",
    "stream_options": "an OpenAI request field (stream_options.include_usage)",
    "input_tokens_details": "an OpenAI Responses usage field",
    "logprobs": "an OpenAI completions field (logprobs.tokens)",
    "mlx": "MLX's own modules (mlx.launch, mlx.distributed_config: how JACCL ranks are set up)",
}
# Flags no command has, on purpose.
NOT_FLAGS = {
    "--prot": "README's example of a mistyped option (serve says: did you mean --port?)",
}


# -- the tokens of a doc --------------------------------------------------------------------


@dataclass
class Token:
    text: str    # what is in the backticks (or the word, in .proto comments)
    before: str  # the text before it, lines joined
    after: str   # the text after it, lines joined
    where: str   # doc:line

    def __str__(self) -> str:
        return f"{self.where}: `{self.text}`"


def _spans(doc: Path, text: str, pattern: str, offset_lines: Optional[List[int]] = None) -> Iterator[Token]:
    flat = text.replace("\n", " ")
    starts = [m.start() for m in re.finditer(r"^", text, flags=re.M)]
    for m in re.finditer(pattern, flat):
        line = sum(1 for s in starts if s <= m.start())
        if offset_lines:
            line = offset_lines[line - 1]
        yield Token(m.group(1), flat[max(0, m.start() - 200):m.start()], flat[m.end():m.end() + 200],
                    f"{doc.relative_to(REPO)}:{line}")


def _prose(doc: Path) -> str:
    """The doc with its code blocks blanked (newlines kept, so lines still count)."""
    return re.sub(r"```.*?```", lambda m: re.sub(r"[^\n]", " ", m.group(0)), doc.read_text(), flags=re.S)


def backticked(doc: Path) -> Iterator[Token]:
    return _spans(doc, _prose(doc), r"`([^`]+)`")


def bare_paths(doc: Path) -> Iterator[Token]:
    """Files named outside backticks ("see DESIGN.md", "docs/planning.md")."""
    text = re.sub(r"`[^`]*`", lambda m: re.sub(r"[^\n]", " ", m.group(0)), _prose(doc))
    return _spans(doc, text, r"(?<![\w/.:`-])((?:[\w-]+/)*[\w-]+\.(?:py|md|proto))(?![\w/])")


def links(doc: Path) -> Iterator[Token]:
    """Relative Markdown links' targets, resolved against the doc's folder."""
    for t in _spans(doc, _prose(doc), r"\]\(([^)\s]+)\)"):
        if not re.match(r"[a-z]+:|#", t.text):
            t.text = str((doc.parent / t.text.split("#")[0]).resolve().relative_to(REPO))
            yield t


def code_lines(doc: Path) -> Iterator[Token]:
    """Each command of a code block's lines (continuations joined; `&&`, `;`, `|` apart); ``before``
    is "$" where the line is a command for sure (a ```sh block, a "$ " prompt), not a program's output."""
    lines = doc.read_text().splitlines()
    inside, shell = False, False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            inside, shell = not inside, line.strip() in ("```sh", "```bash", "```shell")
            continue
        if not inside or (i and lines[i - 1].rstrip().endswith("\\")):
            continue
        j, text = i, line
        while text.rstrip().endswith("\\") and j + 1 < len(lines):
            j += 1
            text = text.rstrip()[:-1] + " " + lines[j]
        for part in re.split(r"&&|;|\|\||(?<![\\'\"])\|(?!\|)", re.sub(r"\s#.*$", "", text)):
            yield Token(part.strip().removeprefix("$ "), "$" if shell or line.startswith("$ ") else "", "",
                        f"{doc.relative_to(REPO)}:{i + 1}")


def proto_comments() -> Iterator[Token]:
    """Every word of pipeline.proto's comments that names something: a path, a flag, `a.b`."""
    out, lines = [], []
    for i, line in enumerate(PROTO.read_text().splitlines()):
        if "//" in line:
            out.append(line.split("//", 1)[1])
            lines.append(i + 1)
    text = "\n".join(out)
    yield from _spans(PROTO, text, r"`([^`]+)`", lines)
    bare = re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), text)
    yield from _spans(PROTO, bare, r"(?<![\w`])((?:--[a-z][\w-]*)|(?:[\w./]+\.(?:py|md|proto))|"
                                   r"(?:[A-Z]\w*\.[a-z_]\w*))(?=[\s,;:)]|\.(?:\s|$)|$)", lines)


# -- what exists ----------------------------------------------------------------------------


OUTPUTS = ("bench-out", "build", "dist")  # folders runs write (.gitignore)


def _repo_files() -> Set[str]:
    """Every file of the repository, and every folder with a trailing /: not what runs write
    (bench-out/, build/, dist/: what a doc names there is an output, not a file of ours)."""
    out = set()
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__" and not d.endswith(".egg-info")
                   and not (root == str(REPO) and d in OUTPUTS) or d == ".ci"]
        rel = Path(root).relative_to(REPO)
        out |= {f"{rel / d}/" for d in dirs} | {str(rel / f) for f in files}
    return out


FILES = _repo_files()
TOPS = {f.split("/")[0] for f in FILES}
# The rooms a doc names without their package: server/core/ as core/, shards/worker/ as worker/.
ROOMS = {f.split("/")[1] for f in FILES if f.count("/") >= 2 and f.split("/")[0] in ("server", "shards")}


FILE_NAME = re.compile(r"\.(md|proto|txt|toml|js|yaml|json|png)$")


def _path_problem(path: str) -> Optional[str]:
    if re.search(r"[<>{}*$~\[\]|=]|^/|^\.\.|://|^-", path):  # a placeholder, an absolute path, a URL
        return None
    if re.fullmatch(r"[A-Z_]+\.(?!md$)\w+", path.split("/")[-1]):  # TASK.yaml: a placeholder
        return None
    if re.fullmatch(r"[\w/]+/\w+\.\w+", path) and not FILE_NAME.search(path) and not path.endswith(".py"):
        return _defined_problem(path)  # core/drafting.SOURCES
    if path.startswith("mlxpipe."):
        return None if importlib.util.find_spec(path) else "no such package"
    if path.endswith(".py"):
        if _resolve(path, None) or any(m.endswith("/" + path) for m in MODULES):
            return None
        return "no such module"
    if "/" not in path:
        if re.search(r"\.(md|proto|txt|toml|js|yaml)$", path) and not any(
                f == path or f.endswith("/" + path) for f in FILES):
            return "no such file"
        return None
    if path.split("/")[0] not in TOPS | ROOMS:
        return None  # a Hugging Face repo id, a folder of the user's
    where = [path, f"server/{path}", f"shards/{path}", f"server/api/{path}"]
    return None if any(w in FILES or w + "/" in FILES for w in where) else "no such file or folder"


def _defined_problem(token: str) -> Optional[str]:
    """``core/drafting.SOURCES``: the module (found as a path is) defines the name."""
    path, name = token.rsplit(".", 1)
    rel = _resolve(path + ".py", None) or next((m for m in MODULES if m.endswith("/" + path + ".py")), None)
    if rel is None:
        return "no such module"
    return None if name in DEFS[rel].top else f"{path}.py defines no {name}"


@functools.lru_cache(None)
def _mlx_lm_classes() -> Set[str]:
    """The classes mlx-lm's source defines (read, not imported: no MLX loaded for a doc check)."""
    root = Path(importlib.util.find_spec("mlx_lm").submodule_search_locations[0])
    return {c for p in root.rglob("*.py") for c in re.findall(r"^class (\w+)", p.read_text(), re.M)}


@functools.lru_cache(None)
def _wire_names() -> Set[str]:
    names = set()
    for msg in pb.DESCRIPTOR.message_types_by_name.values():
        names |= {msg.name, *msg.nested_types_by_name, *msg.enum_types_by_name}
    names |= set(pb.DESCRIPTOR.enum_types_by_name)
    for service in pb.DESCRIPTOR.services_by_name.values():
        names |= {service.name, *service.methods_by_name}
    return names


def _class_problem(name: str) -> Optional[str]:
    if name in NOT_OURS or _has(name, None) or name in _wire_names() or name in _mlx_lm_classes():
        return None
    if any(name in defs.top for defs in DEFS.values()):
        return None
    return "no class of ours, of the wire or of mlx-lm's"


# -- flags ----------------------------------------------------------------------------------


@functools.lru_cache(None)
def _commands() -> Dict[str, argparse.ArgumentParser]:
    return dict(_parsers())


def _options(command: str) -> Dict[str, argparse.Action]:
    """The options of a command and of the commands above it."""
    out, parts = {}, command.split()
    for n in range(1, len(parts) + 1):
        parser = _commands()[" ".join(parts[:n])]
        out.update({s: a for a in parser._actions for s in a.option_strings})
    return out


@functools.lru_cache(None)
def _all_options() -> Dict[str, List[argparse.Action]]:
    out: Dict[str, List[argparse.Action]] = {}
    for command in _commands():
        for flag, action in _options(command).items():
            if action not in out.setdefault(flag, []):
                out[flag].append(action)
    return out


def _subcommand(word: str) -> Optional[str]:
    """The command a doc names by its last word alone (`serve --discover`, `stream --speculative`)."""
    found = [c for c in _commands() if c.split()[-1] == word and c != "mlxpipe"]
    return found[0] if len(found) == 1 else None


@dataclass
class Command:
    program: str                 # "mlxpipe serve", or another program's name
    flags: List[tuple]           # (flag, the word after it or None)


def command(text: str) -> Optional[Command]:
    """What a command line names: its program (mlxpipe's subcommand, walked) and its flags."""
    words = text.split()
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]  # PYTHONUNBUFFERED=1 mlxpipe ...
    if words[:3] == ["python", "-m", "mlxpipe.server.cli"] or words[:3] == ["python3", "-m", "mlxpipe.server.cli"]:
        words = ["mlxpipe"] + words[3:]
    if not words or not any(w.startswith("--") for w in words) and words[0] != "mlxpipe":
        return None
    if words[0].startswith("--"):
        program, rest = "", words
    elif words[0] == "mlxpipe" or _subcommand(words[0]):
        program, rest = "mlxpipe" if words[0] == "mlxpipe" else _subcommand(words[0]), words[1:]
        while rest and f"{program} {rest[0]}" in _commands():
            program, rest = f"{program} {rest[0]}", rest[1:]
    else:
        program, rest = words[0], words[1:]
    flags = []
    for i, word in enumerate(rest):
        if word == "--":
            break  # what follows is another program's command line
        if word.startswith("--"):
            after = rest[i + 1] if i + 1 < len(rest) and not rest[i + 1].startswith("-") else None
            for flag in word.split("=")[0].split("/"):
                flags.append((flag.rstrip(",.:;)'\""), after if "=" not in word else word.split("=", 1)[1]))
    return Command(program, flags)


def _command_problem(text: str) -> Optional[str]:
    """`mlxpipe WORD` or `mlxpipe bench WORD` (or `a|b|c`): each a command."""
    cmd = command(text)
    words = text.split()
    if cmd is None or cmd.program not in ("mlxpipe", "mlxpipe bench") or len(words) <= len(cmd.program.split()):
        return None
    word = words[len(cmd.program.split())]
    if not re.fullmatch(r"[a-z]+(?:\\?\|[a-z]+)*", word):
        return None  # a flag, a placeholder, an error message's "serve:"
    wrong = [w for w in re.split(r"\\?\|", word) if f"{cmd.program} {w}" not in _commands()]
    return f"no command `{cmd.program} {'|'.join(wrong)}`" if wrong else None


def _flag_problem(cmd: Command) -> List[str]:
    if cmd.program and not cmd.program.startswith("mlxpipe"):
        return [] if cmd.program in OTHER_PROGRAMS else [f"flags of {cmd.program}, not in OTHER_PROGRAMS"]
    known = _options(cmd.program) if cmd.program else _all_options()
    where = f"an option of `{cmd.program}`" if cmd.program else "an option of any mlxpipe command"
    return [f"{flag} is not {where}" for flag, _ in cmd.flags if flag not in known and flag not in NOT_FLAGS]


def owner(t: Token) -> Optional[str]:
    """The other program a lone flag belongs to, by what comes right before it: "mlx-lm's
    `--flag`", "`mlx_lm.convert`'s `--flag`", or "`mlx_lm.convert -q --q-bits 4` or `--flag`"."""
    before = t.before.replace("`'s", "'s")
    m = re.search(r"([\w.-]+)'s\s*$", before)
    if m and m.group(1) in OTHER_PROGRAMS:
        return m.group(1)
    m = re.search(r"`([^`]+)`(?:\s*(?:,|or|and)\s*`[^`]+`)*\s*(?:,|or|and)\s*$", before)
    if m and (cmd := command(m.group(1))) and cmd.program in OTHER_PROGRAMS:
        return cmd.program
    return None


# -- defaults -------------------------------------------------------------------------------

NUMBER = r"(\d[\d,]*(?:\.\d+)?%?(?:\s?(?:[kKMGT]i?B|B|k|M|ms|s|positions|tokens)\b)?)"  # 5,000, 10%, 20 MiB, 0.2 s
# What a unit after a stated default multiplies it by (sizes: shards/params/sizes.py's, GB = 1e9, GiB = 2**30).
COUNTS = {"k": 1e3, "M": 1e6, "ms": 1e-3}


def stated_defaults(t: Token) -> List[tuple]:
    """(flag, the value the doc says it defaults to, the command) for one token."""
    cmd = command(t.text)
    if cmd is None or (cmd.program and not cmd.program.startswith("mlxpipe")):
        return []
    if re.search(r"\bdefaults? \($", t.before):  # default (`--prompt-ratio 10`)
        return [(flag, value, cmd.program) for flag, value in cmd.flags if value is not None]
    if len(cmd.flags) != 1 or cmd.flags[0][1] is not None:
        return []
    m = (re.match(r"\s*[(,]\s*(?:default:?\s+)?" + NUMBER + r"\)", t.after)  # `--prefix-block` (16), (`--port`, 8000)
         or t.before.endswith("(") and re.match(r",\s*" + NUMBER + r":", t.after)  # (`--max-image-pixels`, 40 M: ...
         or re.match(r"\s*[(,]\s*default:?\s+" + NUMBER + r"(?![\d,.])", t.after)  # `--flag`, default 5000 positions
         or re.match(r"[^`.;()]{0,12}\((?:[^()`]*[;,]\s*)?default:?\s+" + NUMBER + r"\)",
                     t.after))  # `--wait-nodes` of them (default 1); `--concurrency` (requests ...; default 1)
    return [(cmd.flags[0][0], m.group(1).rstrip(","), cmd.program)] if m else []


def _same(stated: str, default) -> bool:
    """Whether a stated default ("5,000 positions", "20 MiB", "0.2 s", "40 M") is ``default``."""
    if str(default) == stated:
        return True
    m = re.fullmatch(r"([\d,.]+)(%?)\s?([a-zA-Z]*)", stated)
    if m is None or isinstance(default, bool) or not isinstance(default, (int, float)):
        return False
    number, unit = float(m.group(1).replace(",", "")), m.group(3)
    if unit.lower() in sizes._UNITS:
        number = sizes.parse_size(m.group(1).replace(",", "") + unit)
    else:
        number *= COUNTS.get(unit, 1)  # (s, positions, tokens: the number as it is)
    return abs(float(default) - number) <= 1e-9 * max(1.0, abs(number))


def _default_problem(flag: str, value: str, program: str) -> Optional[str]:
    actions = [_options(program)[flag]] if program and flag in _options(program) else _all_options().get(flag, [])
    if not actions or any(_same(value, a.default) for a in actions):
        return None
    helps = [(a.help or "").replace("%%", "%") for a in actions]
    if any(re.search(r"default:?\s[^)]*?(?<![\d.])" + re.escape(value) + r"(?![\d.])", h) for h in helps):
        return None  # a default the option derives (0 or None: "default 1"), as its help says
    return f"the doc says {flag} defaults to {value}; it is {', '.join(repr(a.default) for a in actions)}"


# -- the checks -----------------------------------------------------------------------------


def _every_token() -> Iterator[Token]:
    for doc in DOCS:
        yield from backticked(doc)
        yield from bare_paths(doc)
    yield from proto_comments()


def _problems() -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {"names": [], "flags": [], "defaults": []}
    architecture = str(Path("docs") / "ARCHITECTURE.md")
    for t in _every_token():
        cmd = command(t.text)
        for word in t.text.split():
            word = word.strip("'\",;:()")
            if ("/" in word or FILE_NAME.search(word) or word.endswith(".py")) and (why := _path_problem(word)):
                out["names"].append(f"{t} {why}")
        call = re.match(r"([A-Za-z_][\w.]*)(?:\(.*\))?$", t.text)
        name = call.group(1) if call else None
        if name and re.fullmatch(r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*", name):
            if why := _class_problem(name):
                out["names"].append(f"{t} {why}")
        elif name and not t.where.startswith(architecture):  # (ARCHITECTURE.md's: test_architecture_doc)
            if name.split(".")[0] not in NOT_OURS and not name.endswith(".py") and \
                    (why := _check(name, t.after, None)):
                out["names"].append(f"{t} {why}")
        if cmd and not cmd.program and owner(t):
            cmd.program = owner(t)
        if cmd:
            out["flags"] += [f"{t} {why}" for why in _flag_problem(cmd)]
            if why := _command_problem(t.text):
                out["flags"].append(f"{t} {why}")
            out["defaults"] += [f"{t} {why}" for d in stated_defaults(t) if (why := _default_problem(*d))]
    for doc in DOCS:
        for t in links(doc):
            if t.text not in FILES and t.text + "/" not in FILES:
                out["names"].append(f"{t.where}: link to {t.text}, which does not exist")
        for t in code_lines(doc):
            if (cmd := command(t.text)) and cmd.program.startswith("mlxpipe"):
                out["flags"] += [f"{t} {why}" for why in _flag_problem(cmd)]
                if t.before == "$" and (why := _command_problem(t.text)):
                    out["flags"].append(f"{t} {why}")
    return out


@functools.lru_cache(None)
def _found() -> Dict[str, List[str]]:
    return _problems()


def test_every_doc_names_files_modules_and_classes_that_exist():
    assert not _found()["names"], "the docs name what is not there:\n" + "\n".join(_found()["names"])


def test_every_flag_a_doc_names_is_an_option():
    assert not _found()["flags"], "the docs name flags no command has:\n" + "\n".join(_found()["flags"])


def test_every_default_a_doc_states_is_the_options():
    assert not _found()["defaults"], "the docs state other defaults:\n" + "\n".join(_found()["defaults"])


def test_every_table_row_sits_in_a_table():
    """A row after a paragraph, not under a table's header and rule, renders as text."""
    cut = []
    for doc in DOCS:
        lines = _prose(doc).splitlines()
        for i, line in enumerate(lines):
            if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
                if i + 1 >= len(lines) or not re.match(r"\|\s*:?-{3,}", lines[i + 1]):
                    cut.append(f"{doc.relative_to(REPO)}:{i + 1}: {line[:70]}")
    assert not cut, "table rows outside a table (no header and rule above them):\n" + "\n".join(cut)


def test_every_allowance_is_used():
    """OTHER_PROGRAMS, NOT_OURS and NOT_FLAGS name only what some doc names (none outlives its use)."""
    tokens = list(_every_token())
    programs = {command(t.text).program for t in tokens if command(t.text)} | {owner(t) for t in tokens}
    words = {w for t in tokens for w in re.split(r"[\s.(]", t.text)}
    unused = [p for p in OTHER_PROGRAMS if p not in programs] + [n for n in NOT_OURS if n not in words] \
        + [f for f in NOT_FLAGS if not any(f in t.text.split() for t in tokens)]
    assert not unused, f"allowances no doc needs any more: {unused}"


def test_the_checker_catches_what_the_docs_got_wrong_once():
    def token(text, before="", after=""):
        return Token(text, before, after, "x:1")

    assert _path_problem("server/prefix.py") == "no such module"
    assert _path_problem("DESIGN.md") == "no such file"
    assert _path_problem("shards/stage.py") == "no such module"  # before shards/ had rooms
    assert _path_problem("shards/worker/stage.py") is None and _path_problem("core/frames.py") is None
    assert _path_problem("core/drafting.SOURCES") is None
    assert _path_problem("core/drafting.KINDS") == "core/drafting.py defines no KINDS"
    assert _path_problem("mlx-community/Qwen3-4B-4bit") is None  # a repo id
    assert _class_problem("KvBudget") is None and _class_problem("QuantizedKVCache") is None  # ours, mlx-lm's
    assert _class_problem("Forward") is None and _class_problem("KvBudgets") is not None  # an RPC; a typo
    assert _flag_problem(command("mlxpipe serve --max-stall 0.1")) == []
    assert _flag_problem(command("mlxpipe node --max-stall 0.1")) == ["--max-stall is not an option of `mlxpipe node`"]
    assert _flag_problem(command("stream --speculative")) == []  # a bench mode by its name
    assert _flag_problem(command("--no-such-flag")) == ["--no-such-flag is not an option of any mlxpipe command"]
    assert _flag_problem(command("lm_eval --model x")) == ["flags of lm_eval, not in OTHER_PROGRAMS"]
    assert _command_problem("mlxpipe bench stream\\|load") is None
    assert _command_problem("mlxpipe bench streams") == "no command `mlxpipe bench streams`"
    assert _command_problem("mlxpipe serve: error: ...") is None
    assert owner(token("--quant-predicate", "exactly `mlx_lm.convert -q --q-bits 4` or ")) == "mlx_lm.convert"
    assert owner(token("--prefill-step-size", "Exactness has conditions. mlx-lm's ")) == "mlx-lm"
    assert owner(token("--kv-bits", "as `mlxpipe serve` does with ")) is None
    assert stated_defaults(token("--max-stall", after=" (0.2), so")) == [("--max-stall", "0.2", "")]
    assert stated_defaults(token("--kv-bits", after=" (16, 8 or 4)")) == []  # choices, not a default
    assert stated_defaults(token("--wait-nodes", after=" of them (default 1), then")) == [("--wait-nodes", "1", "")]
    assert stated_defaults(token("--bits b", after=" with MLX affine group size g (default 64)")) == []
    assert stated_defaults(token("--prompt-ratio 10", before="a default (")) == [("--prompt-ratio", "10", "")]
    assert _default_problem("--max-stall", "0.2", "mlxpipe serve") is None
    assert _default_problem("--quantized-kv-start", "5,000", "") is None
    assert _default_problem("--max-stall", "0.3", "") is not None
    assert _default_problem("--max-image-bytes", "20 MiB", "") is None
    assert _default_problem("--max-image-bytes", "20 MB", "") is not None  # 20,000,000 bytes: not 20 << 20
    assert _default_problem("--max-image-pixels", "40 M", "") is None
    assert stated_defaults(token("--max-image-pixels", "pixels (", ", 40 M: a bomb")) == [
        ("--max-image-pixels", "40 M", "")]
    assert _default_problem("--prefix-cache-disk", "10%", "") is None  # derived: its help says so
    assert _default_problem("--prefix-cache-disk", "20%", "") is not None
