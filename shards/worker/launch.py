"""A frame in two halves on the MLX thread: launched (checked, state changed, its graph
handed to MLX with ``mx.async_eval``) and finished (waited for, sampled on the last
stage, encoded). Between the two, the thread may launch the next frame of another
group (``Launched.independent``), so that building one graph overlaps running the
last (mlx-lm's ``generate_step`` does the same with its steps)."""

from __future__ import annotations

import time

import mlx.core as mx

from mlxpipe.proto import codec
from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.shards.worker.clock import stage_timing


def later(arrays, then):
    """Launch ``arrays`` (``mx.async_eval``); what the frame's finish calls: waits for them,
    then ``then()`` (the last stage's sampling)."""
    mx.async_eval(arrays)

    def finish():
        mx.eval(arrays)
        return then()
    return finish


class Launched:
    """A frame launched on the MLX thread (``Shard.launch``) and not yet finished: its
    graph runs while the thread goes on (MLX's stream thread, or the GPU)."""

    def __init__(self, shard, frame: pb.Frame, out, tokens: int, times):
        self.shard, self.frame, self.out, self.tokens, self.times = shard, frame, out, tokens, times
        self.stolen = 0.0  # seconds the MLX thread spent launching later frames meanwhile: queueing, not compute
        self.seq_ids = {e.seq_id for e in frame.seqs}

    def independent(self, frame: pb.Frame) -> bool:
        """Whether ``frame`` may be launched before this one finishes: it names none of this
        one's sequences (so no sampler, length or free of theirs changes in between)."""
        return self.seq_ids.isdisjoint(e.seq_id for e in frame.seqs) and self.seq_ids.isdisjoint(frame.free)

    def finish(self):
        """Wait for the frame's graph; the Frame for the next stage, or the Result (last stage)."""
        shard = self.shard
        try:
            if shard.model.last:
                out = self.out() if self.out is not None else []  # sampling, once its logits are there
            else:
                out = self.out
                if out is not None:
                    mx.eval(out)
        finally:
            self.drop()
        return output(shard.model.last, self.frame, out, self.times, time.perf_counter(), self.stolen)

    def drop(self) -> None:
        """The frame's work is over (finished, or its output unwanted): the busy clock stops."""
        self.shard.stats.end(self.tokens)
        self.shard.publish()


def output(last: bool, frame: pb.Frame, out, times, computed: float, stolen: float):
    """The Frame for the next stage (``out``: its activations, evaluated), or the ``last``
    stage's Result (``out``: its token results), with this stage's timing."""
    if last:  # ``out``: token results, and the prompt scores of sequences that asked
        return pb.Result(frame_id=frame.frame_id, tokens=[r for r in out if isinstance(r, pb.TokenResult)],
                         prompt=[r for r in out if isinstance(r, pb.PromptScores)],
                         timings=[*frame.timings, stage_timing(*times, stolen=stolen)])
    nxt = pb.Frame(frame_id=frame.frame_id, kind=frame.kind, group=frame.group, seqs=frame.seqs,
                   tokens=frame.tokens, free=frame.free, evict=frame.evict, discard=frame.discard,
                   timings=frame.timings, positions=frame.positions)
    if out is not None:
        codec.encode(out, into=nxt.hidden)
    nxt.timings.append(stage_timing(*times, computed, stolen=stolen))
    return nxt
