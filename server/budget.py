"""Where a frame's time goes: every stage's parts, the wire's and the head's.

Each stage adds a ``StageTiming`` to the frame it passes on (queued, decode,
compute, encode: durations on its own clock), and the last stage returns them
all in the Result. The head stamps a frame when it writes it to stage 0 and
when its Result arrives, and times its own handling of the Result (scheduling
and building what follows). No two clocks need agree: the wire's share (gRPC
and protobuf on both ends, the event loops, the network) is the round trip
less every stage's parts. ``/metrics`` exposes the totals
(``mlxpipe_frame_seconds``); ``mlxpipe bench overhead`` prints them per token.
Pure Python, no I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from mlxpipe.proto import pipeline_pb2 as pb

STAGE_PARTS = ("queued", "decode", "compute", "encode")  # StageTiming's fields, less "_us"
MAX_PENDING = 4096  # frames in flight remembered at most (a broken pipeline's never come back)


@dataclass
class KindTotals:
    """Seconds summed over every timed frame of one kind (decode, prefill, ...)."""

    frames: int = 0
    tokens: int = 0            # positions the frames carried
    round_trip: float = 0.0    # written to stage 0 -> its Result arrived
    head: float = 0.0          # handling the Result on the head
    stages: List[List[float]] = field(default_factory=list)  # [stage][part], parts as STAGE_PARTS

    @property
    def wire(self) -> float:
        """The round trip less every stage's parts: gRPC, serialization, loops, network."""
        return max(self.round_trip - sum(map(sum, self.stages)), 0.0)

    def part(self, name: str) -> float:
        """A stage part summed over the stages."""
        i = STAGE_PARTS.index(name)
        return sum(s[i] for s in self.stages)

    def mean_us(self, per: str = "token") -> Dict[str, float]:
        """Mean microseconds per position (``per="token"``) or per frame: each stage part
        summed over the stages, the wire, the head, the round trip."""
        n = max(self.tokens if per == "token" else self.frames, 1)
        out = {p: 1e6 * self.part(p) / n for p in STAGE_PARTS}
        out.update(wire=1e6 * self.wire / n, head=1e6 * self.head / n, round_trip=1e6 * self.round_trip / n)
        return out

    def stage_us(self, per: str = "token") -> List[List[float]]:
        """Mean microseconds per position (or frame) of each stage's parts, [stage][part]."""
        n = max(self.tokens if per == "token" else self.frames, 1)
        return [[1e6 * v / n for v in parts] for parts in self.stages]


class FrameBudget:
    """Totals per frame kind, fed by the head's pipeline as frames go and Results come."""

    def __init__(self) -> None:
        self.kinds: Dict[str, KindTotals] = {}
        self._pending: Dict[int, Tuple[float, str, int]] = {}  # frame_id -> (written, kind, tokens)

    def sent(self, frame: pb.Frame) -> None:
        """Call as ``frame`` is written to stage 0."""
        if len(self._pending) >= MAX_PENDING:
            self._pending.clear()
        tokens = sum(e.num_tokens for e in frame.seqs)
        self._pending[frame.frame_id] = (time.perf_counter(), pb.Frame.Kind.Name(frame.kind).lower(), tokens)

    def done(self, result: pb.Result, arrived: float, handled: Optional[float] = None) -> None:
        """Call after the head handled ``result`` (which arrived at ``arrived``)."""
        pending = self._pending.pop(result.frame_id, None)
        if pending is None:
            return
        written, kind, tokens = pending
        t = self.kinds.setdefault(kind, KindTotals())
        t.frames += 1
        t.tokens += tokens
        t.round_trip += arrived - written
        t.head += (time.perf_counter() if handled is None else handled) - arrived
        while len(t.stages) < len(result.timings):
            t.stages.append([0.0] * len(STAGE_PARTS))
        for acc, timing in zip(t.stages, result.timings):
            for i, name in enumerate(STAGE_PARTS):
                acc[i] += getattr(timing, f"{name}_us") / 1e6

    def reset(self) -> None:
        """Forget the totals (a benchmark between runs); frames in flight are still timed."""
        self.kinds.clear()
