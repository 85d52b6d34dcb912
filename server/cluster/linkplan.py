"""The planner prices links: every hop's latency and throughput in the stage it leads to,
and the order of the nodes chosen so that slow links cost least.

A frame into stage 0 carries token ids and a result back to the head carries token
ids: those hops cost their latency. A hop between stages carries activations,
``row_bytes`` per token: its latency plus the bytes over its throughput. A decode
step of ``rows`` rows pays each hop once; a prompt token pays a chunk's latency
shared among its tokens, and its own bytes. Each hop is charged to the stage it
leads into (the last stage also pays the way back), so the planner's usual rule,
the slowest stage as fast as it can be, weighs links too; and since the hop into a
stage depends on which node ran the stage before it, the dynamic programme here
keeps the previous node in its state (``_solve``: exact, O(N^2 L^2)).

Links are known per pair of nodes (measured, ``links.py``; or on paper, ``--link
40Gbps,50us``), so the order of the nodes is a choice too: orders are ranked by
what a token's path costs, and the best few planned in full. Pure Python, no I/O.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field, replace
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from mlxpipe.server.cluster.cost import ModelCost
from mlxpipe.server.cluster.planner import NodeSpec, Plan, Workload, _Problem
from mlxpipe.server.config import ClusterConfig, PLANNED_CONTEXT

ORDERS_PLANNED = 6   # orders planned in full, besides the one given
MAX_REORDER = 7      # more nodes than this: the order given


@dataclass(frozen=True)
class Hop:
    """One link: one-way latency and throughput (inf: free)."""

    latency_s: float = 0.0
    bytes_per_s: float = math.inf

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + (nbytes / self.bytes_per_s if self.bytes_per_s and nbytes else 0.0)

    def describe(self) -> str:
        rate = "" if math.isinf(self.bytes_per_s) else f", {self.bytes_per_s / 1e6:.1f} MB/s"
        return f"{self.latency_s * 1e3:.2f} ms{rate}"


_RATE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME = {"s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_link(text: str) -> Hop:
    """``40Gbps,50us`` (or ``1GB/s,0.3ms``): a link's throughput and one-way latency."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2:
        raise ValueError(f"--link takes a rate and a latency, e.g. 40Gbps,50us, not {text!r}")
    m = re.fullmatch(r"([\d.]+)\s*([kmgtKMGT]?)(bps|bit/s|b/s|B/s|Bps)", parts[0])
    t = re.fullmatch(r"([\d.]+)\s*(s|ms|us|µs|ns)", parts[1])
    if not m or not t:
        raise ValueError(f"cannot read the link {text!r}: use e.g. 40Gbps,50us or 1GB/s,0.3ms")
    rate = float(m.group(1)) * _RATE[m.group(2).lower()] / (8 if m.group(3) in ("bps", "bit/s", "b/s") else 1)
    return Hop(float(t.group(1)) * _TIME[t.group(2)], rate)


@dataclass(frozen=True)
class Links:
    """The hops of a cluster: between nodes (by index, either way) and to the head."""

    row_bytes: int                                 # one token's activations on the wire
    head: Tuple[Hop, ...]                          # head <-> node i
    pairs: Dict[Tuple[int, int], Hop] = field(default_factory=dict)  # (i, j), i < j
    rdma: FrozenSet[Tuple[int, int]] = frozenset()  # (i, j), i < j: cabled for RDMA both ways (JACCL's links)

    def between(self, i: int, j: int) -> Hop:
        return self.pairs.get((min(i, j), max(i, j)), Hop())

    @classmethod
    def in_a_row(cls, row_bytes: int, hops: Sequence[Hop], count: int) -> "Links":
        """On paper: ``hops[k]`` between nodes k and k + 1 (one hop: all of them); a pair
        further apart takes the slowest hop between them; the head sits on node 0."""
        if len(hops) == 1:
            hops = list(hops) * max(count - 1, 1)
        if len(hops) != max(count - 1, 1) and count > 1:
            raise ValueError(f"--link gives {len(hops)} hops for {count} nodes: give one, or one per hop "
                             f"({count - 1})")
        pairs = {}
        for i, j in itertools.combinations(range(count), 2):
            span = hops[i:j]
            pairs[(i, j)] = Hop(max(h.latency_s for h in span), min(h.bytes_per_s for h in span))
        head = tuple(Hop() if i == 0 else pairs[(0, i)] for i in range(count))
        return cls(row_bytes, head, pairs)


@dataclass(frozen=True)
class PricedPlan:
    """A plan whose stage times include their hops, the nodes' order, and each hop's cost."""

    plan: Plan
    order: Tuple[int, ...]                       # node indices, pipeline order (the plan's node_index is into it)
    hops: Tuple[Tuple[str, Hop, float], ...]     # (which, the link, seconds it adds to a decode step)

    @property
    def node_indices(self) -> List[int]:
        return [self.order[s.node_index] for s in self.plan.stages]

    def lines(self, names: Sequence[str]) -> List[str]:
        p = self.plan
        out = [f"predicted with the links priced: {p.tokens_per_s_one_stream:.1f} tokens/s for one stream, "
               f"{p.tokens_per_s_pipeline:.1f} in all with {len(p.stages)} streams in flight"]
        ttft = p.ttft(2048)
        if ttft is not None:
            out[0] += f"; time to first token of a 2048-token prompt {ttft:.2f} s"
        for which, hop, secs in self.hops:
            out.append(f"  {which}: {hop.describe()}: {secs * 1e3:.2f} ms per decode step")
        return out


class _Priced:
    """Stage times with the hop into each stage, for a given order of nodes."""

    def __init__(self, cost: ModelCost, nodes: Sequence[NodeSpec], order: Sequence[int], links: Links,
                 context: int, concurrency: int, workload: Workload):
        self.order, self.links, self.work = list(order), links, workload
        self.prob = _Problem(cost, [nodes[k] for k in order], context, concurrency, 0.0, workload)

    def hop_in(self, m: int, n: int) -> Tuple[Hop, int]:
        """The hop into pipeline slot ``n`` from slot ``m`` (-1: the head), and its bytes per token."""
        if m < 0:
            return self.links.head[self.order[n]], 0
        return self.links.between(self.order[m], self.order[n]), self.links.row_bytes

    def parts(self, m: int, n: int, s: int, e: int) -> Tuple[float, float, float]:
        """Decode step and per-prompt-token prefill of stage (n, s, e) after slot m, hops included;
        and the hops' share of the decode step."""
        prob = self.prob
        rows, chunk = prob.nodes[n].decode_rows, self.work.chunk_tokens
        hop, per_token = self.hop_in(m, n)
        links = hop.seconds(rows * per_token)
        pre_links = hop.latency_s / chunk + (per_token / hop.bytes_per_s if per_token else 0.0)
        if e == prob.L:  # and the results back to the head
            back = self.links.head[self.order[n]]
            links += back.latency_s
            pre_links += back.latency_s / chunk
        prefill = prob.prefill_time(n, s, e)
        return prob.decode_time(n, s, e) + links, prefill + pre_links if prefill else 0.0, links

    def time(self, m: int, n: int, s: int, e: int) -> float:
        decode, prefill, _ = self.parts(m, n, s, e)
        return decode + self.work.prompt_ratio * self.prob.nodes[n].decode_rows * prefill


def _solve(pr: _Priced, points: Sequence[int], skip: bool) -> Optional[List[Tuple[int, int, int]]]:
    """Stages (slot, start, end) minimizing the slowest stage, then the sum, then the count;
    the hop into a stage depends on the slot before it (-1: the head)."""
    L, N, fits = pr.prob.L, pr.prob.N, pr.prob.fits
    ends = [e for e in points if e > 0]
    best: Dict[Tuple[int, int], float] = {(-1, 0): 0.0}   # (last slot, layers covered) -> slowest stage
    for n in range(N):
        for e in ends:
            for s in (p for p in reversed(points) if p < e):
                if not fits(n, s, e):
                    break
                for m in (range(-1, n) if skip else [n - 1]):
                    if (m, s) in best:
                        v = max(best[(m, s)], pr.time(m, n, s, e))
                        if v < best.get((n, e), math.inf):
                            best[(n, e)] = v
    last = [(n, L) for n in range(N)] if skip else [(N - 1, L)]  # (every node: the last slot ends it)
    limit = min((best[k] for k in last if k in best), default=math.inf)
    if math.isinf(limit):
        return None
    g: Dict[Tuple[int, int], Tuple[float, int]] = {(-1, 0): (0.0, 0)}
    back: Dict[Tuple[int, int], Tuple[int, int]] = {}
    for n in range(N):
        for e in ends:
            for s in (p for p in reversed(points) if p < e):
                if not fits(n, s, e):
                    break
                for m in (range(-1, n) if skip else [n - 1]):
                    t = pr.time(m, n, s, e) if (m, s) in g else math.inf
                    if t <= limit:
                        cand = (g[(m, s)][0] + t, g[(m, s)][1] + 1)
                        if (n, e) not in g or cand < g[(n, e)]:
                            g[(n, e)], back[(n, e)] = cand, (m, s)
    stages, (n, e) = [], min((k for k in last if k in g), key=lambda k: g[k])
    while n >= 0:
        m, s = back[(n, e)]
        stages.append((n, s, e))
        n, e = m, s
    return stages[::-1]


def _priced_plan(pr: _Priced, stages: Sequence[Tuple[int, int, int]], names: Sequence[str]) -> PricedPlan:
    base = pr.prob.plan(stages)
    out, hops, prev = [], [], -1
    for st, (n, s, e) in zip(base.stages, stages):
        decode, prefill, links = pr.parts(prev, n, s, e)
        out.append(replace(st, seconds=decode, prefill_seconds=prefill))
        src = "head" if prev < 0 else names[pr.order[prev]]
        hops.append((f"{src} -> {names[pr.order[n]]}", pr.hop_in(prev, n)[0], links))
        prev = n
    back = pr.links.head[pr.order[prev]]
    hops[-1] = (hops[-1][0] + f" (and back to the head: {back.describe()})", hops[-1][1], hops[-1][2])
    return PricedPlan(replace(base, stages=tuple(out)), tuple(pr.order), tuple(hops))


def _path_cost(order: Sequence[int], links: Links) -> float:
    """What one token's path costs over the nodes in ``order`` (all of them): a quick rank."""
    cost = links.head[order[0]].latency_s + links.head[order[-1]].latency_s
    for a, b in zip(order, order[1:]):
        cost += links.between(a, b).seconds(links.row_bytes * 64)
    return cost


def plan(cost: ModelCost, nodes: Sequence[NodeSpec], links: Links, *, context: int = PLANNED_CONTEXT,
         concurrency: int = ClusterConfig.concurrency, every_node: bool = False, workload: Workload = Workload(),
         cuts: Optional[Sequence[int]] = None, reorder: bool = True) -> PricedPlan:
    """The best split and order of ``nodes`` with every hop priced (``planner.plan``'s rule)."""
    L = cost.num_layers
    points = sorted({0, L, *(range(1, L) if cuts is None else cuts)})
    given = tuple(range(len(nodes)))
    orders = [given]
    if reorder and 1 < len(nodes) <= MAX_REORDER:
        ranked = sorted(itertools.permutations(given), key=lambda o: _path_cost(o, links))
        orders += [o for o in ranked[:ORDERS_PLANNED] if o != given]
    names = [n.name for n in nodes]
    best: Optional[Tuple[tuple, PricedPlan]] = None
    for order in orders:
        pr = _Priced(cost, nodes, order, links, context, concurrency, workload)
        stages = _solve(pr, points, skip=not every_node)
        if stages is None:
            continue
        priced = _priced_plan(pr, stages, names)
        times = [pr.time(-1 if k == 0 else stages[k - 1][0], *st) for k, st in enumerate(stages)]
        key = (max(times), sum(times), len(stages))
        if best is None or key < best[0]:
            best = (key, priced)
    if best is None:
        raise _Problem(cost, nodes, context, concurrency, 0.0, workload).infeasible()
    return best[1]


def evaluate(cost: ModelCost, nodes: Sequence[NodeSpec], links: Links, ranges: Sequence[Tuple[int, int]], *,
             context: int = PLANNED_CONTEXT, concurrency: int = ClusterConfig.concurrency, workload: Workload = Workload()) -> PricedPlan:
    """What a given split (node i runs ``ranges[i]``, in order) costs, links priced."""
    pr = _Priced(cost, nodes, range(len(nodes)), links, context, concurrency, workload)
    return _priced_plan(pr, [(n, s, e) for n, (s, e) in enumerate(ranges)], [n.name for n in nodes])
