"""Shared fixtures: the embedded default model, a tiny DeepSeek-V3, mlx-lm references,
and one server process per configuration that several test modules drive."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import os
import sys
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).parent))
# No hub is reachable from tests: a name shaped like a repo id fails at once
# (set before huggingface_hub reads it; tests that download start their own
# fake hub and point HF_ENDPOINT at it).
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")


def _private_home() -> Path:
    """Run the whole session (and every process it starts) in a fresh
    $MLXPIPE_HOME: profiles, received weights and quantized units from one run
    must never change another's plans, nor land in the user's own cache. Only
    the embedded default model is shared, read-only, from the user's cache
    (pulled there once): its files are linked into the fresh home's folder."""
    import tempfile

    from mlxpipe.shards.models.store import mlxpipe_home

    shared = mlxpipe_home()
    home = Path(tempfile.mkdtemp(prefix="mlxpipe-test-home-"))
    os.environ["MLXPIPE_HOME"] = str(home)
    os.environ["MLXPIPE_SHARED_HOME"] = str(shared)
    return home


TEST_HOME = _private_home()


def _link_default_model(embedding: bool = False) -> Path:
    """The default model (``embedding``: the default embedding model) in the test home: a
    real folder (node paths must stay inside their models directory), its files links to
    the shared copy."""
    from mlxpipe.shards.models.store import (default_embedding_dir, default_model_dir, pull_default,
                                             pull_default_embedding)

    mine = default_embedding_dir() if embedding else default_model_dir()
    shared = Path(os.environ["MLXPIPE_SHARED_HOME"]) / mine.relative_to(TEST_HOME)
    if not (shared / "model.safetensors").exists():
        os.environ["MLXPIPE_HOME"] = str(shared.parent.parent)
        try:
            (pull_default_embedding if embedding else pull_default)(progress=False)
        finally:
            os.environ["MLXPIPE_HOME"] = str(TEST_HOME)
    mine.mkdir(parents=True, exist_ok=True)
    for f in shared.iterdir():
        if not (mine / f.name).exists():
            (mine / f.name).symlink_to(f)
    return mine


if (Path(os.environ["MLXPIPE_SHARED_HOME"]) / "models").exists():
    _link_default_model()  # now, for commands in tests that name "default" without the fixture


def pytest_sessionfinish(session, exitstatus):
    import shutil

    shutil.rmtree(TEST_HOME, ignore_errors=True)

PROMPTS = [
    "Why is the sky blue?",
    "Write a short poem about the sea and the mountains.",
    "List three prime numbers and explain what makes a number prime.",
]
# A prompt whose answer copies from it: speculative decoding drafts the copy from the prompt.
REPEAT_CODE = "Repeat this code exactly:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"


@pytest.fixture(scope="session")
def default_model() -> Path:
    return _link_default_model()


@pytest.fixture(scope="session")
def default_server(default_model):
    """`mlxpipe serve` of the default model on 2 local stages, shared by every module that
    drives this configuration (test_api, test_browser, test_containment, test_protocols):
    one process for the session instead of one per module. Requests that name no
    temperature are greedy and those that name no budget get 64 tokens (agents name
    neither, and the tests need them brief). Warmed: the first requests of a kind
    compile MLX's CPU kernels for their shapes, seconds in which every stream waits,
    which the canary tests must not measure."""
    import httpx
    from server_proc import ServerProcess

    srv = ServerProcess("--model", str(default_model), "--stages", "2", "--max-tokens", "64", "--temp", "0")
    for extra in ({}, {"response_format": {"type": "json_object"}}):
        httpx.post(f"{srv.base_url}/chat/completions", timeout=120, json={
            "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra})
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def embedding_model() -> Path:
    """The default embedding model (all-MiniLM-L6-v2) in the test home."""
    return _link_default_model(embedding=True)


@pytest.fixture(scope="session")
def otlp_receiver():
    """A tiny OTLP/HTTP receiver (``otlp_receiver.py``) the team server exports its traces to."""
    from otlp_receiver import Receiver

    receiver = Receiver()
    yield receiver
    receiver.close()


# The team server's API keys (``--api-key-file``): an operator without limits, which the tests
# use unless they test a key's limit, and a key for each limit (``server/api/quotas.py``).
TEAM_KEYS = {"open": "k-open role=operator", "rpm": "k-rpm rpm=2", "tpm": "k-tpm tpm=400",
             "concurrency": "k-conc concurrency=1", "max_tokens": "k-max max_tokens=4",
             "models": "k-models models=all-MiniLM-L6-v2", "batch": "k-batch priority=batch",
             "interactive": "k-inter"}


@pytest.fixture(scope="session")
def team_server(default_model, embedding_model, otlp_receiver, tmp_path_factory):
    """`mlxpipe serve` of the default model on 2 local stages, with what a team's server runs on
    its head beside it: the default embedding model and the default model again (``--also``,
    served as ``<name>-head``), traces sent to ``otlp_receiver``, and API keys with limits
    (``TEAM_KEYS``; ``http`` is a client with the unlimited operator's); greedy, 64 tokens
    unless asked. Shared by test_embeddings, test_head_models, test_traces and test_quotas."""
    import httpx
    from server_proc import ServerProcess

    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text("\n".join(TEAM_KEYS.values()) + "\n")
    key_file.chmod(0o600)
    headers = {"Authorization": "Bearer k-open"}
    srv = ServerProcess("--model", str(default_model), "--stages", "2", "--max-tokens", "64", "--temp", "0",
                        "--embedding-model", "default", "--also", "default", "--otlp-endpoint", otlp_receiver.url,
                        "--api-key-file", str(key_file), headers=headers)
    srv.key, srv.http = "k-open", httpx.Client(headers=headers, timeout=120)
    srv.http.post(f"{srv.base_url}/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    yield srv
    srv.http.close()
    srv.stop()


@pytest.fixture(scope="session")
def vision_server(tmp_path_factory, default_model):
    """`mlxpipe serve` of a tiny Qwen2.5-VL (``bench/tiny_vision.py``) on 2 local stages, for
    test_vision_api and test_browser: greedy, 12 tokens unless asked, at most 3 images of 1 MB
    and 4 Mpixels a request, image URLs fetched (from loopback too) within 0.3 s."""
    pytest.importorskip("mlx_vlm")
    from server_proc import ServerProcess

    from mlxpipe.bench.tiny_vision import build

    path = build("qwen2_5_vl", tmp_path_factory.mktemp("vision") / "qwen2_5_vl", default_model)
    srv = ServerProcess("--model", str(path), "--stages", "2", "--max-tokens", "12", "--temp", "0",
                        "--max-images", "3", "--max-image-bytes", str(1 << 20), "--max-image-pixels", "4000000",
                        "--image-urls", "--image-private-urls", "--image-fetch-timeout-s", "0.3")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def dsv3_model(tmp_path_factory, default_model) -> Path:
    from tiny_models import build_deepseek_v3

    return build_deepseek_v3(tmp_path_factory.mktemp("dsv3") / "model", default_model)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory, dsv3_model) -> Path:
    """The tiny DeepSeek-V3 with a Qwen-style chat template: tool calls and <think> markers."""
    from tiny_models import with_chat_template

    return with_chat_template(tmp_path_factory.mktemp("chat") / "model", dsv3_model)


@pytest.fixture(scope="session")
def sources(tmp_path_factory, default_model):
    """sources(name) -> a full-precision model folder, built once per session: "dsv3" (bf16
    DeepSeek-V3), "dsv3-fp8" (FP8 + weight_scale_inv, as published), "llama" (bf16)."""
    from tiny_models import build_deepseek_v3_source, build_llama_source

    builders = {"dsv3": lambda out: build_deepseek_v3_source(out, default_model),
                "dsv3-fp8": lambda out: build_deepseek_v3_source(out, default_model, fp8=True),
                "llama": lambda out: build_llama_source(out, default_model)}
    root = tmp_path_factory.mktemp("sources")
    built = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = builders[name](root / name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def converted(tmp_path_factory, sources):
    """converted(name, bits=4, group_size=64, recipe=None) -> what `mlx_lm.convert -q` writes
    for sources(name) (bits=None: convert without quantizing); once per session."""
    from mlx_lm import convert

    root = tmp_path_factory.mktemp("converted")
    done = {}

    def get(name: str, bits=4, group_size=64, recipe=None) -> Path:
        key = (name, bits, group_size, recipe)
        if key not in done:
            out = root / "-".join(map(str, key))
            with contextlib.redirect_stdout(io.StringIO()):
                convert(str(sources(name)), str(out), quantize=bits is not None, q_bits=bits,
                        q_group_size=group_size if bits else None, quant_predicate=recipe)
            done[key] = out
        return done[key]

    return get


@pytest.fixture(scope="session")
def reference():
    """reference(path, prompt_ids, n, kv=None) -> greedy tokens of single-process mlx-lm,
    up to and including the first end-of-sequence token (computed once per prompt:
    fewer tokens of it are the first of a longer run); ``kv``: its KV quantization,
    (kv_bits, kv_group_size, quantized_kv_start)."""
    cache = {}
    models = {}

    def run(path: Path, prompt, n: int, kv=None):
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.generate import generate_step

        key = (str(path), tuple(prompt), kv)  # the longest run so far: a shorter one is its prefix
        tokens, ended = cache.get(key, ([], False))
        if len(tokens) < n and not ended:
            if str(path) not in models:
                models[str(path)] = load(str(path))
            model, tok = models[str(path)]
            tokens = []
            quantized = dict(zip(("kv_bits", "kv_group_size", "quantized_kv_start"), kv)) if kv else {}
            for token, _ in generate_step(mx.array(prompt), model, max_tokens=n, **quantized):
                tokens.append(token)
                if token in tok.eos_token_ids:
                    ended = True
                    break
            cache[key] = (tokens, ended)
        return tokens[:n]

    return run


def node_process(home: Path, *args, secret=None):
    """A `mlxpipe node` process on a free loopback port with its own $MLXPIPE_HOME:
    (process, address or None if it did not start)."""
    import subprocess

    env = dict(os.environ, MLXPIPE_HOME=str(home), MLXPIPE_SECRET=secret or SECRET)
    proc = subprocess.Popen([sys.executable, "-m", "mlxpipe.shards.worker.node", "--listen", "127.0.0.1:0",
                             "--log-level", "WARNING", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    line = proc.stdout.readline()
    return proc, (line.split()[-1] if "listening on" in line else None)


async def until(predicate, timeout: float, what: str, step: float = 0.01):
    """Wait until ``predicate()`` (a value, or an awaitable one) is true and return it;
    fail after ``timeout`` seconds saying ``what`` never came."""
    import inspect
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(step)


def run_async(coro, timeout: float = 300):
    """Run a coroutine to completion with a deadline (tests must never hang)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


SECRET = "test-cluster-secret-0123456789"


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class _WithSecret(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor,
                  grpc.UnaryStreamClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the cluster secret to every call of a synchronous test client."""

    def __init__(self, secret):
        self.secret = secret

    def _details(self, d):
        md = list(d.metadata or []) + [("authorization", f"Bearer {self.secret}")]
        return _Details(d.method, d.timeout, md, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def stage_stub(address, secret=SECRET, credentials=None):
    """A synchronous Stage client (with the secret, unless None)."""
    from mlxpipe.proto import pipeline_pb2_grpc as pb_grpc
    from mlxpipe.proto.rpc import CHANNEL_OPTIONS

    if credentials is None:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    else:
        channel = grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
    if secret is not None:
        channel = grpc.intercept_channel(channel, _WithSecret(secret))
    return pb_grpc.StageStub(channel)

