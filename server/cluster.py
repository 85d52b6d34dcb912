"""Putting a pipeline together: model, stages (local processes or remote nodes),
layer split, engine. Shared by ``mlxpipe generate``, ``serve`` and ``bench``."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
import statistics
from typing import Dict, List, Optional, Tuple

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.engine import Engine
from mlxpipe.server.pipeline import LocalStages, Pipeline, even_split, split_from_sizes
from mlxpipe.server.scheduler import SchedulerConfig

logger = logging.getLogger(__name__)


@dataclass
class ClusterConfig:
    model: str = "default"          # folder, cached HF repo id, or "default"
    stages: int = 2                 # local stage processes (ignored with `nodes`)
    nodes: List[str] = field(default_factory=list)  # host:port of running `mlxpipe node`s
    split: Optional[str] = None     # None/"auto": the planner; "even"; or layer counts "18,12"
    pin: bool = False               # pin local stage i to CPU core i
    chunk_size: int = 256           # prefill tokens per frame
    groups: Optional[int] = None    # micro-batch groups in flight (default: one per stage)
    max_batch: int = 32             # sequences per group
    max_running: Optional[int] = None  # sequences holding caches (default: groups x max_batch)
    max_waiting: int = 256          # queued requests before the server says "busy"
    profile_batch: int = 8          # rows per decode step the planner balances for
    context: Optional[int] = None   # tokens per sequence the KV cache must hold (default: min(model, 8192))
    concurrency: int = 4            # sequences whose KV cache must fit, for planning memory
    stage_log_level: str = "WARNING"


def available_cpus() -> List[int]:
    """The cores this process may run on; stage i is pinned to the i-th (round robin)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def read_config(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config", config) | {"model_type": config.get("model_type")}


def fixed_ranges(num_layers: int, stages: int, split: str) -> List[Tuple[int, int]]:
    """``--split even`` or ``--split 18,12``."""
    if split == "even":
        return even_split(num_layers, stages)
    try:
        sizes = [int(x) for x in split.split(",")]
    except ValueError:
        raise ValueError(f"--split takes 'auto', 'even' or layer counts such as 18,12, not {split!r}") from None
    if len(sizes) != stages:
        raise ValueError(f"--split lists {len(sizes)} stages but there are {stages}")
    return split_from_sizes(sizes, num_layers)


class Cluster:
    """A started pipeline with its engine and tokenizer."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.local: Optional[LocalStages] = None
        self.pipeline: Optional[Pipeline] = None
        self.engine: Optional[Engine] = None
        self.tokenizer = None
        self.model_path: Optional[Path] = None
        self.model_config: dict = {}
        self.plan_note = ""

    async def start(self) -> "Cluster":
        from mlx_lm.utils import load_tokenizer

        from mlxpipe.shards.store import resolve_model

        cfg = self.config
        self.model_path = resolve_model(cfg.model)
        self.model_config = read_config(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path,
                                        eos_token_ids=self.model_config.get("eos_token_id"))
        n = len(cfg.nodes) or cfg.stages
        num_layers = int(self.model_config["num_hidden_layers"])
        if cfg.split not in (None, "auto"):
            fixed_ranges(num_layers, n, cfg.split)  # refuse a bad --split before starting anything
        addresses = list(cfg.nodes)
        if not addresses:
            self.local = LocalStages(n, cpus=available_cpus() if cfg.pin else None,
                                     log_level=cfg.stage_log_level)
            addresses = self.local.start()
        # Local stages load the head's own folder; remote nodes resolve the name themselves.
        model_arg = str(self.model_path) if not cfg.nodes else cfg.model
        try:
            self.pipeline = Pipeline(addresses, model_arg, max_batch=cfg.max_batch, max_tokens=cfg.chunk_size)
            if cfg.split in (None, "auto"):
                ranges, keep = await self._plan(num_layers)
                if keep != list(range(len(addresses))):
                    await self.pipeline.close()
                    addresses = [addresses[i] for i in keep]
                    self.pipeline = Pipeline(addresses, model_arg, max_batch=cfg.max_batch,
                                             max_tokens=cfg.chunk_size)
            else:
                ranges = fixed_ranges(num_layers, n, cfg.split)
            self.pipeline.assign(ranges)
            groups = cfg.groups or len(addresses)
            sched = SchedulerConfig(
                num_groups=groups,
                max_batch=cfg.max_batch,
                chunk_size=cfg.chunk_size,
                max_prefill_inflight=len(addresses),
                max_running=cfg.max_running,
                max_waiting=cfg.max_waiting,
            )
            replies = await self.pipeline.load()
            self.engine = Engine(self.pipeline, sched,
                                 eos_token_ids=sorted(self.tokenizer.eos_token_ids),
                                 max_context=replies[0].max_context)
            await self.engine.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def _plan(self, num_layers: int) -> Tuple[List[Tuple[int, int]], List[int]]:
        """Balance stage time within each node's memory (server/planner.py).

        Local stages share this machine: one profiles, and each gets an equal
        share of the memory. Remote nodes each profile themselves; the planner
        may leave a node out when the pipeline is faster without it.
        """
        from mlxpipe.server import planner

        cfg = self.config
        count = len(self.pipeline.stages)
        local = self.local is not None
        profiles = await self.pipeline.profile([0] if local else range(count), cfg.profile_batch)
        if local:
            share = profiles[0].memory_bytes // count
            profiles = [pb.ProfileReply(layer_seconds=profiles[0].layer_seconds,
                                        embed_seconds=profiles[0].embed_seconds,
                                        head_seconds=profiles[0].head_seconds,
                                        memory_bytes=share, node=profiles[0].node)] * count
        cost = planner.load_model_cost(self.model_path)
        nodes = []
        for st, prof in zip(self.pipeline.stages, profiles):
            by_kind: Dict[str, List[float]] = {}
            for layer, secs in zip(cost.layers, prof.layer_seconds):
                by_kind.setdefault(layer.kind, []).append(secs)
            nodes.append(planner.NodeSpec(
                name=st.address, memory_bytes=prof.memory_bytes,
                layer_seconds={k: statistics.median(v) for k, v in by_kind.items()},
                embed_seconds=prof.embed_seconds, head_seconds=prof.head_seconds))
        context = cfg.context or min(int(self.model_config.get("max_position_embeddings") or 8192), 8192)
        if local:
            # Every stage is asked for: exactly `count` non-empty ranges.
            times, embed, head = nodes[0].times(cost)
            layer_bytes = [l.weight_bytes + l.kv_bytes_per_token * context * cfg.concurrency for l in cost.layers]
            layer_bytes[0] += cost.embed_bytes
            layer_bytes[-1] += cost.head_bytes
            ranges = planner.balanced_ranges(num_layers, times, embed, head, count,
                                             memory=[n.memory_bytes for n in nodes], layer_bytes=layer_bytes)
            keep = list(range(count))
        else:
            plan = planner.plan(cost, nodes, context=context, concurrency=cfg.concurrency)
            ranges = plan.ranges
            keep = [s.node_index for s in plan.stages]
        self.plan_note = (f"planned for {cfg.profile_batch} rows per step: "
                          f"{', '.join(f'[{a}, {b})' for a, b in ranges)}")
        logger.info(self.plan_note)
        return ranges, keep

    def describe(self) -> List[str]:
        lines = [f"model {self.model_path}"]
        for i, st in enumerate(self.pipeline.stages):
            mb = st.load.weight_bytes / 1e6 if st.load else 0
            lines.append(f"stage {i}: {st.address} layers [{st.start}, {st.end}) {mb:.1f} MB")
        return lines

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.stop()
        elif self.pipeline is not None:
            await self.pipeline.close()
        if self.local is not None:
            self.local.stop()

    async def __aenter__(self) -> "Cluster":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()
