"""A quantized KV cache through the pipeline gives mlx-lm's greedy tokens: the same
``generate_step(kv_bits=..., kv_group_size=..., quantized_kv_start=...)`` on the same weights,
8 streams batched, prefix-cache hits, a replay after a lost stage and a speculating stream.

In the default run: the served folder of the default model at 4 bits from position 0
(``serve --kv-bits 4 --quantized-kv-start 0``), on real stage processes, one stream and
then several batched. Fragile by nature (the same GGUF converted with q/k laid out for
traditional RoPE, the same model mathematically, gives other tokens for most prompts
at 4 bits), so only a test on the folder that is served keeps it.

In the extended run, the matrix: the start is 64, past these prompts (34 to 45 tokens)
and inside their generations, so streams switch at different steps of one decode group
(mlx-lm switches each where its ``generate_step`` would: ``shards/params/kv.py``). It runs
in one process (``inproc.py``: real shards and scheduler, frames handed over without
gRPC); the default model at 2 stages and 4 bits also runs through real stage processes."""

from __future__ import annotations

import asyncio
import functools

import pytest
from conftest import PROMPTS, REPEAT_CODE, run_async
from inproc import InProcess

from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.config import ClusterConfig
from mlxpipe.server.core.scheduler import SchedulerConfig
from mlxpipe.server.core.streams import collect
from mlxpipe.shards.cache.kinds import kv_switch
from mlxpipe.shards.params.kv import KvQuant

START = 64
NEW_TOKENS = 24
MORE = ["Name a color.", "What is two plus two? Answer with a number and a short explanation.",
        "Describe a cat in one sentence.", "Give me a haiku about autumn leaves.",
        "Translate 'good morning' into French, Spanish and German, please."]


def _prompts(path):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(path)
    chat = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            for p in [*PROMPTS, *MORE, REPEAT_CODE]]
    return chat[:-1], chat[-1], tok.eos_token_ids


def _want(reference, path, prompts, bits, quantizes):
    kv = (bits, 64, START) if quantizes else None  # (mlx-lm cannot quantize MLA caches: it raises)
    return [reference(path, p, NEW_TOKENS, kv) for p in prompts]


@pytest.mark.extended  # the quantized-KV matrix: CI's second run (`pytest -m extended`)
@pytest.mark.parametrize("model, stages, bits", [("default_model", 3, 8), ("dsv3_model", 2, 8), ("dsv3_model", 3, 4)])
def test_quantized_kv_equals_mlx_lm_in_process(model, stages, bits, request, reference):
    path = request.getfixturevalue(model)
    prompts, repeat, eos = _prompts(path)
    layers = 30 if model == "default_model" else 4
    cuts = [layers * i // stages for i in range(stages + 1)]
    config = SchedulerConfig(chunk_size=8, num_groups=stages, max_prefill_inflight=stages, kv_start=START,
                             prefix_blocks=256, speculate=True, spec_max_running=stages, spec_frames=stages)
    ip = InProcess(path, list(zip(cuts, cuts[1:])), config, eos, kv=KvQuant(bits, 64, START))
    quantizes = all(st.kv.slots for st in ip.stages)
    assert quantizes == (model == "default_model"), "DeepSeek-V3's MLA caches stay at full precision"
    if not quantizes:  # ... and its stages say why, in one line
        note = kv_switch(ip.stages[0].model, ip.stages[0].hidden_size, KvQuant(bits, 64, START))[2]
        assert note.startswith("its attention cannot read quantized keys and values") and "\n" not in note
    want = _want(reference, path, prompts, bits, quantizes)

    outs, seqs = ip.generate(prompts, NEW_TOKENS)  # 8 streams in decode groups
    assert outs == want
    if quantizes:  # every stream switches inside its generation, where mlx-lm's does, some past their end
        assert {s.kv_at for s in seqs} == {START}
        ends = [len(p) + len(o) for p, o in zip(prompts, outs)]
        assert min(ends) < START < max(ends), "streams of one group must switch at different steps"
    # Again, from the prefix cache (blocks kept quantized where the first run had switched),
    # and the stages losing every sequence mid-way: each replayed from its tokens so far.
    again, seqs = ip.generate(prompts, NEW_TOKENS, replay_after=3 * len(prompts))
    assert again == want and all(s.cached_tokens >= 16 for s in seqs)
    (alone,), _ = ip.generate([repeat], NEW_TOKENS)  # one stream: it verifies drafts
    assert alone == _want(reference, path, [repeat], bits, quantizes)[0]
    if model == "default_model":
        assert ip.scheduler.drafts.accepted > 0, "the copied code was not drafted"


async def _streams(cluster, prompts):
    """``prompts`` through ``cluster`` at once: each one's greedy tokens, and its cached tokens."""
    streams = [cluster.engine.submit(p, NEW_TOKENS) for p in prompts]
    outs = [[t.id for t in toks] for toks in await asyncio.gather(*map(collect, streams))]
    return outs, [s.cached_tokens for s in streams]


@pytest.mark.extended
def test_quantized_kv_through_stage_processes(default_model, reference):
    """`--kv-bits 4` on real stage processes: 8 streams at once, then again from the prefix
    cache, then a speculating stream: mlx-lm's tokens with the same KV quantization."""
    prompts, repeat, _ = _prompts(default_model)
    cfg = ClusterConfig(model=str(default_model), stages=2, chunk_size=8, kv_bits=4, quantized_kv_start=START)

    async def go():
        async with Cluster(cfg) as cluster:
            run = functools.partial(_streams, cluster)

            first, _ = await run(prompts)
            again, cached = await run(prompts)
            (alone,), _ = await run([repeat])
            await cluster.engine.drain()
            loads = [st.load for st in cluster.pipeline.stages]
            return first, again, cached, alone, cluster.kv_line(), loads, cluster.engine.scheduler.drafts

    first, again, cached, alone, line, loads, drafts = run_async(go(), timeout=600)
    want = _want(reference, default_model, prompts, 4, True)
    assert first == want and again == want
    assert all(c >= 16 for c in cached)
    assert alone == _want(reference, default_model, [repeat], 4, True)[0] and drafts.accepted > 0
    assert line.startswith("KV cache 4-bit (group 64)") and all(r.kv_cache.bits == 4 for r in loads)
    for r in loads:  # a token's KV bytes at 4 bits: its values a fifth of float32's, scales and biases included
        assert r.kv_bytes_per_token / r.kv_full_bytes_per_token == pytest.approx((0.5 + 8 / 64) / 4)


def test_4_bit_kv_from_position_0_on_the_served_folder(default_model, reference):
    """`serve --kv-bits 4 --quantized-kv-start 0` on the default model's own folder, 2 stage
    processes: every stream's caches turn quantized after its prompt's first prefill call,
    as mlx-lm's do. One stream alone (it drafts from its prompt, so its stages rewind
    quantized caches too), then three at once in decode groups (that one again, now after
    its quantized prefix blocks, and two chat prompts): mlx-lm's tokens with
    ``generate_step(kv_bits=4, quantized_kv_start=0)`` on the same folder, every time."""
    prompts, repeat, _ = _prompts(default_model)
    batch = [repeat, *prompts[:2]]  # (the first's reference is the lone stream's: two more to compute)
    cfg = ClusterConfig(model=str(default_model), stages=2, kv_bits=4, quantized_kv_start=0)

    async def go():
        async with Cluster(cfg) as cluster:
            run = functools.partial(_streams, cluster)

            (alone,), _ = await run([repeat])
            together, cached = await run(batch)
            return alone, together, cached, [st.load for st in cluster.pipeline.stages], cluster.engine.scheduler.drafts

    alone, together, cached, loads, drafts = run_async(go(), timeout=300)
    assert all(r.kv_cache.bits == 4 and r.kv_cache.start == 0 for r in loads)
    assert cached[0] > max(cached[1:])  # the repeat resumes after its own blocks, the others after the template's
    kv = (4, 64, 0)
    assert alone == reference(default_model, repeat, NEW_TOKENS, kv) and drafts.accepted > 0
    assert together == [reference(default_model, p, NEW_TOKENS, kv) for p in batch]
    # The equality means something: at 4 bits from position 0 this prompt's first token is
    # already another than at full precision (a prefill and one token of mlx-lm's to know).
    assert alone[:1] != reference(default_model, repeat, 1)
