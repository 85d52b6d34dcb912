"""Long context through the pipeline: tiny random-weight models whose configs carry the real
long-context machinery (``bench/tiny.py`` ``LONG_CONTEXT``: DeepSeek-V3's YaRN x40,
Llama 3.1's "llama3" scaling, Gemma 3's 512-token windows beside linearly scaled global
layers, Qwen3-Next's linear attention beside full attention), at 2 and 3 stages, on a prompt
of more than 32,768 tokens: prefilled in chunks, then again from the prefix cache (all but
its last block's tail reused), then while speculating. Greedy tokens equal single-process
mlx-lm's on the same weights every time.

The KV precision is one more axis (``KV_BITS``): with
``--kv-bits``, the reference is ``generate_step(..., kv_bits=..., kv_group_size=...,
quantized_kv_start=0)`` and the cluster runs with the same; the models' head dimensions
(32) take KV groups of 32.

Three long-lived node processes serve every model and split in turn; each (model, KV
precision) has one mlx-lm reference; the prompt is prefilled cold once per split.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Dict, List, Tuple

import pytest
from conftest import run_async

from mlxpipe.bench import models as matrix
from mlxpipe.bench import tiny

pytestmark = pytest.mark.extended  # 32k-token prompts: CI's second run (`pytest -m extended`)

LONG = 32_768 + 21   # prompt tokens: 32 chunks and a tail, past every window and YaRN's original 4,096
NEW = 16             # tokens generated
CHUNK = 1024         # prefill tokens per frame
KV_BITS = [16, 8]    # 4-bit: tests/test_kv_equality.py, at short prompts
KV_GROUP = 32
# Each model at the split its layers allow (``tiny.LONG_CONTEXT``: a layer per stage at most): 2 stages
# where every layer is full attention, 3 where two of three are cheap. A split more is one more entry.
SPLITS = [("deepseek_v3", 2), ("llama", 2), ("gemma3_text", 3), ("qwen3_next", 3)]
# Quantized KV where mlx-lm's reference can quantize it: not MLA (DeepSeek-V3: its caches stay at full
# precision, and mlx-lm raises) nor rotating windows (Gemma 3: mlx-lm raises; the stages quantize its globals).
QUANTIZABLE = {"llama", "qwen3_next"}
CASES = [(t, n, b) for b in KV_BITS for t, n in SPLITS if b == 16 or t in QUANTIZABLE]  # 9 to 35 s each
TIMES: Dict[str, float] = {}  # seconds per test, printed at the end (the cost of 32k positions in CI)


def _prompt() -> List[int]:
    return [(i * 7919) % 40000 + 100 for i in range(LONG)]


@pytest.fixture(scope="module")
def long_zoo(tmp_path_factory, default_model):
    """Three node processes, the long-context models (built on first use), and mlx-lm's
    tokens for each (model, KV bits)."""
    root = tmp_path_factory.mktemp("long")
    pool = matrix.NodePool(3, root / "models", root / "home")
    pool.models_dir.mkdir()
    pool.start()
    built = {t: tiny.build(t, pool.models_dir / t, default_model, extra=tiny.LONG_CONTEXT[t])
             for t in dict.fromkeys(t for t, _ in SPLITS)}
    # mlx-lm's tokens, each computed once, on a thread of their own: while the stages of one
    # test prefill, this process computes the next references (MLX lets go of the GIL).
    worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlx-lm")
    refs = {(t, b): worker.submit(_mlx_lm, built[t], b) for t, b in dict.fromkeys((t, b) for t, _, b in CASES)}
    try:
        yield pool, built, lambda t, b: refs[t, b].result()
    finally:
        for f in refs.values():
            f.cancel()
        worker.shutdown(wait=True)
        pool.stop()
        print("\nlong-context tests, seconds each:", {k: round(v) for k, v in TIMES.items()})


def _mlx_lm(path, kv_bits: int) -> List[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model = load_model(path)[0]
    quant = dict(kv_bits=kv_bits, kv_group_size=KV_GROUP, quantized_kv_start=0) if kv_bits < 16 else {}
    return [t for t, _ in generate_step(mx.array(_prompt()), model, max_tokens=NEW, **quant)]


def _config(path, nodes: List[str], kv_bits: int):
    from mlxpipe.proto.rpc import Security
    from mlxpipe.server.config import ClusterConfig

    kv = {} if kv_bits == 16 else dict(kv_bits=kv_bits, kv_group_size=KV_GROUP, quantized_kv_start=0)
    return ClusterConfig(model=str(path), nodes=nodes, split="even", chunk_size=CHUNK,
                         security=Security(secret=matrix.SECRET), **kv)


async def _three_ways(cluster, prompt: List[int], reference) -> Tuple[Dict[str, str], int, Tuple[int, int]]:
    """Cold (while ``reference()``, mlx-lm's tokens, is computed beside it), from the prefix
    cache, speculating: what differed (empty: nothing), the prompt tokens the second run
    reused, and (drafts judged, accepted) of the third."""
    engine, bad = cluster.engine, {}

    async def tokens():
        stream = engine.submit(prompt, NEW, stop_at_eos=False)
        return [t.id async for t in stream], stream.cached_tokens

    def check(name: str, got: List[int]) -> None:
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            bad[name] = f"differs at token {at}: {got} vs mlx-lm's {want}"

    (cold, cached), want = await asyncio.gather(tokens(), asyncio.to_thread(reference))
    assert len(set(want)) >= 6, f"mlx-lm's tokens hardly vary: {want}"
    assert cached == 0
    check("cold", cold)
    again, cached = await tokens()
    check("prefix cache", again)
    drafts, drafters = engine.scheduler.drafts, engine.scheduler.speculator.drafters
    judged, accepted = drafts.judged, drafts.accepted
    engine.scheduler.speculator.drafters = lambda seq: matrix.Oracle(seq.prompt, want)
    try:
        check("speculating", (await tokens())[0])
    finally:
        engine.scheduler.speculator.drafters = drafters
    return bad, cached, (drafts.judged - judged, drafts.accepted - accepted)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("model_type, stages, kv_bits", CASES)
def test_a_32k_prompt_equals_mlx_lm_cold_from_the_prefix_cache_and_speculating(long_zoo, model_type, stages,
                                                                               kv_bits):
    from mlxpipe.server.cluster.assembly import Cluster

    pool, models, reference = long_zoo
    t0 = time.monotonic()

    async def go():
        async with Cluster(_config(models[model_type], pool.addresses[:stages], kv_bits)) as cluster:
            assert cluster.engine.max_context > LONG + NEW
            return await _three_ways(cluster, _prompt(), lambda: reference(model_type, kv_bits))

    bad, cached, (judged, accepted) = run_async(go(), timeout=1800)
    TIMES[f"{model_type}-{stages}-{kv_bits}"] = time.monotonic() - t0
    assert not bad, bad
    block = 16  # --prefix-block: all but the last token's partial block comes from the cache
    assert cached == (LONG - 1) // block * block
    assert 0 < accepted < judged, (accepted, judged)
