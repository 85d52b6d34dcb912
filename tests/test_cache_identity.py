"""A prefix cache keyed by what was computed: the weights' content, never their names
or sizes (issue 42, finding 1), and tier directories that stay inside the home.

The attack as it was made: a copy of the default model whose second stage's
``k_proj`` scales are changed in place (the same files, names and sizes: the same
``fingerprint``) served with the first model's $MLXPIPE_HOME, its disk tier full of
the first model's blocks."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from server_proc import ServerProcess

from mlxpipe.shards.cache.disk import DIR
from mlxpipe.shards.models.store import fingerprint
from mlxpipe.shards.models.weights import read_header

SYSTEMS = ["You are a terse geography tutor. Answer with one fact and nothing else, please.",
           "Pretend to be a ship's cook from the eighteenth century who only speaks of soup.",
           "Reply as a patient chess coach. Always suggest one opening and explain it briefly.",
           "Answer every question as a haiku about the weather in early spring in the mountains."]
QUESTION = "Tell me something about rivers, and why people have always built their towns beside them."


def changed_in_place(src: Path, out: Path, layers: range, factor: float = 0.6, what: str = "k_proj.scales") -> Path:
    """A copy of the model folder ``src`` whose ``what`` tensors of ``layers`` are multiplied
    by ``factor``, written over their own bytes: every file keeps its name and size."""
    out.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, out / f.name)  # (follows the test home's links: a real copy)
    path = out / "model.safetensors"
    header, start = read_header(path)
    names = [n for n in header if n.endswith(what) and any(f".layers.{i}." in n for i in layers)]
    assert len(names) == len(layers)
    tensors = mx.load(str(path))
    with open(path, "r+b") as f:
        for name in names:
            new = (tensors[name] * factor).astype(tensors[name].dtype)
            mx.eval(new)
            lo, hi = header[name]["data_offsets"]
            assert new.nbytes == hi - lo
            f.seek(start + lo)
            f.write(bytes(memoryview(new)))
    return out


def _serve(model: Path, home: Path) -> ServerProcess:
    return ServerProcess("--model", str(model), "--stages", "2", "--split", "even", "--max-tokens", "12",
                         "--temp", "0", "--no-speculate", env=dict(os.environ, MLXPIPE_HOME=str(home)))


def _chats(srv: ServerProcess, **extra):
    """Each chat's answer and its cached prompt tokens (the chats share no block: each
    begins with its own system prompt)."""
    out = []
    for system in SYSTEMS:
        r = httpx.post(f"{srv.base_url}/chat/completions", timeout=300, json={
            "model": "default", "messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": QUESTION}], **extra})
        assert r.status_code == 200, r.text
        body = r.json()
        out.append((body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]))
    return out


@pytest.mark.extended  # three servers of the default model: CI's second run
def test_a_model_changed_in_place_never_reads_another_models_blocks(default_model, tmp_path):
    home = tmp_path / "home"
    swapped = changed_in_place(default_model, tmp_path / "swapped" / "model", range(15, 30))  # stage 1's layers
    assert fingerprint(swapped) == fingerprint(default_model)  # names and sizes: what the tier was named by
    srv = _serve(default_model, home)
    try:
        first = _chats(srv)
    finally:
        srv.stop()  # (the stages finish writing their blocks)
    assert [cached for _, cached in first] == [0] * 4
    srv = _serve(swapped, home)  # the first model's disk tier, full
    try:
        served = _chats(srv)
        own = _chats(srv, cache_salt="no block of the first model can have this salt")  # its cache-off answers
    finally:
        srv.stop()
    assert [cached for _, cached in own] == [0] * 4
    assert [cached for _, cached in served] == [0] * 4, served
    assert [text for text, _ in served] == [text for text, _ in own]
    assert [text for text, _ in first] != [text for text, _ in own]  # the change matters to what is said
    # Each stage's tier is named by what it loaded: stage 0's layers are the same in both, stage 1's not.
    assert len([d for d in (home / DIR).iterdir() if d.is_dir()]) == 3
