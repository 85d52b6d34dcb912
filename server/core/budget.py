"""Where a frame's time goes: the totals the head keeps, per frame kind (pure data).

Each stage adds a ``StageTiming`` to the frame it passes on (queued, decode,
compute, encode: durations on its own clock), and the last stage returns them
all in the Result. The head stamps a frame when it writes it to stage 0 and
when its Result arrives, and times its own handling of the Result
(``cluster/budget.py`` ``FrameBudget`` reads the wire's records into these
totals). No two clocks need agree: the wire's share (gRPC and protobuf on both
ends, the event loops, the network) is the round trip less every stage's parts.
``/metrics`` exposes the totals (``mlxpipe_frame_seconds``); ``mlxpipe bench
overhead`` prints them per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

STAGE_PARTS = ("queued", "decode", "compute", "encode")  # StageTiming's fields, less "_us"
EMA = 0.25  # weight of the newest frame in ``KindTotals.frame_s``


def _ema(old: Optional[float], new: float) -> float:
    return new if old is None else old + EMA * (new - old)


@dataclass
class KindTotals:
    """Seconds summed over every timed frame of one kind (decode, prefill, ...)."""

    frames: int = 0
    tokens: int = 0            # positions the frames carried
    round_trip: float = 0.0    # written to stage 0 -> its Result arrived
    head: float = 0.0          # handling the Result on the head
    stages: List[List[float]] = field(default_factory=list)  # [stage][part], parts as STAGE_PARTS
    frame_s: Optional[float] = None  # recent round trip of one frame (written -> Result), EMA

    def observe(self, round_trip: float) -> None:
        """Fold one frame's round trip into ``frame_s``."""
        self.frame_s = _ema(self.frame_s, round_trip)

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
