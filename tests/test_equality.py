"""The first test of the data path: greedy tokens through any split of the model
equal single-process mlx-lm's on the same weights."""

from __future__ import annotations

import asyncio

import pytest
from conftest import PROMPTS, run_async

from mlxpipe.server.cluster import Cluster, ClusterConfig
from mlxpipe.server.engine import collect

NEW_TOKENS = 32


async def _pipeline_tokens(model_path, stages, prompts, split=None):
    cfg = ClusterConfig(model=str(model_path), stages=stages, split=split, chunk_size=8)
    async with Cluster(cfg) as cluster:
        streams = [cluster.engine.submit(p, NEW_TOKENS) for p in prompts]
        outs = [[t.id for t in toks] for toks in await asyncio.gather(*map(collect, streams))]
        await cluster.engine.drain()
        health = await cluster.pipeline.health()
        ranges = [(st.start, st.end) for st in cluster.pipeline.stages]
        return outs, health, ranges


def _prompt_ids(model_path):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(model_path)
    return [tok.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("model", ["default_model", "dsv3_model"])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_greedy_tokens_equal_mlx_lm(model, stages, request, reference):
    path = request.getfixturevalue(model)
    prompts = _prompt_ids(path)
    outs, health, ranges = run_async(_pipeline_tokens(path, stages, prompts))
    # Real stage processes, each holding its own contiguous, half-open range.
    assert len(health) == stages
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for st, reply, err in health:
        assert err == "" and reply.state == "ready" and (reply.start, reply.end) == (st.start, st.end)
        assert list(reply.live_seqs) == [], "finished sequences must be freed on every stage"
    for prompt, got in zip(prompts, outs):
        want = reference(path, prompt, NEW_TOKENS)
        assert got == want, f"pipeline of {stages} stages diverged from mlx-lm"


def test_uneven_split_equals_mlx_lm(default_model, reference):
    prompts = _prompt_ids(default_model)[:1]
    outs, _, ranges = run_async(_pipeline_tokens(default_model, 2, prompts, split="7,23"))
    assert ranges == [(0, 7), (7, 30)]
    assert outs[0] == reference(default_model, prompts[0], NEW_TOKENS)
