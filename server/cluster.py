"""Putting a pipeline together: model, stages (local processes or remote nodes),
layer split, engine. Shared by ``mlxpipe generate``, ``serve`` and ``bench``."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

from mlxpipe.server.engine import Engine
from mlxpipe.server.pipeline import LocalStages, Pipeline, even_split, split_from_sizes
from mlxpipe.server.scheduler import SchedulerConfig

logger = logging.getLogger(__name__)


@dataclass
class ClusterConfig:
    model: str = "default"          # folder, cached HF repo id, or "default"
    stages: int = 2                 # local stage processes (ignored with `nodes`)
    nodes: List[str] = field(default_factory=list)  # host:port of running `mlxpipe node`s
    split: Optional[str] = None     # None/"even", or layer counts "18,12"
    pin: bool = False               # pin local stage i to CPU core i
    chunk_size: int = 256           # prefill tokens per frame
    groups: Optional[int] = None    # micro-batch groups in flight (default: one per stage)
    max_batch: int = 32             # sequences per group
    max_running: Optional[int] = None  # sequences holding caches (default: groups x max_batch)
    max_waiting: int = 256          # queued requests before the server says "busy"
    stage_log_level: str = "WARNING"


def available_cpus() -> List[int]:
    """The cores this process may run on; stage i is pinned to the i-th (round robin)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def read_config(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config", config) | {"model_type": config.get("model_type")}


def plan_ranges(num_layers: int, stages: int, split: Optional[str]) -> List[Tuple[int, int]]:
    if split in (None, "", "even"):
        return even_split(num_layers, stages)
    sizes = [int(x) for x in split.split(",")]
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

    async def start(self) -> "Cluster":
        from mlx_lm.utils import load_tokenizer

        from mlxpipe.shards.store import resolve_model

        cfg = self.config
        self.model_path = resolve_model(cfg.model)
        self.model_config = read_config(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path,
                                        eos_token_ids=self.model_config.get("eos_token_id"))
        n = len(cfg.nodes) or cfg.stages
        ranges = plan_ranges(int(self.model_config["num_hidden_layers"]), n, cfg.split)
        addresses = list(cfg.nodes)
        if not addresses:
            self.local = LocalStages(n, cpus=available_cpus() if cfg.pin else None,
                                     log_level=cfg.stage_log_level)
            addresses = self.local.start()
        groups = cfg.groups or n
        sched = SchedulerConfig(
            num_groups=groups,
            max_batch=cfg.max_batch,
            chunk_size=cfg.chunk_size,
            max_prefill_inflight=n,
            max_running=cfg.max_running,
            max_waiting=cfg.max_waiting,
        )
        # A stage must take a whole group, and a prefill chunk.
        model_arg = str(self.model_path) if not cfg.nodes else cfg.model
        self.pipeline = Pipeline(addresses, ranges, model_arg, max_batch=cfg.max_batch,
                                 max_tokens=cfg.chunk_size)
        try:
            replies = await self.pipeline.load()
            self.engine = Engine(self.pipeline, sched,
                                 eos_token_ids=sorted(self.tokenizer.eos_token_ids),
                                 max_context=replies[0].max_context)
            await self.engine.start()
        except BaseException:
            await self.stop()
            raise
        return self

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
