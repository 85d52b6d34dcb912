"""Models by Hugging Face repo id: `--model org/name` downloads into the Hugging Face
cache from a local fake hub (tests/fake_hub.py; HF_ENDPOINT and HF_HOME point at
the test's own), resumes a cut download, serves from the cache when the hub is
gone, and gives one-line errors; nodes that lack the model get their layers
from the head."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import SECRET, node_process
from fake_hub import FakeHub
from server_proc import ServerProcess
from tiny_models import DSV3_CONFIG

from mlxpipe.shards.models.weights import model_units, unit_file, units_for_range

REPO = "fake-org/tiny"
BIG = "fake-org/big"
PROMPT = [5, 77, 901, 33, 12]
CHAT = "Hello"
TOKENS = 12


@pytest.fixture(scope="module")
def hub(dsv3_model, tmp_path_factory):
    """REPO: the tiny model; BIG: a config and 12 MB of weights, more than one of
    huggingface_hub's 10 MiB read chunks (so a cut download has something to resume)."""
    big = tmp_path_factory.mktemp("big")
    (big / "config.json").write_text("{}")
    (big / "model.safetensors").write_bytes(os.urandom(12 << 20))
    with FakeHub({REPO: dsv3_model, BIG: big}) as hub:
        yield hub


@pytest.fixture(scope="module")
def want(dsv3_model):
    """Single-process mlx-lm's greedy text on the repo's folder: for PROMPT, and for CHAT
    as a chat (what `mlxpipe generate CHAT` prompts)."""
    from mlx_lm import generate, load

    model, tok = load(str(dsv3_model))
    chat = tok.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True)
    return {prompt: generate(model, tok, prompt=ids, max_tokens=TOKENS)
            for prompt, ids in ((tuple(PROMPT), PROMPT), (CHAT, chat))}


def _env(endpoint: str, hf_home: Path, **extra) -> dict:
    return dict(os.environ, HF_ENDPOINT=endpoint, HF_HOME=str(hf_home), **extra)


def _closed_port() -> str:
    """An endpoint where nothing listens: a hub that cannot be reached."""
    with FakeHub({}) as gone:
        return gone.url


def _pull(env: dict, repo: str = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxpipe.server.cli", "pull", repo], env=env,
                          capture_output=True, text=True, timeout=120)


def _complete(server: ServerProcess) -> dict:
    r = httpx.post(f"{server.base_url}/completions", timeout=120,
                   json={"model": REPO, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_pull_downloads_and_then_needs_no_hub(hub, dsv3_model, tmp_path):
    r = _pull(_env(hub.url, tmp_path))
    assert r.returncode == 0, r.stderr
    snapshot = Path(r.stdout.strip())
    assert snapshot.is_relative_to(tmp_path / "hub")  # the Hugging Face cache under HF_HOME
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (snapshot / name).read_bytes() == (dsv3_model / name).read_bytes()
    for env in (_env(_closed_port(), tmp_path), _env(hub.url, tmp_path, HF_HUB_OFFLINE="1")):
        again = _pull(env)
        assert again.returncode == 0 and Path(again.stdout.strip()) == snapshot, again.stderr


def test_a_download_cut_mid_file_resumes_where_it_stopped(hub, tmp_path):
    hub.cut_once["model.safetensors"] = 11 << 20  # the connection drops after 11 MiB, once
    r = _pull(_env(hub.url, tmp_path), BIG)
    assert r.returncode == 0, r.stderr
    assert (Path(r.stdout.strip()) / "model.safetensors").read_bytes() == \
        (hub.repos[BIG] / "model.safetensors").read_bytes()
    gets = [rng for m, p, rng in hub.requests if m == "GET" and p.startswith(f"/{BIG}/resolve/")
            and p.endswith("/model.safetensors")]
    assert gets == ["", f"bytes={10 << 20}-"]  # what arrived in whole 10 MiB reads is kept


@pytest.mark.parametrize("repo,endpoint,offline,message", [
    ("fake-org/nope", "hub", "0", "does not exist on "),
    (REPO, "closed", "0", "cannot be reached"),
    (REPO, "hub", "1", "HF_HUB_OFFLINE is set"),
])
def test_a_repo_that_cannot_be_had_is_a_one_line_error(hub, tmp_path, repo, endpoint, offline, message):
    r = _pull(_env(hub.url if endpoint == "hub" else _closed_port(), tmp_path, HF_HUB_OFFLINE=offline), repo)
    # (progress lines may come first: "fetching REPO from URL into ...", no traceback)
    lines = [line for line in r.stderr.strip().splitlines() if not line.startswith(f"fetching {repo} from ")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("mlxpipe pull: error: ") and repo in lines[0] and message in lines[0]


def test_serve_by_repo_id_downloads_and_empty_nodes_get_exactly_their_layers(hub, dsv3_model, want, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "nodes-hf"))  # the nodes' cache: without the repo
    nodes = [node_process(tmp_path / f"node{i}") for i in range(2)]
    server = None
    try:
        env = _env(hub.url, tmp_path / "head-hf", MLXPIPE_SECRET=SECRET)
        server = ServerProcess("--model", REPO, "--nodes", ",".join(a for _, a in nodes), "--split", "even",
                               env=env)
        out = _complete(server)
        assert out["choices"][0]["text"] == want[tuple(PROMPT)] and out["model"] == REPO
        assert httpx.get(f"{server.base_url}/models/{REPO}").json()["id"] == REPO

        snapshot = next((tmp_path / "head-hf" / "hub").glob("models--fake-org--tiny/snapshots/*"))
        units = model_units(snapshot)
        layers = [s["layers"] for s in httpx.get(f"{server.root}/health").json()["stages"]]
        for i, (start, end) in enumerate(layers):
            mine = units_for_range(units, start, end, DSV3_CONFIG["num_hidden_layers"])
            received = tmp_path / f"node{i}" / "received"
            # kept by content digest; loaded from a folder of links named as mlx-lm reads them
            assert len(list((received / "units").glob("*.safetensors"))) == len(mine)
            assert {p.name for p in received.glob("*/model-*.safetensors")} == {unit_file(u.name) for u in mine}
    finally:
        if server is not None:
            server.stop()
        for proc, _ in nodes:
            proc.kill()
            proc.wait()


def test_serve_and_generate_from_the_cache_when_the_hub_is_gone(hub, want, tmp_path):
    assert _pull(_env(hub.url, tmp_path)).returncode == 0
    env = _env(_closed_port(), tmp_path)
    server = ServerProcess("--model", REPO, "--stages", "2", "--split", "even", env=env)
    try:
        assert _complete(server)["choices"][0]["text"] == want[tuple(PROMPT)]
    finally:
        server.stop()
    out = subprocess.run([sys.executable, "-m", "mlxpipe.server.cli", "generate", "--model", REPO, "--split", "even",
                          "--max-tokens", str(TOKENS), CHAT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout == want[CHAT] + "\n", out.stderr
