"""Which layers run where: the planner (``planner.py``, over ``cost.py``'s model
of each layer) fed with what the nodes measured of themselves (``Profile``), or,
when a node cannot time the model, with their memory bandwidth, on paper.

Local stages share this machine: one profiles, each gets an equal share of the
memory, and each gets layers (it is running already). Remote nodes each
profile themselves; the planner may leave a node out when the pipeline is
faster without it. With ``--bits auto`` the planner also picks each layer's
bits, and the model is quantized by that choice.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from dataclasses import replace
from typing import Dict, FrozenSet, List, Optional, Tuple

import grpc

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.cluster import groupplan, linkplan, planner, tp_backend
from mlxpipe.server.cluster.bits import plan_bits
from mlxpipe.server.cluster.context import at_kv_bits, plan_context
from mlxpipe.server.cluster.cost import ModelCost, load_model_cost
from mlxpipe.server.cluster.mix import effective_ratio
from mlxpipe.server.cluster.model import Model
from mlxpipe.server.cluster.sizing import planned_context, uses_mtp
from mlxpipe.server.cluster.stage_client import Pipeline
from mlxpipe.server.config import ClusterConfig
from mlxpipe.server.core.transport import PipelineError
from mlxpipe.shards.net.links import measure
from mlxpipe.shards.params.quant import AUTO_RUNGS, QuantSpec

logger = logging.getLogger(__name__)


class Placer:
    """Plans a pipeline's layers; keeps each node's profile (by address) across plans."""

    def __init__(self, config: ClusterConfig, model: Model, local: bool):
        self.config, self.model, self.local = config, model, local
        self.profiles: Dict[str, pb.ProfileReply] = {}
        self.note = ""  # the last plan, in words
        self.hops: Dict[tuple, pb.LinkFigures] = {}  # ("head", a) or (a, b) sorted -> the link, timed once
        self.prediction: List[str] = []  # what the running split predicts, links priced
        self.measured: Optional[dict] = None  # the workload the head measured (core/workload.py's mix)
        self._cost: Optional[ModelCost] = None  # the model's cost as it runs (for the measured mix's split)
        self.planned = 0  # tokens per request the last plan made room for (0: no plan yet)
        self.widths: Optional[Tuple[int, ...]] = None  # ``--tp auto``: each stage's group, as the last plan chose

    def ratio(self) -> Tuple[float, str]:
        """The prompt tokens per generated token the split is balanced for, and whence."""
        if self.config.prompt_ratio is not None:
            return self.config.prompt_ratio, "--prompt-ratio"
        if self.measured is not None:
            return round(effective_ratio(self.measured, self.row_cost, self.config.profile_batch), 2), \
                "the workload measured"
        return planner.Workload.prompt_ratio, "the default"

    @property
    def context(self) -> int:
        """Tokens per request the running split was planned for (before any plan: a guess)."""
        return self.planned or planned_context(self.config, self.model.config.get("max_position_embeddings"))

    def measured_nodes(self, addresses: List[str]):
        """(cost, NodeSpecs) of ``addresses`` from the profiles already taken; None if any is missing."""
        if self.local and self.profiles:
            first = next(iter(self.profiles.values()))
            profiles, memory = [first] * len(addresses), [first.memory_bytes // len(addresses)] * len(addresses)
        elif all(a in self.profiles and self.profiles[a].layer_seconds for a in addresses):
            profiles = [self.profiles[a] for a in addresses]
            memory = [p.memory_bytes for p in profiles]
        else:
            return None
        if self._cost is None:
            self._cost = load_model_cost(self.model.path, quant=self.model.quant, mtp=uses_mtp(self.config))
        return self._cost, self._nodes(addresses, profiles, memory, self._cost, False, False)

    @property
    def row_cost(self) -> float:
        """What an extra row of a step costs on these nodes (1 when not profiled: the safe guess)."""
        costs = sorted(p.row_cost for p in self.profiles.values() if p.layer_seconds)
        return costs[len(costs) // 2] if costs else 1.0

    async def _profile(self, pipeline: Pipeline, quant) -> Tuple[List[pb.ProfileReply], List[int]]:
        """Every stage's profile (asking those not yet profiled) and memory budget."""
        count = len(pipeline.stages)
        addresses = [st.address for st in pipeline.stages]
        wanted = [i for i, a in enumerate(addresses) if a not in self.profiles]
        if self.local:
            wanted = [] if self.profiles else [0]  # one profile serves every local stage
        for i, reply in zip(wanted, await pipeline.profile(wanted, self.config.profile_batch, quant)):
            self.profiles[addresses[i]] = reply
        if self.local:  # this machine's memory shared by every rank: a group's stage gets its ranks' shares
            first = next(iter(self.profiles.values()))
            widths = [1 + len(st.ranks) for st in pipeline.stages]
            return [first] * count, [first.memory_bytes * w // sum(widths) for w in widths]
        profiles = [self.profiles[a] for a in addresses]
        return profiles, [p.memory_bytes for p in profiles]

    def _nodes(self, addresses: List[str], profiles, memory, cost: ModelCost, on_paper: bool,
               auto: bool) -> List[planner.NodeSpec]:
        nodes = []
        for address, prof, mem in zip(addresses, profiles, memory):
            if on_paper:
                nodes.append(planner.NodeSpec(name=address, memory_bytes=mem,
                                              bandwidth_bytes_per_s=prof.bandwidth_bytes_per_s or 1e9))
                continue
            nodes.append(planner.NodeSpec(
                name=address, memory_bytes=mem, layer_seconds=_by_kind(cost, prof.layer_seconds),
                embed_seconds=prof.embed_seconds, head_seconds=prof.head_seconds,
                profiled=cost if auto else None,
                prefill_layer_seconds=_by_kind(cost, prof.prefill_layer_seconds) or None,
                prefill_embed_seconds=prof.prefill_embed_seconds, decode_rows=self.config.profile_batch))
        return nodes

    def _grouped(self, pipeline: Pipeline, cost: ModelCost, nodes: List[planner.NodeSpec]) -> List[planner.NodeSpec]:
        """A stage that is a tensor-parallel group planned as one node (``groupplan.group_node``): local
        ranks (``nodes``' memory theirs together) over loopback; a group of remote nodes (the leader's
        profile for each) over what its ranks measured when they last loaded, else free links."""
        out = []
        for st, node in zip(pipeline.stages, nodes):
            k = 1 + len(st.ranks)
            if k == 1:
                out.append(node)
                continue
            measured = st.load.allreduce_seconds if st.load is not None else 0.0
            hop = groupplan.LOOPBACK if self.local else linkplan.Hop(measured / (2 * (k - 1)))
            member = node if not self.local else replace(node, memory_bytes=node.memory_bytes // k)
            out.append(groupplan.group_node(cost, [member] * k, hop, int(self.model.config["hidden_size"])))
        return out

    async def plan(self, pipeline: Pipeline) -> Tuple[List[Tuple[int, int]], List[int]]:
        """Layer ranges that balance stage time within each node's memory, and the indices
        of the stages that get them (all, for local stages)."""
        cfg, path = self.config, self.model.path
        auto = cfg.bits == "auto"
        # Nodes time the model as it will run: quantized (with --bits auto, at 4 bits,
        # scaled by bytes read to the bits each layer gets).
        profiled = QuantSpec("4", cfg.group_size) if auto else self.model.quant
        profiles, memory = await self._profile(pipeline, profiled)
        cost = load_model_cost(path, quant=profiled, mtp=uses_mtp(cfg))
        # A node without the model cannot time it: then every node is planned on
        # paper, from its measured memory bandwidth (as `mlxpipe plan` does).
        on_paper = any(not p.layer_seconds for p in profiles)
        nodes = self._grouped(pipeline, cost, self._nodes([st.address for st in pipeline.stages], profiles, memory,
                                                          cost, on_paper, auto))
        links = None if self.local or auto else await self._links(pipeline)
        ratio, whence = self.ratio()
        work = planner.Workload(ratio, cfg.chunk_size)
        cuts = None if self.model.cuts.all_valid else self.model.cuts.valid
        if cfg.tp == [0] and links is not None and len(nodes) > 1:  # --tp auto: groups from the links
            return self._plan_groups(cost, nodes, links, work, cuts)
        plan, order = self._plan(nodes, None if auto else cost, work, cuts, links)
        ranges = plan.ranges
        basis = "memory bandwidth" if on_paper else f"measured steps of {cfg.profile_batch} rows"
        costed = any(s.prefill_seconds for s in plan.stages)
        if costed and ratio:
            basis += f" and prompt chunks, for {ratio:g} prompt tokens per generated token ({whence})"
        self.note = (f"planned from {basis}: " + ", ".join(
            f"[{s.start}, {s.end}) {1000 * s.seconds:.0f} ms"
            + (f" + {1000 * s.prefill_seconds:.1f} ms per prompt token" if costed else "") for s in plan.stages))
        logger.info(self.note)
        return ranges, order

    def _plan_groups(self, cost: ModelCost, nodes: List[planner.NodeSpec], links: linkplan.Links,
                     work: planner.Workload, cuts) -> Tuple[List[Tuple[int, int]], List[int]]:
        """``--tp auto``: the best layout of the nodes, in order, as stages of tensor-parallel groups
        (``groupplan.py``); its widths in ``widths``, every layout in words in ``note``."""
        from mlx_lm.utils import load_config

        from mlxpipe.shards.models.tensor_parallel import why_not

        cfg, raw, quant = self.config, load_config(self.model.path), self.model.quant
        if quant is not None and quant.bits.isdigit():  # split as the stages will quantize it
            raw = dict(raw, quantization={"bits": int(quant.bits), "group_size": quant.group_size})
        cost = at_kv_bits(cost, cfg.kv_bits, cfg.kv_group_size)
        best, choices = groupplan.choose(cost, nodes, links, int(self.model.config["hidden_size"]),
                                         lambda k: why_not(raw, k), context=self.context,
                                         concurrency=cfg.concurrency, workload=work, cuts=cuts)
        self.widths, self.planned = best.widths, self.context
        self.note = "\n".join(groupplan.lines(best, choices, cfg.concurrency))
        logger.info(self.note)
        return best.priced.plan.ranges, list(range(len(nodes)))

    async def _links(self, pipeline: Pipeline) -> Optional[linkplan.Links]:
        """Every hop among the nodes and to the head, timed one after the other (once per pair);
        None where a node cannot time them (then links are not priced)."""
        small, large = pipeline.probe
        addresses = [st.address for st in pipeline.stages]
        try:
            for i, a in enumerate(addresses):
                if ("head", a) not in self.hops:
                    self.hops[("head", a)] = await measure(pipeline.stubs[i], pipeline.md, small, large, a)
                for b in addresses[i + 1:]:
                    if tuple(sorted((a, b))) not in self.hops:
                        self.hops[tuple(sorted((a, b)))] = await pipeline.stubs[i].TimeNextHop(
                            pb.LinkProbe(small=small, large=large, address=b), timeout=60, metadata=pipeline.md)
        except grpc.aio.AioRpcError as err:
            logger.warning("links not priced in the plan: %s", err.details())
            return None
        pairs = {(i, j): _hop(self.hops[tuple(sorted((a, b)))]) for i, a in enumerate(addresses)
                 for j, b in enumerate(addresses) if i < j}
        return linkplan.Links(small, tuple(_hop(self.hops[("head", a)]) for a in addresses), pairs,
                              await self._rdma(pipeline))

    async def _rdma(self, pipeline: Pipeline) -> FrozenSet[Tuple[int, int]]:
        """The pairs of nodes cabled for RDMA (their ``Hello``s' ports), where groups may use JACCL."""
        if self.config.tp_backend == "ring":
            return frozenset()
        try:
            hellos = await asyncio.gather(*(s.Hello(pb.HelloRequest(), timeout=10, metadata=pipeline.md)
                                            for s in pipeline.stubs))
        except grpc.aio.AioRpcError as err:
            logger.warning("RDMA links not known to the plan: %s", err.details())
            return frozenset()
        return tp_backend.rdma_pairs([h.rdma_ports for h in hellos])

    async def predict(self, pipeline: Pipeline) -> List[str]:
        """What the running split predicts with its links priced (as measured when it was built):
        tokens/s, time to first token, and each hop's cost (for the banner)."""
        if self.local or not pipeline.links.head:
            return []
        quant = self.model.quant
        try:
            profiles, memory = await self._profile(pipeline, quant)
            cost = load_model_cost(self.model.path, quant=quant, mtp=uses_mtp(self.config))
        except (PipelineError, ValueError) as err:  # a stage that cannot time it, a config the cost model cannot read
            logger.warning("no prediction for this split: %s", err)
            return []
        addresses = [st.address for st in pipeline.stages]
        nodes = self._grouped(pipeline, cost, self._nodes(addresses, profiles, memory, cost,
                                                          any(not p.layer_seconds for p in profiles), False))
        table = pipeline.links
        links = linkplan.Links(pipeline.probe[0], tuple(_hop(table.head[i].link) if i in table.head else
                                                        linkplan.Hop() for i in range(len(addresses))),
                               {(i, i + 1): _hop(f) for i, f in table.hops.items()})
        work = planner.Workload(self.ratio()[0], self.config.chunk_size)
        priced = linkplan.evaluate(cost, nodes, links, [(st.start, st.end) for st in pipeline.stages],
                                   context=self.context, concurrency=self.config.concurrency,
                                   workload=work)
        self.prediction = priced.lines(addresses)
        return self.prediction


    def _plan(self, nodes: List[planner.NodeSpec], cost: Optional[ModelCost], work: planner.Workload,
              cuts: Optional[List[int]], links: Optional[linkplan.Links]) -> Tuple[planner.Plan, List[int]]:
        """The split for the context declared (``--context``), or the model's own clamped to
        what fits, at ``--kv-bits``, and the nodes it uses in pipeline order; with ``--bits
        auto`` (``cost`` None) the bits too; with ``links`` every hop priced and the nodes'
        order chosen (``linkplan.py``)."""
        cfg, path = self.config, self.model.path
        kw = dict(concurrency=cfg.concurrency, workload=work, cuts=cuts)
        most = self.model.max_positions
        order = None
        if cost is None:
            cost_of = lambda spec: at_kv_bits(load_model_cost(path, quant=spec, mtp=uses_mtp(cfg)),  # noqa: E731
                                               cfg.kv_bits, cfg.kv_group_size)
            lowest = min((cost_of(QuantSpec(r, cfg.group_size)) for r in AUTO_RUNGS), key=lambda c: c.weight_bytes)
            context, choice, clamped = plan_context(
                lambda c: plan_bits(cost_of, nodes, group_size=cfg.group_size, context=c, every_node=self.local,
                                    **kw), most,
                lambda c: planner.fits(lowest, nodes, c, cfg.concurrency, self.local), cfg.context)
            plan, self.model.quant = choice.plan, choice.spec
            logger.info("--bits auto: %s. %s", choice.spec.describe(), choice.trade())
        else:
            cost = at_kv_bits(cost, cfg.kv_bits, cfg.kv_group_size)
            fits = lambda c: planner.fits(cost, nodes, c, cfg.concurrency, self.local)  # noqa: E731
            if links is not None:
                context, priced, clamped = plan_context(
                    lambda c: linkplan.plan(cost, nodes, links, context=c, **kw), most, fits, cfg.context)
                plan, order = priced.plan, priced.node_indices
            else:
                context, plan, clamped = plan_context(
                    lambda c: planner.plan(cost, nodes, context=c, every_node=self.local, **kw), most, fits,
                    cfg.context)
        if clamped:
            logger.warning("the model's %d positions of context do not fit beside its weights: planned for %d "
                           "(x %d requests at once, --concurrency)", most, context, cfg.concurrency)
        self.planned = context
        return plan, order if order is not None else [s.node_index for s in plan.stages]


def _hop(f: pb.LinkFigures) -> linkplan.Hop:
    return linkplan.Hop(f.latency_s, f.bytes_per_s or math.inf)


def _by_kind(cost: ModelCost, seconds) -> Dict[str, float]:
    """A profile's per-layer seconds as the median per layer kind (what ``NodeSpec`` takes);
    empty for a profile without them."""
    by_kind: Dict[str, List[float]] = {}
    for layer, secs in zip(cost.layers, seconds):
        by_kind.setdefault(layer.kind, []).append(secs)
    return {k: statistics.median(v) for k, v in by_kind.items()}
