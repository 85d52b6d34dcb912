"""Prompt log-probabilities (completions' ``echo``): scored by the last stage in the
prefill that fills the caches, exact against mlx-lm's log-softmax of the same
logits, in chunks, after a replay, beside the prefix cache, and through the API
as lm-evaluation-harness asks for them."""

from __future__ import annotations

import httpx
import pytest
from inproc import InProcess

from mlxpipe.server.core.scheduler import SchedulerConfig
from mlxpipe.shards.worker.sampler import Sampling

TEXT = "The old lighthouse keeper climbed the stairs every evening and lit the lamp for the boats."


@pytest.fixture(scope="module")
def mlx_lm_scores(default_model):
    """mlx-lm's log-softmax of its logits for a prompt: per position p >= 1, (log-probability
    of token p given those before, the top 2 ids), from one forward over the whole prompt."""
    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(str(default_model))

    def run(ids):
        logits = model(mx.array(ids)[None])[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        top = mx.argsort(-lp, axis=-1)[:, :2]
        return {p: (lp[p - 1, ids[p]].item(), top[p - 1].tolist()) for p in range(1, len(ids))}

    run.tok = tok
    return run


def _close(got: dict, want: dict, tol: float = 1e-4) -> None:
    assert sorted(got) == sorted(want)
    worst = max(abs(got[p][0] - want[p][0]) for p in want)
    assert worst <= tol, worst
    assert all(got[p][1] == want[p][1] for p in want)  # the alternatives, most likely first


@pytest.fixture(scope="module")
def pipeline(default_model):
    """Two stages in one process, prefill in chunks of 4 tokens, with a prefix cache."""
    cfg = SchedulerConfig(chunk_size=4, min_chunk=4, block_tokens=4, prefix_blocks=64)
    return InProcess(default_model, [(0, 15), (15, 30)], cfg)


def _scores(pipe, seq):
    return {p: (lp, top[0]) for p, (lp, top) in pipe.scores[seq.seq_id].items()}


def test_prompt_scores_equal_mlx_lm_in_chunks_and_after_a_replay(pipeline, mlx_lm_scores):
    ids = mlx_lm_scores.tok.encode(TEXT)
    assert len(ids) > 3 * 4  # several chunks: a chunk's first token is scored by the row before it
    want = mlx_lm_scores(ids)
    scoring = Sampling(seed=0, prompt_logprobs=True, top_logprobs=2)
    (tokens,), (seq,) = pipeline.generate([ids], 2, scoring)
    assert len(tokens) == 2
    _close(_scores(pipeline, seq), want)
    # The stages lose the sequence mid-prefill: the replay scores every position again, the same.
    (again,), (seq,) = pipeline.generate([ids], 2, scoring, replay_after=2)
    assert again == tokens
    _close({p: v for p, v in _scores(pipeline, seq).items() if p < len(ids)}, want)


def test_a_budget_of_zero_scores_the_prompt_and_generates_nothing(pipeline, mlx_lm_scores):
    ids = mlx_lm_scores.tok.encode(TEXT[:40])
    (tokens,), (seq,) = pipeline.generate([ids], 0, Sampling(seed=0, prompt_logprobs=True, top_logprobs=2))
    assert tokens == [] and seq.finish_reason == "length" and seq.generated == []
    _close(_scores(pipeline, seq), mlx_lm_scores(ids))
    assert pipeline.scheduler.idle and all(not st.seqs for st in pipeline.stages)  # freed everywhere


def test_a_scoring_request_reuses_no_cached_block_and_leaves_its_own(pipeline, mlx_lm_scores):
    ids = mlx_lm_scores.tok.encode(TEXT + " Then he slept.")
    pipeline.generate([ids], 1)  # plain: its blocks are cached
    (_,), (scored,) = pipeline.generate([ids], 1, Sampling(seed=0, prompt_logprobs=True, top_logprobs=2))
    assert scored.cached_tokens == 0  # a cached position's log-probability is unknown: all computed
    _close(_scores(pipeline, scored), mlx_lm_scores(ids))
    (_,), (plain,) = pipeline.generate([ids], 1)
    assert plain.cached_tokens >= 3 * 4


# -- through the API --------------------------------------------------------------------------


def _echo(server, **body):
    r = httpx.post(f"{server.base_url}/completions", timeout=120,
                   json={"model": "default", "echo": True, "temperature": 0} | body)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_token_ids_as_lm_eval_sends_them(default_server, mlx_lm_scores):
    tok = mlx_lm_scores.tok
    ids = tok.encode(TEXT[:80])
    want = mlx_lm_scores(ids)
    out = _echo(default_server, prompt=[ids], max_tokens=1, logprobs=1)  # a batch of one, as lm-eval sends
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and out["usage"]["completion_tokens"] == 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # as OpenAI's echo
    for p in range(1, len(ids)):
        assert abs(lp["token_logprobs"][p] - want[p][0]) <= 1e-4
        (best, value), = lp["top_logprobs"][p].items()
        assert best == tok.decode([want[p][1][0]]) and value >= lp["token_logprobs"][p]
    assert out["choices"][0]["text"].startswith(tok.decode(ids))
    # Scored alone (max_tokens 0): the same numbers, nothing generated.
    alone = _echo(default_server, prompt=ids, max_tokens=0, logprobs=1)
    assert alone["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][: len(ids)]
    assert alone["choices"][0]["finish_reason"] == "length" and alone["usage"]["completion_tokens"] == 0


def test_echo_of_text_streamed_and_whole(default_server, mlx_lm_scores):
    whole = _echo(default_server, prompt=TEXT[:50], max_tokens=3, logprobs=0)["choices"][0]
    assert whole["text"].startswith(TEXT[:50])
    with httpx.stream("POST", f"{default_server.base_url}/completions", timeout=120, json={
            "model": "default", "prompt": TEXT[:50], "max_tokens": 3, "echo": True, "logprobs": 0,
            "temperature": 0, "stream": True}) as r:
        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    import json

    choices = [json.loads(c)["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert sum((c["logprobs"]["token_logprobs"] for c in choices), []) == whole["logprobs"]["token_logprobs"]
    plain = _echo(default_server, prompt=TEXT[:50], max_tokens=3)["choices"][0]  # echo without logprobs
    assert plain["text"] == whole["text"] and plain["logprobs"] is None


# -- the text is its tokens' ------------------------------------------------------------------

ROMAN = "The history of the Roman Empire began when"


def _completion(server, stream: bool, **body) -> tuple:
    """(text, logprobs' tokens) of one choice, whole or put together from the stream."""
    import json

    body = {"model": "default", "prompt": ROMAN, "max_tokens": 6, "temperature": 0, "logprobs": 0,
            "stream": stream} | body
    if not stream:
        r = httpx.post(f"{server.base_url}/completions", timeout=120, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["logprobs"]["tokens"]
    with httpx.stream("POST", f"{server.base_url}/completions", timeout=120, json=body) as r:
        choices = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
    return "".join(c["text"] for c in choices), sum((c["logprobs"]["tokens"] for c in choices), [])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_text_is_the_concatenation_of_its_tokens(default_server, stream):
    """On this prompt the text was "the Roman Empire" while the tokens were [" the",
    " Roman", " Empire"]; with echo it read "...began whenthe Roman Empire", and a stream
    started with "the": mlx-lm's detokenizer drops a text's first space, and a
    continuation is no new text."""
    text, tokens = _completion(default_server, stream)
    assert tokens[0].startswith(" ")  # (the default model's greedy " the")
    assert text == "".join(tokens)
    echoed, echoed_tokens = _completion(default_server, stream, echo=True)
    assert echoed == "".join(echoed_tokens) == ROMAN + text


def test_ollama_raw_generate_keeps_the_first_space(default_server):
    import json

    body = {"model": "x", "prompt": ROMAN, "raw": True, "options": {"temperature": 0, "num_predict": 6}}
    whole = httpx.post(f"{default_server.root}/api/generate", timeout=120, json=body | {"stream": False}).json()
    text, _ = _completion(default_server, False)
    assert whole["response"] == text and text.startswith(" ")
    with httpx.stream("POST", f"{default_server.root}/api/generate", timeout=120, json=body) as r:
        parts = [json.loads(line) for line in r.iter_lines() if line]
    assert "".join(p["response"] for p in parts) == text
