"""The scheduler's steps as frames, and the last stage's results as its samples.

The one module of the head outside ``cluster/`` that touches the wire
(``pipeline_pb2``): the scheduler decides in its own terms (``plan.py``) and
this module alone builds ``pb.Frame``s from its steps (as nano-vllm's
``model_runner.prepare_*`` alone builds tensors) and reads ``pb.Result``s back.
A sequence's ``Sampling`` becomes its wire form here, in its first frame.
"""

from __future__ import annotations

from typing import List

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.core.plan import Entry, PromptScores, Sample, Step, StepKind, StepResult
from mlxpipe.server.core.scheduler import Scheduler
from mlxpipe.server.core.sequence import TokenEvent
from mlxpipe.server.core.tracing import Tracing
from mlxpipe.server.core.workload import WorkloadMeter
from mlxpipe.shards.params import wire

_KINDS = {StepKind.PREFILL: pb.Frame.PREFILL, StepKind.DECODE: pb.Frame.DECODE,
          StepKind.VERIFY: pb.Frame.VERIFY, StepKind.CONTROL: pb.Frame.CONTROL}


def seq_entry(e: Entry) -> pb.SeqEntry:
    out = pb.SeqEntry(seq_id=e.seq_id, offset=e.offset, num_tokens=e.num_tokens, sample=e.sample, trim=e.trim)
    if e.store or e.spill:
        out.store_first = e.store_first
        out.store.extend(e.store)
        out.spill.extend(e.spill)
        out.snap = e.snap
    if e.opening is not None:
        out.sampling.CopyFrom(wire.sampling_to_wire(e.opening.sampling))
        out.reuse.extend(e.opening.reuse)
        out.context.extend(e.opening.context)
        out.generated.extend(e.opening.generated)
        out.kv_quantize_at = e.opening.kv_at
        out.pool = e.opening.pool
        if e.opening.store:  # reused blocks read back from disk, kept in memory again
            out.store_first = e.opening.store_first
            out.store.extend(e.opening.store)
    return out


def frame(step: Step) -> pb.Frame:
    """A step as the frame stage 0 gets."""
    return pb.Frame(frame_id=step.step_id, kind=_KINDS[step.kind], group=step.group,
                    seqs=[seq_entry(e) for e in step.entries], tokens=step.tokens,
                    free=step.free, evict=step.evict, discard=step.discard)


def with_media(out: pb.Frame, step: Step, seqs) -> pb.Frame:
    """``out`` with what its sequences' images add (``media.py``): every entry's position
    shift, and a prefill chunk's image rows and positions. The rows travel as the tower's
    bytes: the head's core holds no arrays (``server/cluster/vision.py`` made them with
    ``proto/codec.py``)."""
    for e in out.seqs:
        seq = seqs.get(e.seq_id)
        media = seq.media if seq is not None else None
        if media is None:
            continue
        e.position_shift = media.shift
        if step.kind != StepKind.PREFILL:
            continue
        at, data, dtype, hidden = media.rows(e.offset, e.offset + e.num_tokens)
        if at:
            out.embed_at.extend(at)
            out.embeds.CopyFrom(pb.Tensor(shape=[len(at), hidden], dtype=dtype, data=data))
        positions = media.positions_of(e.offset, e.offset + e.num_tokens)
        if positions is not None:
            out.positions.extend(positions)
    return out


def step_result(result: pb.Result) -> StepResult:
    """The last stage's result as the scheduler takes it."""
    return StepResult(result.frame_id, [
        Sample(t.seq_id, t.token, t.logprob, (list(t.top_ids), list(t.top_logprobs)) if t.top_ids else None,
               t.done, t.error, list(t.embedding) or None) for t in result.tokens],
        [(t.decode_us + t.compute_us + t.encode_us) / 1e6 for t in result.timings])


def prompt_scores(result: pb.Result) -> List[PromptScores]:
    """The prompt positions a result scored, per sequence."""
    out = []
    for p in result.prompt:
        k = len(p.top_ids) // len(p.logprobs) if p.logprobs else 0
        top = [(list(p.top_ids[i * k:(i + 1) * k]), list(p.top_logprobs[i * k:(i + 1) * k]))
               for i in range(len(p.logprobs))] if k else []
        out.append(PromptScores(p.seq_id, p.start, list(p.logprobs), top))
    return out


class Framer:
    """A scheduler spoken through the wire: what the engine sends and takes."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.meter = WorkloadMeter()  # the workload the steps make (workload.py)
        self.tracing = Tracing()  # traced requests' frames (tracing.py): nothing while none is traced

    def schedule(self) -> List[pb.Frame]:
        """The frames to send now, in order."""
        steps = self.scheduler.schedule()
        for s in steps:
            self.meter.step(s)
        if self.tracing.traces:
            self.tracing.sent(steps)
        return [with_media(frame(s), s, self.scheduler.seqs) for s in steps]

    def on_result(self, result: pb.Result) -> List[TokenEvent]:
        """Take one Result; return the tokens it gave live sequences."""
        events = self.scheduler.on_result(step_result(result))
        if self.tracing.traces:
            self.tracing.result(result.frame_id, [(t.queued_us / 1e6, t.decode_us / 1e6, t.compute_us / 1e6,
                                                   t.encode_us / 1e6) for t in result.timings], events)
        return events
