"""A frame in two halves on the MLX thread (``shards/worker/launch.py``, ``shards/worker/mlx_thread.py``):
the thread launches the next independent frame before it finishes the last, and
what comes out is exactly what running the frames one after the other gives."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxpipe.proto import codec
from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.shards.models.layers import with_sizes
from mlxpipe.shards.models.slicing import load_stage
from mlxpipe.shards.worker.clock import BusyClock
from mlxpipe.shards.worker.mlx_thread import MlxThread
from mlxpipe.shards.worker.stage import Shard, ShardLimits


class _Job:
    """A frame job that records what the thread does with it."""

    def __init__(self, name, seqs, log):
        self.name, self.seqs, self.log = name, set(seqs), log

    def launch(self):
        self.log.append(f"launch {self.name}")
        return self

    def independent(self, job) -> bool:
        return self.seqs.isdisjoint(job.seqs)

    def finish(self, stolen: float) -> None:
        self.log.append(f"finish {self.name}" + (" (stolen)" if stolen > 0 else ""))


def test_the_thread_launches_one_independent_frame_ahead_and_calls_wait_for_every_frame():
    log, gate = [], threading.Event()
    thread = MlxThread("test-mlx", ahead=True)
    try:
        blocked = thread.submit(gate.wait)  # everything below is queued before the thread goes on
        for name, seqs in (("a", [1]), ("b", [2]), ("c", [2, 3])):
            thread.frame(_Job(name, seqs, log))
        called = thread.submit(lambda: log.append("call") or 7)
        thread.frame(_Job("d", [4], log))
        gate.set()
        assert blocked.result(timeout=10) is True and called.result(timeout=10) == 7
        thread.submit(lambda: None).result(timeout=10)
    finally:
        thread.shutdown()
    off = MlxThread("test-mlx-off", ahead=False)
    try:
        log2, gate2 = [], threading.Event()
        off.submit(gate2.wait)
        for name, seqs in (("a", [1]), ("b", [2])):
            off.frame(_Job(name, seqs, log2))
        gate2.set()
        off.submit(lambda: None).result(timeout=10)
    finally:
        off.shutdown()
    assert log2 == ["launch a", "finish a", "launch b", "finish b"]
    # b shares nothing with a: launched before a finishes (a waited behind it); c shares
    # sequence 2 with b: b finishes first; a plain call finds every frame before it finished.
    assert log == ["launch a", "launch b", "finish a (stolen)", "finish b", "launch c", "finish c", "call",
                   "launch d", "finish d"]


def test_busy_time_of_overlapping_frames_is_counted_once():
    clock = BusyClock()
    clock.begin()
    clock.begin()  # the next frame launched before the first finished
    clock.end(1)
    assert clock.running == 1 and clock.running_since is not None
    clock.end(1)
    assert clock.running == 0 and clock.running_since is None
    assert clock.frames == 2 and clock.tokens == 2
    spans = [seconds for _, seconds, _ in clock.recent]
    assert sum(spans) == pytest.approx(clock.busy_seconds) and clock.busy_seconds >= 0


def _shard(path, start, end):
    model, cfg = load_stage(path, start, end)
    cfg = with_sizes(cfg.get("text_config", cfg))
    return Shard(model, int(cfg["hidden_size"]), int(cfg["vocab_size"]), ShardLimits())


def _prefill(seq_id, tokens, offset=0, sample=True):
    return pb.Frame(frame_id=seq_id, kind=pb.Frame.PREFILL, tokens=tokens,
                    seqs=[pb.SeqEntry(seq_id=seq_id, offset=offset, num_tokens=len(tokens), sample=sample)])


def _decode(group, seq_id, token, offset):
    return pb.Frame(frame_id=100 + offset, kind=pb.Frame.DECODE, group=group, tokens=[token],
                    seqs=[pb.SeqEntry(seq_id=seq_id, offset=offset, num_tokens=1, sample=True)])


def _greedy(shard, overlapped: bool, steps: int = 6):
    """Two sequences, each in its own decode group, stepped together: their frames finished
    one by one, or each launched before the other finished."""
    prompts = {1: [1, 504, 3217, 314, 260], 2: [1, 9856, 28, 954, 253, 1789, 30]}
    last = {s: shard.run(_prefill(s, p)).tokens[0].token for s, p in prompts.items()}
    out = {s: [t] for s, t in last.items()}
    for k in range(steps):
        frames = [_decode(g, s, out[s][-1], len(prompts[s]) + k) for g, s in enumerate(prompts)]
        if overlapped:
            first = shard.launch(frames[0])
            assert first.independent(frames[1])
            second = shard.launch(frames[1])
            results = [first.finish(), second.finish()]
        else:
            results = [shard.run(f) for f in frames]
        for s, r in zip(prompts, results):
            out[s].append(r.tokens[0].token)
    return out


def test_overlapped_frames_sample_what_frames_one_by_one_do(default_model):
    shard = _shard(default_model, 0, 30)
    assert _greedy(shard, overlapped=True) == _greedy(_shard(default_model, 0, 30), overlapped=False)
    control = shard.run(pb.Frame(frame_id=9, kind=pb.Frame.CONTROL, free=[1]))  # no work, only a free
    assert list(control.tokens) == [] and len(control.timings) == 1 and sorted(shard.seqs) == [2]


def test_a_chunk_launched_before_the_last_finished_reads_its_cache_updates(default_model):
    # Not independent, so the thread never does this; it shows that MLX's lazy graph
    # orders cache updates: chunk 2's graph reads the caches chunk 1's graph writes.
    chunks = [[1, 504, 3217, 314], [260, 2736, 28, 954]]

    def run(overlapped: bool):
        shard = _shard(default_model, 0, 12)
        frames = [_prefill(7, chunks[0]), _prefill(7, chunks[1], offset=4)]
        if overlapped:
            launched = [shard.launch(f) for f in frames]
            outs = [x.finish() for x in launched]
        else:
            outs = [shard.run(f) for f in frames]
        return [codec.decode(o.hidden) for o in outs]

    for a, b in zip(run(True), run(False)):
        assert mx.array_equal(a, b).item()


def test_blocks_launched_as_they_are_built_keep_their_weights_and_their_outputs(default_model):
    """``SlicedModel.launch_blocks`` (a stage with ``--launch-ahead``): each block of the
    range hands its output to MLX as soon as it is built; the same weights under the
    same names, the same activations bit for bit."""
    def forward(launching: bool):
        stage, _ = load_stage(default_model, 4, 12)
        before = dict(tree_flatten(stage.model.parameters()))
        if launching:
            stage.launch_blocks()
            stage.launch_blocks()  # twice: still one launching class
        after = dict(tree_flatten(stage.model.parameters()))
        hidden = mx.random.normal((2, 5, 576), key=mx.random.key(3)).astype(mx.bfloat16)
        caches = stage.make_cache()
        first = stage(mx.zeros((2, 5), dtype=mx.int32), hidden, caches, [0, 0])
        more = stage(mx.zeros((2, 1), dtype=mx.int32), first[:, -1:], caches, [5, 5])  # reads the caches
        mx.eval(first, more)
        return stage, before, after, first, more

    plain, launched = forward(False), forward(True)
    stage, before, after = launched[:3]
    assert [type(b).__name__ for b in stage.blocks] == ["LaunchingTransformerBlock"] * 8
    assert type(stage.blocks[0]).__mro__[1] is type(plain[0].blocks[0])
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    for a, b in zip(plain[3:], launched[3:]):
        assert mx.array_equal(a, b).item()
