"""``mlxpipe bench openwebui``: Open WebUI (as installed from PyPI) on mlxpipe, for
chat and for the embeddings of its RAG, driven in a real headless Chromium.

Open WebUI goes into a virtual environment of its own under
``$MLXPIPE_HOME/bench/openwebui/venv`` (installed once with pip, reused after: it
brings torch). ``mlxpipe serve --embedding-model default`` runs on loopback, and Open
WebUI on loopback beside it with everything pointed there: chat models from
``/v1`` (OpenAI-style), ``RAG_EMBEDDING_ENGINE=openai`` with the embedding model
mlxpipe lists, its own local models (sentence-transformers, reranker, whisper) off,
offline, no telemetry, its data in a temporary folder, no login. Between Open WebUI
and mlxpipe a recording pass-through (``recorder.py``) keeps what Open WebUI sent.

In the page (``openwebui_page.py``): mlxpipe's chat model is picked in the model
menu, a small text file is attached to the chat (a made-up code word in one of its
paragraphs, each paragraph a chunk), and a question about it is sent. Checked:
  * mlxpipe's ``/metrics`` counted embedding requests and inputs from the upload
    (the chunks) and from the question (the retrieval query), and chat requests;
  * the answer streamed into the page (its text grew, and it is not empty);
  * the chat request mlxpipe received holds the paragraph with the code word (the
    retrieved chunk in the prompt), as recorded on the way in.
The answer itself is not required to name the code word: the default model (135M)
may not. A failed check makes the command exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import httpx

from mlxpipe.bench.common import HttpServer, answering, free_port, pin_flags
from mlxpipe.bench.recorder import Recorder
from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.models.store import mlxpipe_home

OPEN_WEBUI = "open-webui==0.12.4"
CODE_WORD = "VELVET-KUMQUAT-7319"
QUESTION = "What is the code word of the Zanthor harbour project?"
PARAGRAPHS = (
    "The northern orchard grows apples, pears and quinces. Every autumn the pickers sort the fruit by size and "
    "colour, and the smallest apples go to the cider press behind the barn.",
    "The old railway line once carried coal from the hills to the coast. Its stations are now houses, and the "
    "track bed has become a path for walkers and cyclists.",
    f"Internal note on the Zanthor harbour project: its code word is {CODE_WORD}. Staff must quote the code word "
    "when they call the harbour office about the project.",
    "The town library opens at nine on weekdays and at ten on Saturdays. It lends books, maps and tools, and runs "
    "a reading group for children every Wednesday afternoon.",
    "The weather station on the ridge records wind speed, rainfall and temperature every ten minutes and sends "
    "the readings to the regional office each night.",
    "The bakery on the square sells rye bread, seed rolls and a honey cake that is only made in December. It "
    "closes early on Sundays.",
)
DOCUMENT = "\n\n".join(PARAGRAPHS) + "\n"


def venv_dir() -> Path:
    return mlxpipe_home() / "bench" / "openwebui" / "venv"


def ensure_installed(venv: Path, requirement: str) -> Path:
    """Open WebUI's ``open-webui`` command in ``venv``, installed there with pip first
    unless a finished install of ``requirement`` is recorded there."""
    exe = venv / "bin" / "open-webui"
    marker = venv / "mlxpipe-installed.txt"
    if exe.exists() and marker.exists() and marker.read_text().strip() == requirement:
        print(f"Open WebUI: {requirement} already installed in {venv}", flush=True)
        return exe
    if not (venv / "bin" / "python").exists():
        print(f"Open WebUI: creating a virtual environment in {venv}", flush=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    print(f"Open WebUI: pip install {requirement} into {venv} (once; it brings torch: minutes)", flush=True)
    started = time.monotonic()
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--progress-bar", "off",
                           requirement])
    if done.returncode != 0 or not exe.exists():
        raise SystemExit(f"mlxpipe bench openwebui: pip install {requirement} failed (exit {done.returncode}); "
                         f"remove {venv} to start the install afresh")
    marker.write_text(requirement + "\n")
    print(f"Open WebUI: installed in {time.monotonic() - started:.0f} s", flush=True)
    return exe


def webui_env(data_dir: Path, api_url: str, embedding_model: str, port: int,
              builtin_tools: bool = False) -> Dict[str, str]:
    """Open WebUI's settings (0.12's variable names, from its ``config.py`` and
    ``env.py``): everything served by ``api_url`` (an OpenAI-style ``.../v1``),
    nothing downloaded, nothing reported, no login."""
    env = {
        "DATA_DIR": str(data_dir), "PORT": str(port), "WEBUI_SECRET_KEY": secrets.token_hex(16),
        "WEBUI_AUTH": "False", "ENABLE_PERSISTENT_CONFIG": "False",
        # Models: mlxpipe's, as an OpenAI-style connection; no Ollama.
        "ENABLE_OPENAI_API": "True", "OPENAI_API_BASE_URLS": api_url, "OPENAI_API_KEYS": "mlxpipe",
        "OPENAI_API_BASE_URL": api_url, "OPENAI_API_KEY": "mlxpipe", "ENABLE_OLLAMA_API": "False",
        "ENABLE_DIRECT_CONNECTIONS": "False", "ENABLE_EVALUATION_ARENA_MODELS": "False",
        # RAG: embeddings from mlxpipe; no local embedding, reranking or speech models.
        "RAG_EMBEDDING_ENGINE": "openai", "RAG_EMBEDDING_MODEL": embedding_model,
        "RAG_OPENAI_API_BASE_URL": api_url, "RAG_OPENAI_API_KEY": "mlxpipe",
        "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "False", "RAG_RERANKING_MODEL": "", "RAG_RERANKING_ENGINE": "",
        "RAG_RERANKING_MODEL_AUTO_UPDATE": "False", "ENABLE_RAG_HYBRID_SEARCH": "False",
        "WHISPER_MODEL_AUTO_UPDATE": "False", "AUDIO_STT_ENGINE": "openai", "AUDIO_TTS_ENGINE": "",
        "VECTOR_DB": "chroma", "RAG_TOP_K": "3", "CHUNK_SIZE": "200", "CHUNK_OVERLAP": "0",  # a chunk a paragraph
        # One chat request per question: no title, tags, follow-ups or generated queries.
        "ENABLE_TITLE_GENERATION": "False", "ENABLE_TAGS_GENERATION": "False",
        "ENABLE_FOLLOW_UP_GENERATION": "False", "ENABLE_RETRIEVAL_QUERY_GENERATION": "False",
        "ENABLE_SEARCH_QUERY_GENERATION": "False", "ENABLE_AUTOCOMPLETE_GENERATION": "False",
        "ENABLE_WEB_SEARCH": "False", "ENABLE_CODE_INTERPRETER": "False", "ENABLE_CODE_EXECUTION": "False",
        # Offline, and quiet.
        "OFFLINE_MODE": "True", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "ENABLE_VERSION_UPDATE_CHECK": "False", "ANONYMIZED_TELEMETRY": "False", "DO_NOT_TRACK": "True",
        "SCARF_NO_ANALYTICS": "True", "ENABLE_OTEL": "False", "GLOBAL_LOG_LEVEL": "WARNING",
    }
    if not builtin_tools:
        # 0.12 sends its built-in tools (about 40 definitions: memory, notes, calendar, knowledge...)
        # with every chat of a browser session, thousands of prompt tokens a small model cannot
        # use: off for every model, as an admin turns them off for such a model.
        env["DEFAULT_MODEL_METADATA"] = '{"capabilities": {"builtin_tools": false}}'
    return env


class OpenWebUI:
    """``open-webui serve`` on loopback, its log in ``DATA_DIR/open-webui.log``."""

    def __init__(self, exe: Path, env: Dict[str, str], timeout: float = 600):
        self.port = int(env["PORT"])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(env["DATA_DIR"]) / "open-webui.log"
        child = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
        child["PATH"] = f"{exe.parent}{os.pathsep}{child.get('PATH', '')}"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([str(exe), "serve", "--host", "127.0.0.1", "--port", str(self.port)],
                                         env={**child, **env}, cwd=env["DATA_DIR"], stdout=log,
                                         stderr=subprocess.STDOUT)
        if answering(self.proc, f"{self.url}/health", timeout, every=1):
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"Open WebUI exited with {self.proc.returncode}; its log:\n{self.tail()}")
        self.close()
        raise RuntimeError(f"Open WebUI did not answer /health in {timeout:.0f} s; its log:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# -- what mlxpipe counted -------------------------------------------------------------


def counters(metrics_text: str) -> Dict[str, float]:
    """The figures the checks read from a ``/metrics`` text: requests answered by route
    (``requests /v1/embeddings``), embedding inputs, generated tokens."""
    out: Dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = re.match(r'mlxpipe_http_requests_total\{route="([^"]*)",status="([^"]*)"\} (\S+)', line)
        if m:
            key = f"requests {m.group(1)}" + ("" if m.group(2).startswith("2") else f" {m.group(2)}")
            out[key] = out.get(key, 0.0) + float(m.group(3))
            continue
        m = re.match(r"(mlxpipe_embedding_inputs|mlxpipe_embedding_tokens|mlxpipe_generated_tokens)(?:_total)? (\S+)",
                     line)
        if m:
            out[m.group(1).removeprefix("mlxpipe_")] = float(m.group(2))
    return out


def grew(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def checks(upload: Dict[str, float], question: Dict[str, float], page: dict, chat_bodies: List[dict]) -> List[tuple]:
    """(name, passed, detail) for each check: ``upload`` and ``question``, what
    mlxpipe's counters grew by while the file was processed and while the question was
    answered; ``page``, what the page showed; ``chat_bodies``, the chat requests
    mlxpipe received for the question."""
    prompts = ["\n".join(t for m in body.get("messages") or [] for t in _texts(m.get("content")))
               for body in chat_bodies]
    with_fact = [p for p in prompts if CODE_WORD in p]
    others = sum(1 for text in PARAGRAPHS if CODE_WORD not in text and any(text[:60] in p for p in with_fact))
    return [
        ("upload embedded by mlxpipe", upload.get("requests /v1/embeddings", 0) >= 1
         and upload.get("embedding_inputs", 0) >= 1,
         f"{upload.get('requests /v1/embeddings', 0):.0f} embedding requests, "
         f"{upload.get('embedding_inputs', 0):.0f} inputs ({len(PARAGRAPHS)} paragraphs in the file)"),
        ("question embedded by mlxpipe (retrieval)", question.get("requests /v1/embeddings", 0) >= 1,
         f"{question.get('requests /v1/embeddings', 0):.0f} embedding requests, "
         f"{question.get('embedding_inputs', 0):.0f} inputs"),
        ("chat served by mlxpipe", question.get("requests /v1/chat/completions", 0) >= 1
         and question.get("generated_tokens", 0) >= 1,
         f"{question.get('requests /v1/chat/completions', 0):.0f} chat requests, "
         f"{question.get('generated_tokens', 0):.0f} tokens generated"),
        ("answer streamed into the page", bool(page.get("answer", "").strip()) and page.get("growths", 0) >= 2,
         f"{len(page.get('answer', ''))} characters, seen growing {page.get('growths', 0)} times"),
        ("retrieved chunk in mlxpipe's prompt", bool(with_fact),
         f"the code word in {len(with_fact)} of {len(prompts)} chat prompts"
         + (f", beside {others} of the other {len(PARAGRAPHS) - 1} paragraphs" if with_fact else "")),
    ]


def _texts(content) -> List[str]:
    if isinstance(content, str):
        return [content]
    return [part.get("text", "") for part in content or [] if isinstance(part, dict)]


def metrics(url: str) -> Dict[str, float]:
    return counters(httpx.get(f"{url}/metrics", timeout=30).text)


# -- the run ---------------------------------------------------------------------------


def _models(url: str) -> tuple:
    """(the chat model's id, the embedding model's id) as mlxpipe lists them."""
    cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    chat = next(c["id"] for c in cards if "chat" in c.get("capabilities", []))
    embedding = next((c["id"] for c in cards if "embedding" in c.get("capabilities", [])), None)
    if embedding is None:
        raise SystemExit("mlxpipe bench openwebui: mlxpipe lists no embedding model (--embedding-model)")
    return chat, embedding


async def bench_openwebui(args) -> dict:
    from mlxpipe.bench.openwebui_page import drive

    exe = ensure_installed(Path(args.venv), args.open_webui)
    work = Path(tempfile.mkdtemp(prefix="mlxpipe-openwebui-"))
    t0 = time.monotonic()
    server = HttpServer("mlxpipe", [sys.executable, "-m", "mlxpipe.server.cli", "serve", "--port", "0",
                                    "--model", args.model, "--stages", str(args.stages), "--embedding-model",
                                    args.embedding_model, "--max-tokens", str(args.max_tokens)]
                        + pin_flags(args.pin) + shlex.split(args.serve_args), log=str(work / "mlxpipe.log"))
    recorder = webui = None
    timings: Dict[str, float] = {"mlxpipe serve up": time.monotonic() - t0}
    try:
        chat_model, embedding_model = _models(server.url)
        recorder = Recorder(server.url)
        print(f"mlxpipe serve at {server.url} (chat: {chat_model}, embeddings: {embedding_model}); "
              f"Open WebUI reaches it through {recorder.url}", flush=True)
        t = time.monotonic()
        webui = OpenWebUI(exe, webui_env(work, f"{recorder.url}/v1", embedding_model, free_port(),
                                         args.builtin_tools))
        timings["Open WebUI up"] = time.monotonic() - t
        print(f"Open WebUI at {webui.url} (data in {work})", flush=True)
        doc = work / "zanthor-notes.txt"
        doc.write_text(DOCUMENT)
        snapshots = {"start": metrics(server.url)}
        page = await asyncio.to_thread(drive, webui.url, chat_model, doc, QUESTION, snapshots,  # Playwright's
                                       lambda: metrics(server.url), args.timeout, work)  # sync API: not in a loop
        timings.update(page.pop("timings"))
        bodies = [r.body for r in recorder.seen("/v1/chat/completions") if isinstance(r.body, dict)]
    except BaseException:
        if webui is not None:
            print(f"Open WebUI's log (last lines):\n{webui.tail()}\nkept: {work}", file=sys.stderr)
        raise
    finally:
        for part in (webui, recorder, server):
            if part is not None:
                part.close()
    upload = grew(snapshots["start"], snapshots["uploaded"])
    question = grew(snapshots["uploaded"], snapshots["answered"])
    results = checks(upload, question, page, bodies)
    logged = [line[line.index("POST /v1/chat"):].strip()
              for line in (work / "mlxpipe.log").read_text(errors="replace").splitlines() if "POST /v1/chat" in line]
    report = _report(args, chat_model, embedding_model, timings, upload, question, page, results, bodies, logged)
    if args.keep or report["failed"]:
        print(f"kept: {work} (both logs, the page's screenshot)", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _report(args, chat_model, embedding_model, timings, upload, question, page, results, bodies, logged) -> dict:
    lines = [f"Open WebUI ({args.open_webui}) on mlxpipe serve (chat: {chat_model}, embeddings: {embedding_model}), "
             "driven in headless Chromium"]
    lines += [f"  {name:34}{seconds:8.1f} s" for name, seconds in timings.items()]
    lines.append(f"  counted by mlxpipe while the file was processed: {_counts(upload)}")
    lines.append(f"  counted by mlxpipe while the question was answered: {_counts(question)}")
    for body in bodies[-1:]:
        chars = sum(len(t) for m in body.get("messages") or [] for t in _texts(m.get("content")))
        lines.append(f"  the chat request mlxpipe got: {len(body.get('messages') or [])} messages, {chars} characters")
    lines += [f"  mlxpipe's request log: {line}" for line in logged]
    lines.append(f"  answer in the page: {page.get('answer', '')[:160]!r}")
    lines.append(f"  the answer names the code word: {'yes' if CODE_WORD in page.get('answer', '') else 'no'} "
                 "(not required: a small model may not)")
    lines += [f"  [{'ok' if ok else 'FAILED'}] {name}: {detail}" for name, ok, detail in results]
    print("\n".join(lines), flush=True)
    return {"timings": timings, "upload": upload, "question": question, "answer": page.get("answer", ""),
            "checks": [{"name": n, "passed": ok, "detail": d} for n, ok, d in results],
            "failed": not all(ok for _, ok, _ in results), "lines": lines}


def _counts(grown: Dict[str, float]) -> str:
    return ", ".join(f"{k} +{v:.0f}" for k, v in sorted(grown.items())) or "nothing"


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser("openwebui")
    q.add_argument("--model", default=ClusterConfig.model, help="the chat model, as serve's --model takes it")
    q.add_argument("--embedding-model", default="default",
                   help="the embedding model Open WebUI's RAG uses (default: serve's default, all-MiniLM-L6-v2)")
    q.add_argument("--stages", type=int, default=ClusterConfig.stages, help="local stage processes (default %(default)s)")
    q.add_argument("--max-tokens", type=int, default=48,
                   help="serve's --max-tokens: the answer's length (Open WebUI sends none; default %(default)s)")
    q.add_argument("--open-webui", default=OPEN_WEBUI, help="what pip installs (default %(default)s)")
    q.add_argument("--venv", default=str(venv_dir()),
                   help="Open WebUI's virtual environment (default $MLXPIPE_HOME/bench/openwebui/venv)")
    q.add_argument("--timeout", type=float, default=600, help="seconds for each step in the page (default %(default)s)")
    q.add_argument("--builtin-tools", action="store_true",
                   help="leave Open WebUI's built-in tools on (its default: ~40 tool definitions in every chat "
                        "request; by default the bench turns them off, for a small model)")
    q.add_argument("--keep", action="store_true", help="keep Open WebUI's data folder (its log, the screenshots)")
    q.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None, help="as the other modes")
    q.add_argument("--serve-args", default="", help="more options for the mlxpipe serve it starts")
    q.add_argument("--json", default=None, help="also write the results as JSON to this file")
    q.set_defaults(measure=bench_openwebui)
