"""Every kind of architecture through the pipeline: the coverage matrix's representative
subset on real stage processes (the whole matrix: ``mlxpipe bench models``), the
cache mechanics underneath (snapshots, rewinds, state at prefix blocks), and the
head's use of what the stages' caches can do."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import run_async
from inproc import InProcess, WiredScheduler
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlxpipe.bench import models as matrix
from mlxpipe.bench import tiny
from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.core.drafting import PromptLookup
from mlxpipe.server.core.prefix_index import PrefixIndex, chain_hashes, snapshot_every
from mlxpipe.server.core.scheduler import SchedulerConfig
from mlxpipe.server.core.sequence import Seq
from mlxpipe.shards.cache import kinds
from mlxpipe.shards.models.slicing import UNSUPPORTED
from mlxpipe.shards.params.sampling import Sampling

# One of each kind: attention only (llama; DeepSeek-V3's latent attention), sliding
# windows (gemma3_text; gpt-oss), hybrid linear attention (qwen3_next, qwen3_5), a pure
# state-space model (mamba2), short convolutions (lfm2), Nemotron-H's blocks without
# caches, and baichuan_m1's lists of caches.
SUBSET = ["llama", "deepseek_v3", "gemma3_text", "gpt_oss", "qwen3_next", "qwen3_5", "mamba2", "lfm2",
          "nemotron_h", "baichuan_m1"]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, default_model):
    """Three long-lived node processes that load one tiny model after another, and the models."""
    root = tmp_path_factory.mktemp("zoo")
    pool = matrix.NodePool(3, root / "models", root / "home")
    pool.models_dir.mkdir()
    pool.start()
    built = {}

    def model(model_type):
        if model_type not in built:
            built[model_type] = tiny.build(model_type, pool.models_dir / model_type, default_model)
        return built[model_type]

    try:
        yield pool, model, matrix.References()
    finally:
        pool.stop()


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("model_type", SUBSET)
def test_architecture_equals_mlx_lm(zoo, model_type, stages):
    """Plain, after a prefix-cache hit (cached_tokens > 0), while speculating with accepted
    and rejected drafts, and after a node's kill -9 and replay: mlx-lm's tokens."""
    pool, model, ref = zoo
    path = model(model_type)
    assert len(set(ref(path, matrix.prompts()[0]))) >= 8, "the toy model's greedy tokens hardly vary"
    outcome = run_async(matrix.check_type(model_type, path, pool, stages, ref), timeout=300)
    assert not outcome.refused, outcome.refused
    assert outcome.results == dict.fromkeys(matrix.SCENARIOS, "ok"), outcome.results


def test_a_range_whose_blocks_need_more_than_the_hidden_state_is_refused_at_load(zoo):
    """rwkv7's blocks hand each other their first block's values: no cut is possible, and
    the head says why before any stage loads (the tracing forward found it, not a list of
    names: shards/models/cuts.py)."""
    pool, model, ref = zoo
    outcome = run_async(matrix.check_type("rwkv7", model("rwkv7"), pool, 2, ref), timeout=120)
    assert "block 3 reads what block 2 returns besides the hidden state" in outcome.refused, outcome


def test_every_type_mlx_lm_ships_is_in_the_matrix():
    listed = set(tiny.model_types())
    assert {"gemma3_text", "qwen3_next", "mamba2", "nemotron_h"} <= listed and len(listed) > 100
    assert set(UNSUPPORTED) <= listed and set(tiny.NOT_HERE) <= listed


# -- rewinds with positions computed again, in one process ---------------------------------------


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_next"])
def test_verify_frames_of_several_positions_rewind_exactly(zoo, model_type):
    """A miss inside a verify frame of 3 positions: state caches go back to the frame's
    snapshot and its accepted positions are computed again; tokens stay mlx-lm's."""
    _, model, ref = zoo
    path = model(model_type)
    prompt = matrix.prompts()[0]
    want = ref(path, prompt)
    config = SchedulerConfig(chunk_size=8, speculate=True, spec_depth=5, spec_positions=3, num_groups=2,
                             spec_max_running=2, spec_frames=2, max_prefill_inflight=2)
    pipe = InProcess(path, [(0, 3), (3, 6)], config)
    pipe.scheduler.speculator.drafters = lambda seq: matrix.Oracle(prompt, want)
    (got,), _ = pipe.generate([prompt], matrix.NEW_TOKENS)
    assert got == want
    assert 0 < pipe.scheduler.drafts.accepted < pipe.scheduler.drafts.judged


# -- cache mechanics ------------------------------------------------------------------------------


def test_sizes_and_blocks_under_their_architectures_names():
    from mlxpipe.shards.models.layers import layer_list, with_sizes

    assert with_sizes({"n_embd": 64, "n_layer": 6, "vocab_size": 9}) | {} == {
        "n_embd": 64, "n_layer": 6, "vocab_size": 9, "hidden_size": 64, "num_hidden_layers": 6}
    model, _ = tiny.make_model("gpt2")  # its blocks sit in `h`; its `layers` property names them
    assert layer_list(model) is model.model.h


def test_kinds_come_from_mlx_lm_classes():
    assert kinds.positional(KVCache()) and kinds.sliceable(KVCache())
    assert not kinds.positional(RotatingKVCache(8)) and not kinds.positional(ArraysCache(2))
    assert kinds.signature(RotatingKVCache(8)) != kinds.signature(RotatingKVCache(16))


def test_a_snapshot_survives_writes_in_place_and_restores():
    c = RotatingKVCache(max_size=4)
    for i in range(3):
        c.update_and_fetch(mx.full((1, 1, 1, 2), float(i)), mx.full((1, 1, 1, 2), float(i)))
    saved = kinds.snapshot(c)
    c.update_and_fetch(mx.full((1, 1, 1, 2), 9.0), mx.full((1, 1, 1, 2), 9.0))  # writes into its buffer
    c.update_and_fetch(mx.full((1, 1, 1, 2), 8.0), mx.full((1, 1, 1, 2), 8.0))  # and rotates
    kinds.restore(c, saved)
    assert c.offset == 3 and c.keys[0, 0, :3, 0].tolist() == [0.0, 1.0, 2.0]
    kinds.restore(c, saved)  # a snapshot can be restored again
    assert c.offset == 3


def test_rewind_trims_positional_caches_and_restores_state_ones():
    kv, state = KVCache(), ArraysCache(1)
    rewind = kinds.Rewind(horizon=8)
    step = lambda v: (kv.update_and_fetch(mx.full((1, 1, 1, 2), v), mx.full((1, 1, 1, 2), v)),
                      state.__setitem__(0, mx.array([v])))
    step(0.0)
    rewind.mark([kv, state], 1, [5, 6], None)   # a verify frame of two positions
    step(1.0), step(2.0)
    again = []
    rewind.back([kv, state], 3, 1, lambda tokens, hidden, caches: (again.append(tokens), step(1.0)))
    assert again == [[5]] and kv.offset == 2 and state[0].tolist() == [1.0]


# -- the head: where sequences may start, how far drafts may go ----------------------------------


def test_a_reuse_ends_at_a_block_every_stage_can_start_after():
    idx = PrefixIndex(4, capacity=10, num_stages=2)
    idx.reset([[], []], 10, [None, set()])  # stage 1 has state caches
    evicted = []
    assert idx.add([1, 2, 3], set(), evicted, 10, start=2) == 3
    assert idx.match([1, 2, 3]) == 2   # block 3's end state was never kept
    idx.evict(5, {1, 3})
    assert idx.match([1, 2, 3]) == 0
    assert snapshot_every(16, [(100, 0)]) == 0 and snapshot_every(16, [(100, 4000)]) == 3


def _running(s, prompt):
    seq = Seq(seq_id=1, prompt=list(prompt), max_tokens=40, sampling=Sampling())
    s.add(seq)
    frames = s.schedule()
    while seq.generated == []:
        for f in frames:
            s.on_result(pb.Result(frame_id=f.frame_id, tokens=[pb.TokenResult(seq_id=1, token=50)]
                                  if f.seqs and f.seqs[0].sample else []))
        frames = s.schedule()
    return seq, frames


def test_chunks_end_at_block_boundaries_and_snapshots_are_asked_there():
    s = WiredScheduler(SchedulerConfig(chunk_size=12, block_tokens=4, prefix_blocks=100, max_prefill_inflight=100))
    s.reset_prefix([[], []], 100, [set(), None], snapshot_every=3)
    prompt = list(range(100, 127))  # 27 tokens: a body of 26, its last block boundary at 24
    s.add(Seq(seq_id=1, prompt=prompt, max_tokens=3, sampling=Sampling()))
    frames = s.schedule()
    bounds = [(f.seqs[0].offset, f.seqs[0].num_tokens) for f in frames]
    assert bounds == [(0, 12), (12, 12), (24, 2), (26, 1)]
    snaps = [(f.seqs[0].offset, f.seqs[0].store_first + len(f.seqs[0].store)) for f in frames if f.seqs[0].snap]
    assert snaps == [(12, 3), (24, 6)]  # every third block, and the last of the prompt's body
    hashes = chain_hashes(prompt, 4, [], 6)
    assert s.prefix.match(hashes) == 6 and s.prefix.match(hashes[:5]) == 3


def test_no_speculation_where_a_stage_cannot_take_drafts_back():
    config = SchedulerConfig(speculate=True, spec_depth=4, spec_frames=8, max_prefill_inflight=8)
    one_token = lambda seq: PromptLookup(min_ngram=1)  # noqa: E731 - 50 drafts 51 52 ...
    s = WiredScheduler(config, drafters=one_token)
    s.core.max_rewind = 0
    _, frames = _running(s, [50, 51, 52, 53, 9, 8, 7])
    assert frames and all(f.kind == pb.Frame.DECODE for f in frames)
    s = WiredScheduler(config, drafters=one_token)
    s.core.max_rewind = 2
    _, frames = _running(s, [50, 51, 52, 53, 9, 8, 7])
    assert [f.kind for f in frames] == [pb.Frame.VERIFY] * 3  # the last token and 2 drafts: no more in flight
