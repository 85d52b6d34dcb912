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

import logging
import statistics
from typing import Dict, List, Optional, Tuple

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.cluster import planner
from mlxpipe.server.cluster.bits import plan_bits
from mlxpipe.server.cluster.config import ClusterConfig
from mlxpipe.server.cluster.context import at_kv_bits, plan_context
from mlxpipe.server.cluster.cost import ModelCost, load_model_cost
from mlxpipe.server.cluster.model import Model
from mlxpipe.server.cluster.stage_client import Pipeline
from mlxpipe.shards.quant_spec import AUTO_RUNGS, QuantSpec

logger = logging.getLogger(__name__)


class Placer:
    """Plans a pipeline's layers; keeps each node's profile (by address) across plans."""

    def __init__(self, config: ClusterConfig, model: Model, local: bool):
        self.config, self.model, self.local = config, model, local
        self.profiles: Dict[str, pb.ProfileReply] = {}
        self.note = ""  # the last plan, in words

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
        if self.local:
            first = next(iter(self.profiles.values()))
            return [first] * count, [first.memory_bytes // count] * count
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

    async def plan(self, pipeline: Pipeline) -> Tuple[List[Tuple[int, int]], List[int]]:
        """Layer ranges that balance stage time within each node's memory, and the indices
        of the stages that get them (all, for local stages)."""
        cfg, path = self.config, self.model.path
        auto = cfg.bits == "auto"
        # Nodes time the model as it will run: quantized (with --bits auto, at 4 bits,
        # scaled by bytes read to the bits each layer gets).
        profiled = QuantSpec("4", cfg.group_size) if auto else self.model.quant
        profiles, memory = await self._profile(pipeline, profiled)
        cost = load_model_cost(path, quant=profiled)
        # A node without the model cannot time it: then every node is planned on
        # paper, from its measured memory bandwidth (as `mlxpipe plan` does).
        on_paper = any(not p.layer_seconds for p in profiles)
        nodes = self._nodes([st.address for st in pipeline.stages], profiles, memory, cost, on_paper, auto)
        plan = self._plan(nodes, cost if not auto else None)
        ranges = plan.ranges
        basis = "memory bandwidth" if on_paper else f"measured steps of {cfg.profile_batch} rows"
        costed = any(s.prefill_seconds for s in plan.stages)
        if costed and cfg.prompt_ratio:
            basis += f" and prompt chunks, for {cfg.prompt_ratio:g} prompt tokens per generated token"
        self.note = (f"planned from {basis}: " + ", ".join(
            f"[{s.start}, {s.end}) {1000 * s.seconds:.0f} ms"
            + (f" + {1000 * s.prefill_seconds:.1f} ms per prompt token" if costed else "") for s in plan.stages))
        logger.info(self.note)
        return ranges, [s.node_index for s in plan.stages]

    def _plan(self, nodes: List[planner.NodeSpec], cost: Optional[ModelCost]) -> planner.Plan:
        """The split for the context declared (``--context``), or the model's own clamped to
        what fits, at ``--kv-bits``; with ``--bits auto`` (``cost`` None) the bits too."""
        cfg, path = self.config, self.model.path
        kw = dict(concurrency=cfg.concurrency, every_node=self.local,
                  workload=planner.Workload(cfg.prompt_ratio, cfg.chunk_size))
        most = self.model.max_positions
        if cost is None:
            cost_of = lambda spec: at_kv_bits(load_model_cost(path, quant=spec), cfg.kv_bits)  # noqa: E731
            lowest = min((cost_of(QuantSpec(r, cfg.group_size)) for r in AUTO_RUNGS), key=lambda c: c.weight_bytes)
            context, choice, clamped = plan_context(
                lambda c: plan_bits(cost_of, nodes, group_size=cfg.group_size, context=c, **kw), most,
                lambda c: planner.fits(lowest, nodes, c, cfg.concurrency, self.local), cfg.context)
            plan, self.model.quant = choice.plan, choice.spec
            logger.info("--bits auto: %s. %s", choice.spec.describe(), choice.trade())
        else:
            cost = at_kv_bits(cost, cfg.kv_bits)
            context, plan, clamped = plan_context(
                lambda c: planner.plan(cost, nodes, context=c, **kw), most,
                lambda c: planner.fits(cost, nodes, c, cfg.concurrency, self.local), cfg.context)
        if clamped:
            logger.warning("the model's %d positions of context do not fit beside its weights: planned for %d "
                           "(x %d requests at once, --concurrency)", most, context, cfg.concurrency)
        return plan


def _by_kind(cost: ModelCost, seconds) -> Dict[str, float]:
    """A profile's per-layer seconds as the median per layer kind (what ``NodeSpec`` takes);
    empty for a profile without them."""
    by_kind: Dict[str, List[float]] = {}
    for layer, secs in zip(cost.layers, seconds):
        by_kind.setdefault(layer.kind, []).append(secs)
    return {k: statistics.median(v) for k, v in by_kind.items()}
