"""Partition planner: which node runs which layers, so that the slowest stage is as fast as it can be.

A pipeline decodes at the pace of its slowest stage. Cutting by layer count
leaves the last stage slow (it also runs the final norm, the output head and
the sampler) and ignores that nodes differ in memory and speed. The planner
takes a cost per layer (``cost.py``) and a profile per node, and chooses
contiguous half-open ranges ``[start, end)`` over the nodes in the order
given, each within its node's memory (weights + the KV cache of a declared
context and concurrency, kept ``KV_MARGIN`` times over), minimizing the
slowest stage's time per decode step; ties go to the smaller sum of stage
times, then to fewer stages. A node may be left out. For a workload that also
prefills (``Workload``) on nodes of known compute, a stage's time is a decode
step plus that many prompt tokens of prefill (where the last stage runs no head).
``bits.py`` picks each layer's bits over it (``--bits auto``); ``context.py`` the
context to plan for, and the longest each KV precision fits.

Pure Python, no I/O: ``server/cli/plan.py`` is ``mlxpipe plan``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from mlxpipe.server.cluster.sizing import KV_MARGIN

from mlxpipe.server.cluster.cost import ModelCost
from mlxpipe.server.config import ClusterConfig, PLANNED_CONTEXT, PROMPT_RATIO
from mlxpipe.shards.params.sizes import gb


@dataclass(frozen=True)
class Workload:
    """The work a split is balanced for (chat and agents resend long contexts every turn)."""

    prompt_ratio: float = PROMPT_RATIO  # prompt tokens per generated token (0: balance decode alone)
    chunk_tokens: int = ClusterConfig.chunk_size        # prefill tokens per frame (the head's chunk size)

    def __post_init__(self) -> None:
        if self.prompt_ratio < 0 or self.chunk_tokens < 1:
            raise ValueError("the prompt ratio must not be negative, and a chunk holds at least one token")


class PlanInfeasible(ValueError):
    """No assignment of layers to nodes fits; the message says why and by how much."""


@dataclass(frozen=True)
class NodeSpec:
    """One node: its memory budget (weights + KV cache) and its speed, on paper or measured.

    On paper: ``bandwidth_bytes_per_s``, and a stage's time is the bytes it
    reads per decoded token over that bandwidth. Measured: ``layer_seconds``
    maps a layer kind ("dense", "moe") to seconds per decoded token for one
    layer, ``head_seconds`` the final norm + output head + sampling and
    ``embed_seconds`` the embedding; measured figures win where both are given.
    ``profiled``: the cost of the model as it was measured (say, at 4 bits); a
    cost of other bits then scales each measured time by the bytes it reads.
    ``flops_per_s``: compute, for prefill on paper (None: prefill is not costed);
    ``prefill_layer_seconds`` (by kind) and ``prefill_embed_seconds``: measured
    seconds per prompt token in a chunk, which win over ``flops_per_s``.
    ``decode_rows``: the tokens one decode step generates (the rows it was
    measured at), so that a step carries that many tokens' share of prefill.
    """

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: Optional[float] = None
    layer_seconds: Optional[Dict[str, float]] = None
    embed_seconds: float = 0.0
    head_seconds: Optional[float] = None
    profiled: Optional[ModelCost] = None
    flops_per_s: Optional[float] = None
    prefill_layer_seconds: Optional[Dict[str, float]] = None
    prefill_embed_seconds: float = 0.0
    decode_rows: int = 1

    def prefill_times(self, cost: ModelCost, chunk: int) -> Tuple[List[float], float]:
        """Seconds per prompt token of each layer and the embedding at ``chunk`` tokens a frame: as
        measured, or 2 flops per active parameter and the layer's weights read once a chunk (the head
        runs for a prompt's last token only: a decode step). Zeros without either."""
        if self.prefill_layer_seconds is not None:
            return self._per_layer(cost, self.prefill_layer_seconds, "prefill_layer_seconds"), \
                self.prefill_embed_seconds
        if not self.flops_per_s:
            return [0.0] * cost.num_layers, 0.0
        bw = self.bandwidth_bytes_per_s or math.inf
        layers = [2 * l.active_params / self.flops_per_s + l.weight_bytes / (bw * chunk) for l in cost.layers]
        return layers, cost.embed_read_bytes / bw

    def _per_layer(self, cost: ModelCost, by_kind: Dict[str, float], what: str) -> List[float]:
        """Each layer's measured seconds, looked up by its kind."""
        missing = {l.kind for l in cost.layers} - set(by_kind)
        if missing:
            raise ValueError(f"node {self.name}: {what} lacks {sorted(missing)}")
        return [float(by_kind[l.kind]) for l in cost.layers]

    def times(self, cost: ModelCost) -> Tuple[List[float], float, float]:
        """Seconds per decoded token: of each layer, of the embedding, of the head."""
        bw = self.bandwidth_bytes_per_s
        if bw is not None and not bw > 0:
            raise ValueError(f"node {self.name}: bandwidth must be positive")
        if self.layer_seconds is not None:
            layers = self._per_layer(cost, self.layer_seconds, "layer_seconds")
            if self.profiled is not None:  # decode reads weights: time scales with the bytes read
                layers = [t * l.read_bytes / max(p.read_bytes, 1)
                          for t, l, p in zip(layers, cost.layers, self.profiled.layers)]
        elif bw:
            layers = [l.read_bytes / bw for l in cost.layers]
        else:
            raise ValueError(f"node {self.name}: give bandwidth_bytes_per_s or layer_seconds")
        embed = self.embed_seconds + (cost.embed_read_bytes / bw if bw and self.layer_seconds is None else 0.0)
        if self.head_seconds is not None:
            head = self.head_seconds
            if self.profiled is not None:
                head *= cost.head_read_bytes / max(self.profiled.head_read_bytes, 1)
        elif bw:
            head = cost.head_read_bytes / bw
        else:
            raise ValueError(f"node {self.name}: measured layer_seconds need head_seconds too")
        if min(layers, default=0.0) < 0 or embed < 0 or head < 0:
            raise ValueError(f"node {self.name}: times must not be negative")
        return layers, embed, head


# -- the plan ----------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedStage:
    """One node's share of the pipeline."""

    node_index: int
    node: str
    start: int
    end: int                  # half-open: layers [start, end)
    weight_bytes: int
    kv_bytes: int
    seconds: float            # predicted seconds per decode step, hop included
    prefill_seconds: float = 0.0  # per prompt token (a chunk's hop shared among its tokens); 0: not costed

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Plan:
    """Stages in pipeline order, with the decode speed they predict."""

    stages: Tuple[PlannedStage, ...]
    num_layers: int
    unused: Tuple[str, ...]   # nodes given no layers
    chunk_tokens: int = ClusterConfig.chunk_size  # prefill tokens per frame

    @property
    def ranges(self) -> List[Tuple[int, int]]:
        return [(s.start, s.end) for s in self.stages]

    @property
    def max_seconds(self) -> float:
        return max(s.seconds for s in self.stages)

    @property
    def sum_seconds(self) -> float:
        return sum(s.seconds for s in self.stages)

    @property
    def tokens_per_s_one_stream(self) -> float:
        """One sequence: each token passes every stage (and hop) in turn."""
        return 1.0 / self.sum_seconds

    @property
    def tokens_per_s_pipeline(self) -> float:
        """One stream per stage-group in flight, every stage busy: the slowest stage sets the pace."""
        n = len(self.stages)
        return n / max(self.sum_seconds, n * self.max_seconds)

    def ttft(self, prompt_tokens: int) -> Optional[float]:
        """Seconds to one prompt's first token, alone: chunks of all but its last token follow each
        other through the stages (the first crosses every stage, each later one adds the slowest
        stage's chunk), then the last token goes as a decode step. None if prefill is not costed."""
        if not any(s.prefill_seconds for s in self.stages):
            return None
        chunks = -(-max(prompt_tokens - 1, 0) // self.chunk_tokens)
        chunk = [self.chunk_tokens * s.prefill_seconds for s in self.stages]
        return (sum(chunk) + (chunks - 1) * max(chunk) if chunks else 0.0) + self.sum_seconds

    def to_dict(self) -> dict:
        return {
            "stages": [dict(asdict(s), num_layers=s.num_layers) for s in self.stages],
            "unused_nodes": list(self.unused),
            "num_layers": self.num_layers,
            "max_stage_seconds": self.max_seconds,
            "sum_stage_seconds": self.sum_seconds,
            "tokens_per_s_one_stream": self.tokens_per_s_one_stream,
            "tokens_per_s_pipeline": self.tokens_per_s_pipeline,
        }


def _solve(L: int, N: int, time: Callable[[int, int, int], float],
           fits: Callable[[int, int, int], bool], skip: bool,
           points: Optional[frozenset] = None) -> Optional[List[Tuple[int, int, int]]]:
    """Stages (node, start, end) over nodes 0..N-1 in order covering [0, L), or None if none fits.

    Minimizes the slowest stage, then the sum of stage times, then the number
    of stages. Two exact dynamic programmes over (node prefix, layer prefix):
    the first finds the least possible maximum T (max composes monotonically);
    the second, among stages no slower than T, minimizes (sum, count), which
    add up stage by stage. ``skip`` lets a node take no layers. Stage time and
    memory never decrease as a stage grows, so scanning starts downward may stop
    at the first miss; stages end (and so start) only at ``points`` (None: anywhere). O(N L^2).
    """
    INF = math.inf
    ends = [e for e in range(1, L + 1) if points is None or e in points]
    best = [0.0] + [INF] * L
    for n in range(N):
        row = list(best) if skip else [INF] * (L + 1)
        for e in ends:
            v = row[e]
            for s in range(e - 1, -1, -1):
                if not fits(n, s, e):
                    break
                if best[s] < v:
                    c = max(best[s], time(n, s, e))
                    if c < v:
                        v = c
            row[e] = v
        best = row
    limit = best[L]
    if limit == INF:
        return None
    # Second pass: g[e] = (sum, count) of the best prefix ending at layer e; back[n][e] its last stage start.
    g: List[Optional[Tuple[float, int]]] = [(0.0, 0)] + [None] * L
    back: List[List[int]] = []
    for n in range(N):
        row = list(g) if skip else [None] * (L + 1)
        brow = [-1] * (L + 1)                             # -1: node n unused for this prefix
        for e in ends:
            for s in range(e - 1, -1, -1):
                if not fits(n, s, e):
                    break
                t = time(n, s, e)
                if t > limit:
                    break
                if g[s] is None:
                    continue
                cand = (g[s][0] + t, g[s][1] + 1)
                if row[e] is None or cand < row[e]:
                    row[e], brow[e] = cand, s
        g = row
        back.append(brow)
    stages, e = [], L
    for n in range(N - 1, -1, -1):
        s = back[n][e]
        if s >= 0:
            stages.append((n, s, e))
            e = s
    assert e == 0, "planner back-pointers lost a layer"
    return stages[::-1]


class _Problem:
    """Precomputed stage times and memory of one (model, nodes, context) question."""

    def __init__(self, cost: ModelCost, nodes: Sequence[NodeSpec], context: int,
                 concurrency: int, hop_seconds: float, workload: Workload = Workload(0), timed: bool = True) -> None:
        if not nodes:
            raise ValueError("no nodes given")
        if cost.num_layers < 1:
            raise ValueError("the model has no layers")
        if context < 1 or concurrency < 1:
            raise ValueError("context and concurrency must be at least 1")
        if hop_seconds < 0:
            raise ValueError("hop time must not be negative")
        for node in nodes:
            if node.memory_bytes <= 0:
                raise ValueError(f"node {node.name}: memory must be positive")
            if node.decode_rows < 1:
                raise ValueError(f"node {node.name}: a decode step generates at least one token")
        self.cost, self.nodes, self.hop, self.work = cost, list(nodes), hop_seconds, workload
        self.L, self.N = cost.num_layers, len(nodes)
        tokens = self.tokens = context * concurrency
        self.weights = cost.stage_weight_bytes    # (start, end) -> bytes: the one formula, on prefix sums
        self.kvpre = list(itertools.accumulate((l.kv_bytes_per_token * tokens for l in cost.layers), initial=0))
        self.tpre, self.embed_t, self.head_t, self.ppre, self.pembed = [], [], [], [], []
        for node in nodes if timed else ():  # (``fits`` asks about memory alone)
            layers, embed, head = node.times(cost)
            self.tpre.append(list(itertools.accumulate(layers, initial=0.0)))
            self.embed_t.append(embed)
            self.head_t.append(head)
            layers, embed = node.prefill_times(cost, workload.chunk_tokens)
            self.ppre.append(list(itertools.accumulate(layers, initial=0.0)))
            self.pembed.append(embed)

    def kv(self, s: int, e: int) -> int:
        return self.kvpre[e] - self.kvpre[s]

    def need(self, s: int, e: int) -> int:
        """Memory of a stage running layers [s, e): its weights and its KV margin."""
        return self.weights(s, e) + KV_MARGIN * self.kv(s, e)

    def fits(self, n: int, s: int, e: int) -> bool:
        return self.need(s, e) <= self.nodes[n].memory_bytes

    def decode_time(self, n: int, s: int, e: int) -> float:
        ends = (self.embed_t[n] if s == 0 else 0.0) + (self.head_t[n] if e == self.L else 0.0)
        return self.tpre[n][e] - self.tpre[n][s] + self.hop + ends

    def prefill_time(self, n: int, s: int, e: int) -> float:  # per prompt token; 0: not costed
        t = self.ppre[n][e] - self.ppre[n][s] + (self.pembed[n] if s == 0 else 0.0)
        return t + self.hop / self.work.chunk_tokens if t else 0.0

    def time(self, n: int, s: int, e: int) -> float:
        """What the planner balances: a decode step and the workload's prompt tokens of prefill
        for the tokens that step generates."""
        rows = self.nodes[n].decode_rows
        return self.decode_time(n, s, e) + self.work.prompt_ratio * rows * self.prefill_time(n, s, e)

    def plan(self, stages: Sequence[Tuple[int, int, int]]) -> Plan:
        out = tuple(PlannedStage(n, self.nodes[n].name, s, e, self.weights(s, e), self.kv(s, e),
                                 self.decode_time(n, s, e), self.prefill_time(n, s, e)) for n, s, e in stages)
        used = {n for n, _, _ in stages}
        return Plan(out, self.L, tuple(node.name for i, node in enumerate(self.nodes) if i not in used),
                    self.work.chunk_tokens)

    def infeasible(self) -> PlanInfeasible:
        need = self.need(0, self.L)
        have = sum(n.memory_bytes for n in self.nodes)
        if need > have:
            return PlanInfeasible(f"needs {gb(need)} for weights and KV cache ({gb(self.weights(0, self.L))} and "
                                  f"{KV_MARGIN} x {gb(self.kv(0, self.L))} for {self.tokens} tokens), the nodes "
                                  f"have {gb(have)}: {gb(need - have)} short")
        largest = max(n.memory_bytes for n in self.nodes)
        for i in range(self.L):
            one = self.need(i, i + 1)
            if one > largest:
                extra = " with the embedding" if i == 0 else " with the output head" if i == self.L - 1 else ""
                return PlanInfeasible(f"layer {i} ({self.cost.layers[i].kind}{extra}) needs {gb(one)} with its "
                                      f"KV cache and fits on no node: the largest has {gb(largest)}")
        return PlanInfeasible(f"needs {gb(need)} for weights and KV cache and the nodes have {gb(have)}, but no "
                              f"contiguous split of the {self.L} layers fits the nodes in the order given: "
                              f"{gb(have - need)} to spare is too little to round up to whole layers")


def plan(cost: ModelCost, nodes: Sequence[NodeSpec], *, context: int = PLANNED_CONTEXT, concurrency: int = ClusterConfig.concurrency,
         hop_seconds: float = 0.0, every_node: bool = False, workload: Workload = Workload(),
         cuts: Optional[Sequence[int]] = None) -> Plan:
    """The best contiguous split of the model's layers over ``nodes``, in the order given.

    Every layer runs exactly once; each stage's weights plus ``KV_MARGIN`` times its
    KV cache for ``context`` x ``concurrency`` tokens (at the bits of ``cost``'s KV:
    ``ModelCost.at_kv_bits``) fit its node's ``memory_bytes``. A
    stage's time is its layers' times, plus the embedding on the first stage,
    the head on the last, and ``hop_seconds`` for sending its output on. The
    slowest stage is minimized, then the sum of stage times, then the number of
    stages; a node may get no layers, unless ``every_node`` (stages that are
    already running, such as local stage processes). With ``workload``, each
    stage's time also counts its prefill of ``prompt_ratio`` prompt tokens, on
    nodes whose prefill is costed (``NodeSpec.flops_per_s``). Raises
    ``PlanInfeasible`` when nothing fits. ``cuts``: where the model may be cut (its valid
    cut points, ``shards/models/cuts.py``; None: after any layer).
    """
    points = None if cuts is None else frozenset({0, cost.num_layers, *cuts})
    units = cost.num_layers if points is None else len(points) - 1
    if every_node and len(nodes) > units:
        raise PlanInfeasible(f"cannot give each of {len(nodes)} nodes one of the {units} parts the model can be "
                             f"cut into")
    prob = _Problem(cost, nodes, context, concurrency, hop_seconds, workload)
    stages = _solve(prob.L, prob.N, prob.time, prob.fits, skip=not every_node, points=points)
    if stages is None:
        raise prob.infeasible()
    return prob.plan(stages)



def fits(cost: ModelCost, nodes: Sequence[NodeSpec], context: int, concurrency: int = ClusterConfig.concurrency,
         every_node: bool = False) -> bool:
    """Whether any contiguous split of ``cost``'s layers over ``nodes`` (in order) holds the
    weights and ``KV_MARGIN`` x the KV cache of ``context`` x ``concurrency`` tokens: what
    ``plan`` would find a plan for, in O(nodes + layers). Each node takes the longest run
    of layers that fits it (more layers on a node never make a later stage larger; with
    ``every_node``, it leaves one layer for each node after it)."""
    prob = _Problem(cost, nodes, context, concurrency, 0.0, timed=False)
    s = 0
    for n in range(prob.N):
        e, cap = s, prob.L - (prob.N - 1 - n if every_node else 0)
        while e < cap and prob.fits(n, s, e + 1):
            e += 1
        if every_node and e == s:
            return False
        s = e
    return s == prob.L

