"""Embeddings from the head's embedding model (``--embedding-model default``: all-MiniLM-L6-v2)
through OpenAI's and Ollama's clients, equal to what mlx-embeddings computes for the same model in
this process, and once to an independent numpy BERT; the limits; the counters."""

from __future__ import annotations

import math

import numpy as np
import pytest

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.",
         "Pipelines cut a model by layer; each Mac runs its own range."]


@pytest.fixture(scope="module")
def library(embedding_model):
    """The embedding model as its own library runs it, one input at a time: text -> vector."""
    import mlx.core as mx
    from mlx_embeddings import load

    model, wrapper = load(str(embedding_model))
    tok = wrapper._tokenizer

    def embed(text: str) -> np.ndarray:
        ids = tok.encode(text)
        out = model(mx.array([ids]), attention_mask=mx.ones((1, len(ids)))).text_embeds
        return np.array(out[0])

    embed.tokenizer = tok
    return embed


def test_openai_sdk_equals_library(team_server, library):
    import openai

    client = openai.OpenAI(base_url=team_server.base_url, api_key=team_server.key)
    got = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)  # (the SDK asks for base64)
    assert [d.index for d in got.data] == [0, 1, 2]
    for text, d in zip(TEXTS, got.data):
        np.testing.assert_allclose(d.embedding, library(text), atol=2e-5)
    ids = [library.tokenizer.encode(t) for t in TEXTS]
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    floats = client.embeddings.create(model="anything", input=ids[1], encoding_format="float")  # token ids
    np.testing.assert_allclose(floats.data[0].embedding, library(TEXTS[1]), atol=2e-5)
    assert floats.usage.prompt_tokens == len(ids[1])


def test_ollama_client_equals_library(team_server, library):
    import ollama

    client = ollama.Client(host=team_server.root, headers={"Authorization": "Bearer k-open"})
    got = client.embed(model="all-minilm", input=TEXTS[:2])
    assert got.prompt_eval_count == sum(len(library.tokenizer.encode(t)) for t in TEXTS[:2])
    for text, vector in zip(TEXTS, got.embeddings):
        np.testing.assert_allclose(vector, library(text), atol=2e-5)
    legacy = team_server.http.post(f"{team_server.root}/api/embeddings", json={"model": "all-minilm", "prompt": TEXTS[2]})
    np.testing.assert_allclose(legacy.json()["embedding"], library(TEXTS[2]), atol=2e-5)
    long = " ".join(["word"] * 400)  # Ollama's truncate (its default) cuts an input at the model's limit
    cut = client.embed(model="all-minilm", input=long).embeddings[0]
    assert len(cut) == 384 and abs(np.linalg.norm(cut) - 1) < 1e-4


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _layer_norm(x, w, b, eps=1e-12):
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def numpy_bert(folder, ids) -> np.ndarray:
    """all-MiniLM-L6-v2 from its safetensors in float64 numpy: BERT's layers, mean pooling,
    normalization (sentence-transformers' modules.json), nothing shared with MLX."""
    from safetensors.numpy import load_file

    w = {k.removeprefix("bert."): v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()}
    e = "embeddings."
    x = w[e + "word_embeddings.weight"][ids] + w[e + "position_embeddings.weight"][: len(ids)] \
        + w[e + "token_type_embeddings.weight"][0]
    x = _layer_norm(x, w[e + "LayerNorm.weight"], w[e + "LayerNorm.bias"])
    heads = 12
    for i in range(6):
        p = f"encoder.layer.{i}."

        def lin(name, v):
            return v @ w[p + name + ".weight"].T + w[p + name + ".bias"]

        q, k, v = (lin(f"attention.self.{n}", x).reshape(len(ids), heads, -1).transpose(1, 0, 2)
                   for n in ("query", "key", "value"))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        ctx = (att @ v).transpose(1, 0, 2).reshape(len(ids), -1)
        x = _layer_norm(x + lin("attention.output.dense", ctx), w[p + "attention.output.LayerNorm.weight"],
                        w[p + "attention.output.LayerNorm.bias"])
        x = _layer_norm(x + lin("output.dense", _gelu(lin("intermediate.dense", x))), w[p + "output.LayerNorm.weight"],
                        w[p + "output.LayerNorm.bias"])
    pooled = x.mean(0)
    return pooled / np.linalg.norm(pooled)


def test_equals_an_independent_numpy_bert(team_server, library, embedding_model):
    got = team_server.http.post(f"{team_server.base_url}/embeddings", json={"model": "m", "input": TEXTS[1]}).json()
    want = numpy_bert(embedding_model, library.tokenizer.encode(TEXTS[1]))
    np.testing.assert_allclose(got["data"][0]["embedding"], want, atol=1e-4)


@pytest.mark.parametrize("body, param, words", [
    ({"input": []}, "input", "empty"),
    ({"input": ["a"] * 2049}, "input", "at most 2048"),
    ({"input": " ".join(["word"] * 300)}, "input", "at most 256 tokens per input"),
    ({"input": [[1, 2], [3, 40000]]}, "input", "vocabulary"),
    ({"input": "hi", "dimensions": 64}, "dimensions", "not trained for shorter"),
    ({"input": "hi", "model": "SmolLM2-135M-Instruct-Q4_1-head"}, "model", "makes no embeddings"),
])
def test_limits_are_a_400_naming_them(team_server, body, param, words):
    r = team_server.http.post(f"{team_server.base_url}/embeddings", json={"model": "all-MiniLM-L6-v2", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    ollama = team_server.http.post(f"{team_server.root}/api/embed", json={"model": "m", "input": "hi", "dimensions": 64})
    assert ollama.status_code == 400 and "dimensions" in ollama.json()["error"]


def test_counted_in_metrics_and_health(team_server):
    def counted():
        text = team_server.http.get(f"{team_server.root}/metrics").text
        line = next(x for x in text.splitlines() if x.startswith("mlxpipe_embedding_inputs_total"))
        return float(line.split()[-1])

    before = counted()
    team_server.http.post(f"{team_server.base_url}/embeddings", json={"model": "m", "input": ["one", "two", "three"]})
    assert counted() == before + 3
    health = team_server.http.get(f"{team_server.root}/health").json()
    assert health["embedding_model"]["name"] == "all-MiniLM-L6-v2" and health["embedding_model"]["dimensions"] == 384


def test_an_mlx_lm_model_pooled_in_batches_equals_one_at_a_time(default_model):
    """A model mlx-embeddings does not ship (the default chat model, llama) runs through mlx-lm:
    its final hidden state, last-token pooled and normalized; inputs of different lengths in one
    padded batch give each input's own vector."""
    import asyncio

    import mlx.core as mx
    from mlx_lm import load

    from mlxpipe.server.cluster.embedding_model import EmbeddingModel

    model = EmbeddingModel(default_model, "chat-as-embedding")
    try:
        assert model.facts.library == "mlx-lm" and model.facts.pooling == "last" and not model.facts.matryoshka
        ids = model.tokenize(TEXTS)
        got = asyncio.run(model.embed(ids))
    finally:
        model.close()
    lm, _ = load(str(default_model))
    for x, vector in zip(ids, got):
        hidden = lm.model(mx.array([x]))[0, -1].astype(mx.float32)
        want = np.array(hidden / mx.linalg.norm(hidden))
        np.testing.assert_allclose(vector, want, atol=1e-4)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_the_pipeline_model_pools_its_own_final_hidden_state(team_server, default_model, pooling):
    """A request naming the pipeline's model: its last stage pools the final hidden state (after
    the model's norm) over every prompt position, equal to mlx-lm's inner model in one process."""
    import mlx.core as mx
    from mlx_lm import load

    got = team_server.http.post(f"{team_server.base_url}/embeddings", json={
        "model": "SmolLM2-135M-Instruct-Q4_1", "input": TEXTS[:2], "pooling": pooling}).json()
    lm, tok = load(str(default_model))
    for text, d in zip(TEXTS, got["data"]):
        hidden = lm.model(mx.array([tok.encode(text)]))[0].astype(mx.float32)
        pooled = hidden[-1] if pooling == "last" else hidden.mean(axis=0)
        np.testing.assert_allclose(d["embedding"], np.array(pooled / mx.linalg.norm(pooled)), atol=1e-4)
    assert got["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in TEXTS[:2])
