"""The served context: what the KV budget holds for one request is a number every API
reports, and the head holds requests to it. One that can never fit is refused at once
with a 400 that names the limit; requests that together exceed the budget wait for room
and all complete (never an out-of-memory stage, never a 5xx).

One server over two `mlxpipe node` processes that offer little memory, so that the KV
cache, not the model, sets the context: a tiny llama (``bench/tiny.py``) with a wide KV cache
(12 KB a token) beside about 14 MB of weights a stage, whose prompts of a thousand tokens
prefill in moments (the default model's 4-bit matrices take minutes for that on a CPU)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import SECRET, node_process
from server_proc import ServerProcess

from mlxpipe.server.cli.status import from_head

NODE_MEMORY = "32MB"    # about 14 MB of weights each: a KV budget of about 1,500 tokens
MODEL_CONTEXT = 65536  # the model's max_position_embeddings
WIDE_KV = dict(num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=MODEL_CONTEXT)


@pytest.fixture(scope="module")
def tight(default_model):
    from mlxpipe.bench import tiny

    home = Path(tempfile.mkdtemp(prefix="mlxpipe-context-"))
    model = tiny.build("llama", home / "models" / "wide-kv", default_model, extra=WIDE_KV)
    nodes = [node_process(home, "--models-dir", str(model.parent), "--memory", NODE_MEMORY) for _ in range(2)]
    server = None
    try:
        assert all(address for _, address in nodes), [p.stderr.read() for p, _ in nodes]
        server = ServerProcess("--model", str(model), "--nodes", ",".join(a for _, a in nodes),
                               "--split", "even", "--temp", "0", env=dict(os.environ, MLXPIPE_SECRET=SECRET))
        banner = []
        while not banner or not banner[-1].strip().startswith("context:"):
            banner.append(server.proc.stdout.readline())
        yield server, banner
    finally:
        if server is not None:
            server.stop()
        for proc, _ in nodes:
            proc.kill()
            proc.wait()
        shutil.rmtree(home, ignore_errors=True)


def _health(server) -> dict:
    return httpx.get(f"{server.root}/health", timeout=10).json()


def _prompt(n: int, seed: int) -> list:
    """``n`` token ids, different for each ``seed`` (no prefix-cache hits between them)."""
    return [(i * 7919 + seed * 104729) % 40000 + 100 for i in range(n)]


def test_the_served_context_is_what_the_kv_budget_holds_and_every_api_says_so(tight):
    server, banner = tight
    health = _health(server)
    context, kv = health["context_length"], health["kv_tokens"]
    assert context == min(MODEL_CONTEXT, kv) < MODEL_CONTEXT  # the KV cache sets it here, not the model
    card = httpx.get(f"{server.base_url}/models").json()["data"][0]
    assert card["context_length"] == card["max_model_len"] == context
    assert httpx.get(f"{server.base_url}/models/{card['id']}").json()["max_model_len"] == context
    show = httpx.post(f"{server.root}/api/show", json={"model": card["id"]}).json()
    assert show["model_info"]["llama.context_length"] == context  # (Ollama's key: the model type's)
    assert httpx.get(f"{server.root}/api/ps").json()["models"][0]["context_length"] == context
    assert f"context:   {context} tokens per request" in banner[-1] and "KV cache" in banner[-1]
    assert f"context: {context} tokens per request" in from_head(server.root)


def test_a_request_that_can_never_fit_is_refused_at_once_naming_the_limit(tight):
    server, _ = tight
    context = _health(server)["context_length"]
    frames = [s["frames"] for s in _health(server)["stages"]]
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    limit = f"maximum context length is {context} tokens (what the stages' KV cache holds for one request"
    with pytest.raises(openai.BadRequestError) as err:  # the prompt alone
        client.completions.create(model="default", prompt=_prompt(context + 10, 1), max_tokens=8)
    assert err.value.status_code == 400 and limit in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:  # prompt and reply
        client.completions.create(model="default", prompt=_prompt(context // 2, 2), max_tokens=context)
    assert limit in str(err.value) and "Please reduce the prompt or max_tokens" in str(err.value)
    r = httpx.post(f"{server.base_url}/messages", json={
        "model": "default", "max_tokens": 16, "messages": [{"role": "user", "content": "word " * (context + 50)}]})
    assert r.status_code == 400 and f"{context} tokens" in r.text
    # Refused before any frame: the stages never saw them.
    assert [s["frames"] for s in _health(server)["stages"]] == frames


def test_requests_that_together_exceed_the_kv_budget_wait_for_room_and_all_complete(tight):
    """8 requests, each under a third of the KV budget, together more than twice it: at most
    three hold caches at once, the rest wait (the head counts them live), and every one
    answers 200 with its tokens."""
    server, _ = tight
    kv = _health(server)["kv_tokens"]
    new = 24
    each = kv // 3 - new - 8  # prompt tokens: three fit at once, four do not
    assert 8 * (each + new) > 2 * kv
    seen = {"held": 0, "waited": 0, "polls": 0}

    async def watch(done: asyncio.Event):
        async with httpx.AsyncClient(timeout=10) as http:
            while not done.is_set():
                h = (await http.get(f"{server.root}/health")).json()
                held = max(s.get("live_sequences", 0) for s in h["stages"])
                seen["held"] = max(seen["held"], held)
                seen["waited"] = max(seen["waited"], h["live_requests"] - held)
                seen["polls"] += 1
                await asyncio.sleep(0.05)

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=600)
        done = asyncio.Event()
        watcher = asyncio.ensure_future(watch(done))
        t0 = time.monotonic()
        try:
            return await asyncio.gather(*(client.completions.create(
                model="default", prompt=_prompt(each, 10 + i), max_tokens=new)
                for i in range(8))), time.monotonic() - t0
        finally:
            done.set()
            await watcher

    outs, seconds = asyncio.run(asyncio.wait_for(run(), 600))
    assert all(o.usage.prompt_tokens == each and 1 <= o.usage.completion_tokens <= new for o in outs)
    assert 2 <= seen["held"] <= 3, seen          # they ran side by side, never more than fit
    assert seen["waited"] >= 1, seen             # and the rest waited for room
    health = _health(server)
    assert health["status"] == "ok" and health["live_requests"] == 0
    print(f"8 requests of {each} + {new} tokens over a {kv}-token KV budget: {seconds:.1f} s")


def test_a_smaller_pipeline_fails_what_it_cannot_hold_and_shortens_the_rest():
    """After a fault the rebuilt pipeline may hold fewer KV positions: a waiting request that
    holds more already fails saying so; one that fits ends there at most; a later request
    over the new budget still waits its turn, alone, and never overflows it."""
    from mlxpipe.server.core.scheduler import Scheduler, SchedulerConfig
    from mlxpipe.server.core.sequence import Seq
    from mlxpipe.shards.params.sampling import Sampling

    s = Scheduler(SchedulerConfig(max_kv_tokens=1000))
    held = Seq(seq_id=1, prompt=[5] * 400, max_tokens=500, sampling=Sampling(seed=0), max_context=1000)
    held.generated = [6] * 200  # replayed: its prompt and what it generated wait to be prefilled again
    short = Seq(seq_id=2, prompt=[7] * 100, max_tokens=800, sampling=Sampling(seed=0), max_context=1000)
    s.add(held)
    s.add(short)
    events = s.resize(500)
    assert [(e.seq.seq_id, e.error) for e in events] == [
        (1, "the rebuilt pipeline's KV cache holds 500 tokens for one request; this one holds 600 already")]
    assert held.finish_reason == "error" and 1 not in s.seqs
    assert short.max_context == 500 and short.reserve == 500 and s.max_kv_tokens == 500
    s.schedule()
    assert s.kv_reserved == 500  # admitted alone, within the new budget
