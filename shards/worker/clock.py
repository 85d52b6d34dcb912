"""What Health reports of a stage's work: busy time against wall time, and a published view of the shard;
and what a frame carries of it (``stage_timing``)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar, Deque, Optional, Tuple

from mlxpipe.proto import pipeline_pb2 as pb


@dataclass(frozen=True)
class ClockView:
    """A BusyClock as it was at one moment: what Health reads from the event loop."""

    busy_seconds: float
    frames: int
    tokens: int
    reused_tokens: int
    prefilled_tokens: int
    started: float
    running_since: Optional[float]
    recent: Tuple[Tuple[float, float, int], ...]
    WINDOW: ClassVar[float] = 10.0  # seconds the recent figures cover

    def busy_now(self) -> float:
        """Busy seconds so far, the frame in progress included."""
        since = self.running_since
        return self.busy_seconds + (time.monotonic() - since if since is not None else 0.0)

    def window(self) -> Tuple[float, float]:
        """(busy fraction, token positions per second) over the last WINDOW seconds."""
        now = time.monotonic()
        lo = max(now - self.WINDOW, self.started)
        span = max(now - lo, 1e-9)
        busy = tokens = 0.0
        for end, seconds, n in self.recent:
            if end > lo:
                busy += min(seconds, end - lo)
                tokens += n
        if self.running_since is not None:
            busy += now - max(self.running_since, lo)
        return min(busy / span, 1.0), tokens / span


@dataclass
class BusyClock:
    """Busy time (computing a frame) against wall time: the rest is the bubble.
    Changed only on the MLX thread; others read ``view()``s of it."""

    busy_seconds: float = 0.0         # finished frames
    frames: int = 0
    tokens: int = 0
    reused_tokens: int = 0            # prompt positions taken from cached prefix blocks
    prefilled_tokens: int = 0         # prompt positions computed
    started: float = field(default_factory=time.monotonic)
    running_since: Optional[float] = None  # since when frames have run (uncounted busy time)
    recent: Deque[Tuple[float, float, int]] = field(default_factory=deque)  # (end, seconds, tokens)
    running: int = 0  # frames begun and not ended (two while one is launched before the last finishes)

    def begin(self) -> None:
        if not self.running:
            self.running_since = time.monotonic()
        self.running += 1

    def end(self, tokens: int) -> None:
        """A frame is over: the busy time since the last end (or begin) is counted once,
        however many frames overlapped in it."""
        now = time.monotonic()
        seconds = now - self.running_since
        self.running -= 1
        self.running_since = now if self.running else None
        self.busy_seconds += seconds
        self.frames += 1
        self.tokens += tokens
        self.recent.append((now, seconds, tokens))
        while self.recent and self.recent[0][0] < now - ClockView.WINDOW:
            self.recent.popleft()

    def view(self) -> ClockView:
        return ClockView(self.busy_seconds, self.frames, self.tokens, self.reused_tokens, self.prefilled_tokens,
                         self.started, self.running_since, tuple(self.recent))


@dataclass(frozen=True)
class ShardView:
    """What Health reports of a shard, published by the MLX thread after each change:
    the event loop never iterates state that thread mutates."""

    live_seqs: Tuple[int, ...] = ()
    cache_bytes: int = 0
    prefix_bytes: int = 0
    prefix_blocks: int = 0
    clock: ClockView = field(default_factory=lambda: BusyClock().view())


def stage_timing(arrived: Optional[float], started: float, decoded: float,
                 computed: Optional[float] = None, stolen: float = 0.0) -> pb.StageTiming:
    """This stage's part of a frame's time (``time.perf_counter`` readings). ``stolen``:
    seconds of its compute span the MLX thread spent launching later frames; it waited
    behind them, so they count as queueing."""
    now = time.perf_counter()
    computed = now if computed is None else computed
    us = lambda seconds: max(int(seconds * 1e6), 0)  # noqa: E731
    return pb.StageTiming(queued_us=us(started - arrived + stolen) if arrived is not None else 0,
                          decode_us=us(decoded - started), compute_us=us(computed - decoded - stolen),
                          encode_us=us(now - computed))
