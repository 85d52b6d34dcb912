"""Micro-batched pipeline: many sequences of different lengths in flight at once."""

from __future__ import annotations

import asyncio
import random

import httpx
from conftest import run_async, until
from server_proc import ServerProcess

from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.config import ClusterConfig
from mlxpipe.server.core.streams import collect


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(rng.randrange(2, 150))] for _ in range(n)]


def test_16_concurrent_requests_equal_each_run_alone(dsv3_model, reference):
    """Different prompt lengths and budgets, chunked prefill interleaved with
    decode in two groups: every answer is what mlx-lm gives it alone."""
    prompts = _prompts(16)
    budgets = [8 + (i * 5) % 20 for i in range(16)]

    async def main():
        cfg = ClusterConfig(model=str(dsv3_model), stages=2, chunk_size=16, split="even")
        async with Cluster(cfg) as cluster:
            streams = []
            for p, n in zip(prompts, budgets):
                if streams:  # arrivals spread out: each joins while the one before it decodes
                    before = streams[-1]
                    await until(lambda: before.first_token_at is not None, 60, "the previous request's first token")
                streams.append(cluster.engine.submit(p, n))
            outs = await asyncio.gather(*map(collect, streams))
            await cluster.engine.drain()
            return [[t.id for t in o] for o in outs], await cluster.pipeline.health()

    outs, health = run_async(main())
    for p, n, got in zip(prompts, budgets, outs):
        assert got == reference(dsv3_model, p, n)
    assert all(list(h.live_seqs) == [] for _, h, _ in health)


def test_cancelled_request_is_freed_while_others_continue(dsv3_model, reference):
    prompts = _prompts(3, seed=1)

    async def main():
        async with Cluster(ClusterConfig(model=str(dsv3_model), stages=2, split="even")) as cluster:
            keep_a = cluster.engine.submit(prompts[0], 150)
            doomed = cluster.engine.submit(prompts[1], 400)
            keep_b = cluster.engine.submit(prompts[2], 150)
            outs = [asyncio.ensure_future(collect(s)) for s in (keep_a, keep_b)]
            for _ in range(3):
                await doomed.__anext__()
            doomed.cancel()
            async def freed():  # the free rides on the next frame through every stage
                live = [set(h.live_seqs) for _, h, _ in await cluster.pipeline.health()]
                return live if all(doomed.seq_id not in x for x in live) else None

            live = await until(freed, 60, "the cancelled sequence to be freed on every stage")
            running = not any(o.done() for o in outs)
            out_a, out_b = await asyncio.gather(*outs)
            return [t.id for t in out_a], [t.id for t in out_b], live, running, (keep_a.seq_id, keep_b.seq_id)

    out_a, out_b, live, running, keepers = run_async(main())
    assert running, "the other requests should still be generating when the cancelled one is freed"
    for stage_live in live:
        assert set(keepers) <= stage_live, "the cancelled sequence was freed, the others kept"
        assert len(stage_live) == 2
    assert out_a == reference(dsv3_model, prompts[0], 150)
    assert out_b == reference(dsv3_model, prompts[2], 150)


def test_full_server_answers_429_with_retry_after(dsv3_model):
    srv = ServerProcess("--model", str(dsv3_model), "--stages", "2", "--groups", "1", "--max-batch", "1",
                        "--max-waiting", "1", "--split", "even")
    try:
        async def one(http, i):
            body = {"model": "default", "prompt": [5, 6, 7, i + 10], "max_tokens": 30, "temperature": 0}
            return await http.post(f"{srv.base_url}/completions", json=body)

        async def main():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(one(http, i) for i in range(8)))

        responses = run_async(main(), timeout=180)
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 429}, codes
        busy = [r for r in responses if r.status_code == 429]
        assert all(r.headers.get("retry-after") for r in busy)
        assert all(r.json()["error"]["type"] == "rate_limit_error" for r in busy)
        # The server recovers: once the load is gone, a request goes through.
        r = httpx.post(f"{srv.base_url}/completions", json={"model": "default", "prompt": [5, 6],
                                                            "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
    finally:
        srv.stop()
