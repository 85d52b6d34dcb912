"""Every link of a pipeline, measured and kept current; the slow ones named.

When the head builds a pipeline it times its hop to every stage (``shards/net/links.py``:
round trips of a decode-sized and a prefill-sized message), and has every stage
time its hop to the next one (``TimeNextHop``), one link after the other. Then the figures
follow the live cluster: the head re-times its latency to each stage every few seconds,
as each stage does its latency to the next (``shards/links.Keeper``), and the
throughput of a hop between stages comes from the frames that cross it
(``HealthReply.in_link``). ``mlxpipe status``, ``/metrics`` and the page
show them; the head warns, naming the link, when one is far slower than the
fastest or looks like Wi-Fi.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.shards.net import links as probe

logger = logging.getLogger(__name__)

SLOW_FACTOR = 4.0         # a link this many times slower than the fastest is named
SLOW_EXTRA_S = 1e-3       # (and, for latency, at least this much slower)
WIFI_BYTES_PER_S = 60e6   # below this (about 500 Mbit/s), or ...
WIFI_JITTER = 0.5         # ... latency past 1 ms that wanders by half of itself: it looks like Wi-Fi
LIVE_SAMPLES = 3          # live throughput wins over the measured one from this many frames on


@dataclass
class Link:
    """One hop, as the head knows it now."""

    name: str
    source: str             # "head", or a stage's address
    target: str
    latency_s: float        # one way
    bytes_per_s: float      # 0: not known
    jitter_s: float
    basis: str              # where the figures come from

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        bw = f"{self.bytes_per_s / 1e6:.1f} MB/s" if self.bytes_per_s else "throughput unknown"
        return f"{self.name}: {self.latency_s * 1e3:.2f} ms, {bw}"


class LinkTable:
    """The links of one pipeline (stages at ``addresses``, in order)."""

    def __init__(self, addresses: Sequence[str]):
        self.addresses = list(addresses)
        self.head: Dict[int, probe.Keeper] = {}     # stage -> the head's hop to it, timed at build, kept current
        self.hops: Dict[int, pb.LinkFigures] = {}   # stage i -> its hop to i + 1, timed as it loaded
        self.live: Dict[int, pb.HealthReply] = {}    # stage -> its last Health reply
        self.warned: set = set()

    async def measure(self, stubs, metadata, small: int, large: int) -> None:
        """Time the head's hop to every stage, and every stage's to the next, one after the
        other (so that no two probes share a link)."""
        for i, stub in enumerate(stubs):
            try:
                first = await probe.measure(stub, metadata, small, large, self.addresses[i])
                self.head[i] = probe.Keeper(stub, metadata, first)
                if i + 1 < len(stubs):
                    self.hops[i] = await stub.TimeNextHop(pb.LinkProbe(small=small, large=large), timeout=60,
                                                          metadata=metadata)
            except Exception as err:  # noqa: BLE001 - a stage that cannot be timed is still a stage
                logger.warning("could not time the links of stage %d at %s: %s", i, self.addresses[i], err)

    def close(self) -> None:
        for keeper in self.head.values():
            keeper.stop()

    def saw_health(self, i: int, reply: Optional[pb.HealthReply]) -> None:
        """Stage ``i``'s last health reply (with its links' live figures)."""
        if reply is not None:
            self.live[i] = reply
        if i == len(self.addresses) - 1:  # a round of health checks: say what is newly slow
            self.warn_new()

    def links(self) -> List[Link]:
        out = []
        for i, address in enumerate(self.addresses):
            keeper = self.head.get(i)
            f = keeper.link if keeper is not None else pb.LinkFigures()
            out.append(Link(f"head -> stage {i}", "head", address, f.latency_s, f.bytes_per_s, f.jitter_s,
                            "timed at build, latency re-timed" if keeper is not None else "not timed"))
        for i in range(len(self.addresses) - 1):
            f = self.hops.get(i, pb.LinkFigures())
            mine, theirs = self.live.get(i), self.live.get(i + 1)
            latency, basis = f.latency_s, [f"timed by stage {i} at build"]
            if mine is not None and mine.next_link.samples:
                latency, basis = mine.next_link.latency_s, [f"re-timed by stage {i}"]
            bw = f.bytes_per_s
            if theirs is not None and theirs.in_link.samples >= LIVE_SAMPLES:
                bw = theirs.in_link.bytes_per_s
                basis.append("live frames (throughput)")
            out.append(Link(f"stage {i} -> stage {i + 1}", self.addresses[i], self.addresses[i + 1], latency, bw,
                            f.jitter_s, ", ".join(basis)))
        return out

    def warnings(self) -> List[str]:
        """One line per link that is far slower than the fastest, or looks like Wi-Fi."""
        return warnings(self.links())

    def warn_new(self) -> List[str]:
        """Log the warnings not logged yet (once each); return them all."""
        lines = self.warnings()
        for line in lines:
            key = line.split(":", 1)[0]
            if key not in self.warned:
                self.warned.add(key)
                logger.warning("%s", line)
        return lines


def warnings(links: Sequence[Link]) -> List[str]:
    """The links far slower than the fastest (latency or throughput) or Wi-Fi-like, in words."""
    rates = [l.bytes_per_s for l in links if l.bytes_per_s > 0]
    lats = [l.latency_s for l in links if l.latency_s > 0]
    best_rate, best_lat = max(rates, default=0.0), min(lats, default=0.0)
    out = []
    for l in links:
        why = []
        if l.bytes_per_s and best_rate and l.bytes_per_s * SLOW_FACTOR < best_rate:
            why.append(f"{l.bytes_per_s / 1e6:.1f} MB/s against {best_rate / 1e6:.1f} MB/s on the fastest")
        if best_lat and l.latency_s > SLOW_FACTOR * best_lat and l.latency_s - best_lat > SLOW_EXTRA_S:
            why.append(f"{l.latency_s * 1e3:.1f} ms one way against {best_lat * 1e3:.2f} ms on the fastest")
        wifi = (0 < l.bytes_per_s < WIFI_BYTES_PER_S) or (l.latency_s > 1e-3 and l.jitter_s > WIFI_JITTER * l.latency_s)
        if why or wifi:
            what = "is far slower than the others" if why else "is slow"
            line = f"link {l.name} ({l.source} -> {l.target}) {what}: " + "; ".join(
                why or [f"{l.latency_s * 1e3:.1f} ms one way, {l.bytes_per_s / 1e6:.1f} MB/s"])
            if wifi:
                line += "; it looks like Wi-Fi (a cable, Thunderbolt or Ethernet, makes every token faster)"
            out.append(line)
    return out
