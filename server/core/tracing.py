"""Where one request's time went in the engine, as spans (pure data, the head's
``perf_counter`` clock): what ``api/traces.py`` exports over OpenTelemetry.

A traced request (``Engine.submit(trace=...)``) gets a ``RequestTrace``. ``Tracing``
(the ``Framer``'s) stamps each step that carries a traced sequence as its frame
goes to stage 0, and when its result comes back lays the frame out from the
``StageTiming`` each stage added (``core/budget.py``'s parts: queued, decode,
compute, encode, on the stage's own clock): the hop into each stage and the hop
back share what the stages do not account for (the wire: gRPC, protobuf, the
loops, the network), so a frame's children tile it exactly. A request's spans are
its wait in the queue, its frames (prefill chunks, decode steps, verify steps with
the drafts they accepted) and the head's own time between them, tiling it too.

Nothing here runs for a request that is not traced: with tracing off, ``Tracing``
holds no trace and the framer's only cost is one test of an empty dict per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from mlxpipe.server.core.budget import STAGE_PARTS
from mlxpipe.server.core.plan import Step, StepKind
from mlxpipe.server.core.sequence import TokenEvent

_NAMES = {StepKind.PREFILL: "prefill chunk", StepKind.DECODE: "decode step", StepKind.VERIFY: "verify step"}


@dataclass
class Span:
    name: str
    start: float  # perf_counter seconds
    end: float
    attrs: Dict[str, object] = field(default_factory=dict)
    children: List["Span"] = field(default_factory=list)


class RequestTrace:
    """One request's (one choice's) time in the engine."""

    def __init__(self) -> None:
        self.submitted = time.perf_counter()
        self.finished: Optional[float] = None
        self.frames: List[Span] = []
        self.attrs: Dict[str, object] = {}

    def span(self, now: Optional[float] = None) -> Span:
        """"generate": the wait in the queue, every frame, and the head's time between them."""
        end = self.finished or now or time.perf_counter()
        frames = sorted(self.frames, key=lambda f: f.start)
        children: List[Span] = []
        cursor = self.submitted
        if frames:
            children.append(Span("queue", self.submitted, frames[0].start))
            cursor = frames[0].start
        for f in frames:
            if f.start > cursor:  # the head between a result and the next frame (sampling, scheduling)
                children.append(Span("head", cursor, f.start))
            children.append(f)
            cursor = max(cursor, f.end)
        if end > cursor:
            children.append(Span("head", cursor, end))
        return Span("generate", self.submitted, max(end, cursor), dict(self.attrs), children)


def frame_span(name: str, sent: float, arrived: float, parts: Sequence[Sequence[float]],
               attrs: Dict[str, object]) -> Span:
    """A frame from ``sent`` to ``arrived`` with each stage's ``parts`` (seconds, as
    ``STAGE_PARTS``), the wire's share spread over the hops: children tile it."""
    total = max(arrived - sent, 0.0)
    busy = sum(map(sum, parts))
    scale = min(1.0, total / busy) if busy else 1.0  # (stage clocks' rounding past the round trip)
    hop = (total - busy * scale) / (len(parts) + 1)
    children, t = [], sent
    for i, stage in enumerate(parts):
        children.append(Span("wire", t, t + hop, {"hop": f"{'head' if i == 0 else f'stage {i - 1}'} -> stage {i}"}))
        t += hop
        pieces = []
        for part, seconds in zip(STAGE_PARTS, stage):
            pieces.append(Span(part, t, t + seconds * scale))
            t += seconds * scale
        children.append(Span(f"stage {i}", pieces[0].start if pieces else t, t, {"stage": i}, pieces))
    children.append(Span("wire", t, max(arrived, t), {"hop": f"stage {len(parts) - 1} -> head"}))
    return Span(name, sent, max(arrived, t), attrs, children)


class Tracing:
    """The framer's record of traced sequences' frames."""

    def __init__(self) -> None:
        self.traces: Dict[int, RequestTrace] = {}  # seq_id -> its trace
        self._pending: Dict[int, Tuple[Step, float, List[int]]] = {}  # step_id -> (step, sent, traced seq ids)

    def sent(self, steps: Sequence[Step]) -> None:
        now = time.perf_counter()
        for step in steps:
            traced = [e.seq_id for e in step.entries if e.seq_id in self.traces and e.num_tokens]
            if traced:
                self._pending[step.step_id] = (step, now, traced)

    def result(self, step_id: int, timings: Sequence[Sequence[float]], events: Sequence[TokenEvent]) -> None:
        pending = self._pending.pop(step_id, None)
        if pending is None:
            return
        step, sent, traced = pending
        now = time.perf_counter()
        base = frame_span(_NAMES.get(step.kind, step.kind.name.lower()), sent, now, timings,
                          {"frame_id": step_id, "rows": len(step.entries)})
        for e in step.entries:
            trace = self.traces.get(e.seq_id)
            if trace is None or e.seq_id not in traced:
                continue
            attrs = dict(base.attrs, positions=e.num_tokens, offset=e.offset)
            if step.kind == StepKind.VERIFY:  # drafts after the confirmed token; the samples taken
                taken = sum(1 for ev in events if ev.seq.seq_id == e.seq_id)
                attrs.update({"speculation.drafted": e.num_tokens - 1, "speculation.accepted": max(taken - 1, 0),
                              "speculation.rejected": e.num_tokens - 1 - max(taken - 1, 0)})
            if e.opening is not None and e.opening.reuse:
                attrs["prefix_cache.blocks_reused"] = len(e.opening.reuse)
            trace.frames.append(Span(base.name, base.start, base.end, attrs, base.children))

    def forget(self, seq_id: int, now: Optional[float] = None) -> None:
        """The sequence ended (or was cancelled): its trace takes no more frames."""
        trace = self.traces.pop(seq_id, None)
        if trace is not None and trace.finished is None:
            trace.finished = now or time.perf_counter()

    def clear(self) -> None:
        for seq_id in list(self.traces):
            self.forget(seq_id)
        self._pending.clear()
