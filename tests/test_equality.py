"""The first test of the data path: greedy tokens through any split of the model
equal single-process mlx-lm's on the same weights."""

from __future__ import annotations

import asyncio

import pytest
from conftest import PROMPTS, REPEAT_CODE, run_async

from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.config import ClusterConfig
from mlxpipe.server.core.streams import collect

NEW_TOKENS = 32


async def _pipeline_tokens(model_path, stages, prompts, split=None, then=None, alone=None, launch_ahead=None):
    """Greedy tokens of ``prompts`` run together; with ``then(prompts, outs)``, a second
    round of prompts built from the first (they start from the prefix cache); with
    ``alone``, a last prompt run by itself (one stream: it decodes speculatively)."""
    cfg = ClusterConfig(model=str(model_path), stages=stages, split=split, chunk_size=8, launch_ahead=launch_ahead)
    async with Cluster(cfg) as cluster:
        async def run(ps):
            streams = [cluster.engine.submit(p, NEW_TOKENS) for p in ps]
            outs = [[t.id for t in toks] for toks in await asyncio.gather(*map(collect, streams))]
            return outs, [s.cached_tokens for s in streams]

        outs, _ = await run(prompts)
        second = None
        if then is not None:
            again = then(prompts, outs)
            second = (again, *await run(again))
        third = None
        if alone is not None:
            (third,), _ = await run([alone])
            third = (third, cluster.engine.scheduler.drafts)
        await cluster.engine.drain()
        health = await cluster.pipeline.health()
        ranges = [(st.start, st.end) for st in cluster.pipeline.stages]
        return outs, health, ranges, second, third


def _chat(model_path, contents):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(model_path)
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in contents]


def _prompt_ids(model_path):
    # Chat prompts: a few dozen tokens each, so prefill runs in several chunks and
    # later turns start from whole blocks of the prefix cache.
    return _chat(model_path, PROMPTS)


@pytest.mark.parametrize("model", ["default_model", "dsv3_model"])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_greedy_tokens_equal_mlx_lm(model, stages, request, reference):
    _check_equal(request.getfixturevalue(model), stages, reference, copies=model == "default_model")


@pytest.mark.extended  # off on this CPU build: CI's second run
@pytest.mark.parametrize("model", ["default_model", "dsv3_model"])
def test_launching_ahead_changes_no_token(model, request, reference):
    """Stages that launch each block as soon as it is built and the next group's frame
    before the last one finishes (`--launch-ahead`, the default where MLX runs on a GPU;
    off on this CPU build) give mlx-lm's tokens all the same."""
    _check_equal(request.getfixturevalue(model), 3, reference, copies=model == "default_model", launch_ahead=True)


def _check_equal(path, stages, reference, copies: bool, launch_ahead=None):
    """Batched prompts, prompts from the prefix cache and a speculating stream: mlx-lm's
    tokens (``copies``: the model's answer copies code from its prompt, so drafts are accepted)."""
    prompts = _prompt_ids(path)

    def next_turns(prompts, outs):
        # The first conversation resent (prompt + answer), and a later turn of it
        # (prompt, answer, more): both start from blocks every stage kept, the
        # answer's blocks included.
        p, o = max(zip(prompts, outs), key=lambda po: len(po[0]) + len(po[1]))
        return [p + o, p + o + prompts[2][-6:]]

    (repeat,) = _chat(path, [REPEAT_CODE])
    outs, health, ranges, (again, again_outs, cached), (alone, drafts) = run_async(
        _pipeline_tokens(path, stages, prompts, then=next_turns, alone=repeat, launch_ahead=launch_ahead))
    # Real stage processes, each holding its own contiguous, half-open range.
    assert len(health) == stages
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for st, reply, err in health:
        assert err == "" and reply.state == "ready" and (reply.start, reply.end) == (st.start, st.end)
        assert list(reply.live_seqs) == [], "finished sequences must be freed on every stage"
    for prompt, got in zip(prompts, outs):
        want = reference(path, prompt, NEW_TOKENS)
        assert got == want, f"pipeline of {stages} stages diverged from mlx-lm"
    for prompt, got, hit in zip(again, again_outs, cached):
        assert hit >= 16, f"a resent prefix was not reused ({hit} cached tokens of {len(prompt)})"
        assert got == reference(path, prompt, NEW_TOKENS), f"{stages} stages diverged after a prefix-cache hit"
    assert alone == reference(path, repeat, NEW_TOKENS), f"{stages} stages diverged while speculating"
    if copies:  # (the random model's answers copy nothing)
        assert drafts.accepted > 0, f"the copied code was not drafted from the prompt: {drafts}"


def test_uneven_split_equals_mlx_lm(default_model, reference):
    prompts = _prompt_ids(default_model)[:1]
    outs, _, ranges, _, _ = run_async(_pipeline_tokens(default_model, 2, prompts, split="7,23"))
    assert ranges == [(0, 7), (7, 30)]
    assert outs[0] == reference(default_model, prompts[0], NEW_TOKENS)
