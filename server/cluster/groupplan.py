"""How many nodes each stage spans: tensor-parallel groups planned from the links.

A stage may be a group of k nodes (``groups.py``) that split every layer of its range and
all-reduce twice inside each (after attention, after the MLP). Whether that pays is a
matter of the link between them: an all-reduce over an RDMA mesh (Thunderbolt 5) costs tens
of microseconds against a layer's sub-millisecond read of its weights, and one stream then
decodes faster than on one node; over Ethernet or Wi-Fi an all-reduce costs about a
millisecond, and cutting between layers (a pipeline) does better.

A group is planned as one node (``group_node``): its members' memory less the embedding and
head each rank holds again, its layers' time over k, plus per layer two all-reduces of a decode step's hidden states (float32:
``tensor_parallel.SumOut``) over the slowest link among its members (``RDMA`` where they are a full Thunderbolt
mesh, ``Links.rdma``: JACCL's), at ``2 (k - 1)`` steps of
latency and ``2 (k - 1) / k`` of the bytes (a ring's reduce-scatter and all-gather). Not
counted: the leader handing each frame to its ranks (one all-reduce a step, against a stage's
two a layer) and the first rank's extra head where heads do not divide. The layouts are the ways to
cut the nodes, in order, into consecutive groups; each is planned with the links between its
stages priced (``linkplan.py``) and scored by its tokens/s at the declared concurrency (one
stream: one over the sum of its stage times); the best is chosen, and pure pipeline and pure
tensor parallel are shown beside it. Only widths the model can be split into
(``tensor_parallel.why_not``) are considered. Pure Python but for that check: no I/O.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from mlxpipe.server.cluster import linkplan
from mlxpipe.server.cluster.cost import ModelCost
from mlxpipe.server.cluster.linkplan import Hop, Links, PricedPlan
from mlxpipe.server.cluster.planner import NodeSpec, PlanInfeasible, Workload
from mlxpipe.server.config import ClusterConfig, PLANNED_CONTEXT

SUM_BYTES = 4      # bytes of a hidden state's element in a group's sums (float32)
MAX_NODES = 10     # more nodes than this: no layouts beyond the pure pipeline (2^(N-1) of them)
# Local ranks on one machine's loopback: the ring backend's all-reduce of a token's hidden
# state, measured at about 70 us here (2 ranks, 2 cores); one way, per step.
LOOPBACK = Hop(35e-6, 2e9)
# A group cabled as a full Thunderbolt 5 mesh all-reduces over JACCL (``tp_backend.py``): 80 Gb/s a
# cable and about 10 us one way (MLX's figures for RDMA over Thunderbolt 5; not measured here: no Macs).
RDMA = Hop(10e-6, 80e9 / 8)


def allreduce_seconds(k: int, nbytes: float, hop: Hop) -> float:
    """One all-reduce of ``nbytes`` among ``k`` ranks over ``hop``: a ring's 2 (k - 1) steps."""
    if k < 2:
        return 0.0
    return 2 * (k - 1) * (hop.latency_s + (nbytes / k / hop.bytes_per_s if hop.bytes_per_s else 0.0))


def group_node(cost: ModelCost, members: Sequence[NodeSpec], hop: Hop, hidden: int,
               rows: Optional[int] = None) -> NodeSpec:
    """The members as one node of the plan (module docstring): their memory less what each rank
    holds again, the layers' time of the slowest member over k, and the all-reduces."""
    k = len(members)
    if k == 1:
        return members[0]
    rows = rows or members[0].decode_rows
    slowest = max(members, key=lambda m: sum(m.times(cost)[0]))
    layers, embed, head = slowest.times(cost)
    sums = 2 * allreduce_seconds(k, rows * hidden * SUM_BYTES, hop)
    per_kind = {}
    for layer, t in zip(cost.layers, layers):
        per_kind.setdefault(layer.kind, []).append(t / k + sums)
    again = (k - 1) * (cost.embed_bytes + cost.head_bytes)
    return NodeSpec(name="+".join(m.name for m in members), memory_bytes=sum(m.memory_bytes for m in members) - again,
                    layer_seconds={kind: statistics.median(v) for kind, v in per_kind.items()},
                    embed_seconds=embed, head_seconds=head,
                    flops_per_s=(slowest.flops_per_s or 0) * k or None,
                    bandwidth_bytes_per_s=(slowest.bandwidth_bytes_per_s or 0) * k or None,
                    decode_rows=rows)


def compositions(n: int) -> List[Tuple[int, ...]]:
    """Every way to cut ``n`` nodes, in order, into consecutive groups: widths, in pipeline order."""
    out = []
    for cuts in itertools.product((False, True), repeat=max(n - 1, 0)):
        widths, run = [], 1
        for cut in cuts:
            if cut:
                widths.append(run)
                run = 1
            else:
                run += 1
        out.append(tuple(widths + [run]))
    return sorted(out, key=lambda w: (-len(w), w))


@dataclass(frozen=True)
class Choice:
    """One layout: its groups' widths, its plan with the links priced, and its score."""

    widths: Tuple[int, ...]
    priced: Optional[PricedPlan]
    why_not: str = ""  # why it cannot run (too little memory, a model that does not split so)

    @property
    def one_stream(self) -> float:
        return self.priced.plan.tokens_per_s_one_stream if self.priced else 0.0

    def tokens_per_s(self, concurrency: int) -> float:
        """Tokens/s with ``concurrency`` streams: as many stages busy as there are streams, at most."""
        if self.priced is None:
            return 0.0
        p = self.priced.plan
        m = min(max(concurrency, 1), len(p.stages))
        return m / max(p.sum_seconds, m * p.max_seconds)

    def describe(self) -> str:
        kind = "pipeline" if set(self.widths) == {1} else "tensor parallel" if len(self.widths) == 1 else "mixed"
        return f"{kind} {'+'.join(map(str, self.widths)) if len(self.widths) == 1 else ','.join(map(str, self.widths))}"


def _group_links(links: Links, groups: Sequence[Sequence[int]]) -> Links:
    """The links between groups (between their leaders) and to the head."""
    pairs = {(i, j): links.between(a[0], b[0]) for (i, a), (j, b) in itertools.combinations(enumerate(groups), 2)}
    return Links(links.row_bytes, tuple(links.head[g[0]] for g in groups), pairs)


def _inner(links: Links, members: Sequence[int]) -> Hop:
    """The slowest link among a group's members; ``RDMA`` where every pair of them is cabled for
    it (the group all-reduces over JACCL then, not over the TCP the head timed)."""
    pairs = list(itertools.combinations(sorted(members), 2))
    if pairs and all(p in links.rdma for p in pairs):
        return RDMA
    hops = [links.between(a, b) for a, b in pairs]
    return Hop(max(h.latency_s for h in hops), min(h.bytes_per_s for h in hops)) if hops else Hop()


def layout(cost: ModelCost, nodes: Sequence[NodeSpec], links: Links, widths: Sequence[int], hidden: int,
           splits: Callable[[int], Optional[str]], **kw) -> Choice:
    """``widths`` planned: consecutive groups of the nodes, the layers split over the groups."""
    for k in sorted(set(widths)):
        why = splits(k) if k > 1 else None
        if why:
            return Choice(tuple(widths), None, f"groups of {k}: {why}")
    at, groups = 0, []
    for k in widths:
        groups.append(list(range(at, at + k)))
        at += k
    specs = [group_node(cost, [nodes[i] for i in g], _inner(links, g), hidden) for g in groups]
    try:
        priced = linkplan.plan(cost, specs, _group_links(links, groups), every_node=True, reorder=False, **kw)
    except PlanInfeasible as err:
        return Choice(tuple(widths), None, str(err))
    return Choice(tuple(widths), priced)


def choose(cost: ModelCost, nodes: Sequence[NodeSpec], links: Links, hidden: int,
           splits: Callable[[int], Optional[str]], *, context: int = PLANNED_CONTEXT,
           concurrency: int = ClusterConfig.concurrency, workload: Workload = Workload(),
           cuts: Optional[Sequence[int]] = None) -> Tuple[Choice, List[Choice]]:
    """The best layout of ``nodes`` (in order) and every layout planned, pure pipeline first."""
    kw = dict(context=context, concurrency=concurrency, workload=workload, cuts=cuts)
    shapes = compositions(len(nodes)) if len(nodes) <= MAX_NODES else [tuple([1] * len(nodes))]
    choices = [layout(cost, nodes, links, w, hidden, splits, **kw) for w in shapes]
    ok = [c for c in choices if c.priced is not None]
    if not ok:
        raise PlanInfeasible("; ".join(f"{c.describe()}: {c.why_not}" for c in choices[:3]))
    best = max(ok, key=lambda c: (round(c.tokens_per_s(concurrency), 6), c.one_stream, -len(c.widths)))
    return best, choices


def lines(best: Choice, choices: Sequence[Choice], concurrency: int) -> List[str]:
    """The layouts in words: the chosen one, pure pipeline and pure tensor parallel, and the rest."""
    shown = [c for c in choices if set(c.widths) == {1} or len(c.widths) == 1 or c is best]
    shown += [c for c in choices if c not in shown]
    out = [f"layouts (a stage a group of that many nodes; predicted with the links priced, {concurrency} "
           f"stream{'s' if concurrency != 1 else ''}):"]
    for c in shown:
        mark = "->" if c is best else "  "
        if c.priced is None:
            out.append(f"{mark} {c.describe():<22} does not run: {c.why_not}")
            continue
        p = c.priced.plan
        split = " / ".join(str(s.num_layers) for s in p.stages)
        out.append(f"{mark} {c.describe():<22} {c.one_stream:7.1f} tokens/s one stream, "
                   f"{c.tokens_per_s(max(concurrency, len(p.stages))):7.1f} in all; layers {split}")
    return out

