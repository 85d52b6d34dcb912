"""What a hop between two processes costs: timed with ``Echo``, and watched on live frames.

``measure`` times a hop from the caller to a node: the round trip of a
decode-sized message (half of it is the hop's one-way latency) and of a
prefill-sized one (the difference, over the bytes, is its throughput). The head
times its hop to every stage this way, and has every stage time its hop to the
next one (``TimeNextHop``); each then re-times the latency every ``REFRESH_S``
(``Keeper``).

``LiveLink`` follows a hop's throughput from the frames that cross it: the
sender stamps each frame with its wall clock (``Frame.sent_us``); the receiver
keeps ``arrival - sent`` per frame. The two clocks differ by an unknown but
steady offset, which cancels between a small frame and a large one: the extra
time a large frame took, over its extra bytes, is the hop's throughput.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time
from typing import Deque, Optional, Tuple

from mlxpipe.proto import pipeline_pb2 as pb

logger = logging.getLogger(__name__)

SMALL_REPEATS = 7   # round trips of the decode-sized message
LARGE_REPEATS = 3   # of the prefill-sized one
MIN_LARGE = 512 << 10   # the prefill-sized probe is at least this big (throughput needs bytes to show)
MAX_PROBE = 16 << 20    # and at most this
REFRESH_S = 5.0         # a stage re-times its next hop's latency this often
WINDOW_S = 60.0         # live figures come from the frames of the last minute
LARGE_FRAME = 32 << 10  # a frame at least this big shows throughput; smaller ones show the base delay


def probe_sizes(hidden_size: int, dtype_bytes: int, chunk_tokens: int) -> Tuple[int, int]:
    """Bytes of a decode-sized frame (one token's activations) and of a prefill-sized one."""
    small = hidden_size * dtype_bytes
    return small, min(max(small * chunk_tokens, MIN_LARGE), MAX_PROBE)


def figures(small_rtts, large_rtts, small: int, large: int, to: str) -> pb.LinkFigures:
    """LinkFigures from round trips of ``small`` and ``large`` byte messages."""
    rtts = sorted(small_rtts)
    extra = min(large_rtts) - rtts[0] if large_rtts else 0.0
    bytes_per_s = (large - small) / extra if large_rtts and extra > 0 else 0.0
    p10, p90 = rtts[len(rtts) // 10], rtts[min(len(rtts) - 1, (len(rtts) * 9) // 10)]
    return pb.LinkFigures(latency_s=statistics.median(rtts) / 2, bytes_per_s=bytes_per_s, jitter_s=(p90 - p10) / 2,
                          samples=len(small_rtts) + len(large_rtts), measured_at=time.time(), to=to)


async def _round_trips(stub, metadata, size: int, repeats: int, timeout: float):
    payload, out = bytes(size), []
    for i in range(repeats + 1):  # the first warms the connection (and its congestion window)
        t0 = time.perf_counter()
        await stub.Echo(pb.EchoRequest(payload=payload), timeout=timeout, metadata=metadata)
        if i:
            out.append(time.perf_counter() - t0)
    return out


async def measure(stub, metadata, small: int, large: int, to: str, timeout: float = 10.0,
                  large_repeats: int = LARGE_REPEATS) -> pb.LinkFigures:
    """Time the hop to the node behind ``stub`` (a Stage stub; ``metadata``: the secret)."""
    small_rtts = await _round_trips(stub, metadata, small, SMALL_REPEATS, timeout)
    large_rtts = await _round_trips(stub, metadata, large, large_repeats, timeout) if large_repeats else []
    return figures(small_rtts, large_rtts, small, large, to)


class LiveLink:
    """A hop's throughput, as the frames that crossed it in the last ``WINDOW_S`` show it."""

    def __init__(self):
        self.frames: Deque[Tuple[float, int, float]] = collections.deque()  # (arrived, bytes, arrival - sent)

    def arrived(self, nbytes: int, sent_us: int, now: Optional[float] = None) -> None:
        if not sent_us:
            return
        now = time.time() if now is None else now
        self.frames.append((now, nbytes, now - sent_us / 1e6))
        while self.frames and self.frames[0][0] < now - WINDOW_S:
            self.frames.popleft()
        if len(self.frames) > 4096:
            self.frames.popleft()

    def figures(self) -> pb.LinkFigures:
        """Throughput (0 until small and large frames both crossed) and the samples behind it.

        Each large frame took its base delay (the least any small frame took, offset
        included) plus its bytes over the throughput; frames queued behind others took
        longer, so the best of them tells the hop's capacity."""
        base = [d for _, n, d in self.frames if n < LARGE_FRAME]
        if not base:
            return pb.LinkFigures()
        floor = min(base)
        rates = [n / (d - floor) for _, n, d in self.frames if n >= LARGE_FRAME and d - floor > 1e-4]
        if not rates:
            return pb.LinkFigures()
        return pb.LinkFigures(bytes_per_s=max(rates), samples=len(rates), measured_at=time.time())


class Keeper:
    """Keeps a stage's next-hop figures current: the latency re-timed every ``REFRESH_S``."""

    def __init__(self, stub, metadata, first: pb.LinkFigures):
        self.stub, self.metadata = stub, metadata
        self.link = pb.LinkFigures()
        self.link.CopyFrom(first)
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        recent: Deque[float] = collections.deque(maxlen=12)  # one-way latencies, a minute's worth
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                rtts = await _round_trips(self.stub, self.metadata, 64, 2, timeout=5.0)
            except Exception as err:  # noqa: BLE001 - a hop that fails: the stream's own watcher says so
                logger.info("re-timing the next hop failed: %s", err)
                continue
            recent.append(min(rtts) / 2)
            self.link.latency_s = statistics.median(recent)
            self.link.measured_at = time.time()
            self.link.samples += len(rtts)

    def stop(self) -> None:
        self.task.cancel()
