"""Putting a pipeline together: model, stages (local processes or remote nodes),
layer split, engine. Shared by ``mlxpipe generate``, ``serve`` and ``bench``."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto.rpc import Security
from mlxpipe.server.draft_model import load_draft_model
from mlxpipe.server.engine import Engine, Observer, Rebuilt, Supervision
from mlxpipe.server.pipeline import (LocalStages, Pipeline, PipelineError, QuantizedSource, WeightSource, even_split,
                                     probe, split_from_sizes)
from mlxpipe.server.prefix import block_cost, snapshot_every
from mlxpipe.server.scheduler import SchedulerConfig
from mlxpipe.server.structured import tokenizer_json
from mlxpipe.shards.layers import with_sizes
from mlxpipe.shards.quant_spec import DEFAULT_GROUP_SIZE, QuantSpec
from mlxpipe.shards.store import fingerprint, text_config

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
    max_batch: int = SchedulerConfig.max_batch  # sequences per group
    max_running: Optional[int] = None  # sequences holding caches (default: groups x max_batch)
    max_waiting: int = 256          # queued requests before the server says "busy"
    profile_batch: int = 8          # rows per decode step the planner balances for
    context: Optional[int] = None   # tokens per sequence the KV cache must hold (default: min(model, 8192))
    concurrency: int = 4            # sequences whose KV cache must fit, for planning memory
    restart: bool = True            # restart local stage processes that die or stall, in place
    rejoin_timeout_s: float = 30.0  # how long a failed remote node gets to come back before re-planning
    supervision: Supervision = field(default_factory=Supervision)
    security: Security = field(default_factory=Security)  # toward --nodes (local stages get a fresh secret)
    weights_rate: Optional[float] = None  # bytes/s at most when streaming weights to a node that lacks them
    join_listen: Optional[str] = None     # host:port where nodes may join (`mlxpipe node --join`)
    wait_nodes: int = 0             # with join_listen: nodes (listed + joined) to wait for before serving
    stage_log_level: str = "WARNING"
    prefix_cache_bytes: Optional[int] = None  # per stage, for cached prefix blocks (None: half the KV budget; 0: off)
    block_tokens: int = 16          # positions per prefix-cache block
    speculate: bool = True          # verify drafted tokens (prompt lookup) while few sequences are live
    spec_depth: int = 8             # drafted positions in flight per sequence, at most
    draft_model: Optional[str] = None  # a small model with the same tokenizer the head drafts with
    bits: Optional[str] = None      # quantize a full-precision model as stages load it: "4", a recipe, or "auto"
    group_size: int = DEFAULT_GROUP_SIZE  # weights per quantization scale and bias, with `bits`


def available_cpus() -> List[int]:
    """The cores this process may run on; stage i is pinned to the i-th (round robin)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def read_config(path: Path) -> dict:
    """mlx-lm's reading of the config (generation_config.json's eos_token_id wins); for a
    multimodal model its text part, with the model type and end-of-sequence ids of the whole."""
    from mlx_lm.utils import load_config

    config = load_config(path)
    text = with_sizes(text_config(config)) | {"model_type": config.get("model_type")}
    if "eos_token_id" in config:
        text["eos_token_id"] = config["eos_token_id"]
    return text


def kv_token_budget(pipeline: Pipeline) -> int:
    """KV positions the scheduler may reserve: the tightest stage's cache cap over
    what a token costs there, halved for the padding of batched caches."""
    loads = [st.load for st in pipeline.stages]
    return min(r.max_cache_bytes // max(r.kv_bytes_per_token, 1) for r in loads) // 2


def prefix_blocks(pipeline: Pipeline, max_kv_tokens: int, cache_bytes: Optional[int]) -> int:
    """Prefix-cache blocks every stage may keep: ``cache_bytes`` on the stage where a
    block costs most (default: half the KV budget; with state snapshots, half of each
    stage's cache bytes); 0 when a stage keeps none."""
    loads = [st.load for st in pipeline.stages]
    block = loads[0].block_tokens
    if not block or any(r.block_tokens != block for r in loads):
        return 0
    every = snapshot_every(block, [(r.kv_bytes_per_token, r.state_bytes) for r in loads])
    if cache_bytes is None and not every:
        return max_kv_tokens // 2 // block
    fits = [(r.max_cache_bytes // 2 if cache_bytes is None else cache_bytes)
            // max(block_cost(block, r.kv_bytes_per_token, r.state_bytes, every), 1) for r in loads]
    return min(min(fits), max_kv_tokens // block)


def verify_positions(row_cost: float, stages: int, depth: int = 4) -> int:
    """Positions per VERIFY frame that get ``depth`` + 1 positions (a typical
    window: the depth adapts) through ``stages`` stages soonest, when a frame of p
    positions costs 1 + row_cost x (p - 1) one-row steps: 1 where rows cost about
    in proportion (every stage works on its own frame, and a miss wastes least),
    the whole window in one frame where rows are nearly free."""
    def seconds(p: int) -> float:
        return (-(-(depth + 1) // p) + stages - 1) * (1 + row_cost * (p - 1))

    return min(range(1, depth + 2), key=lambda p: (seconds(p), -p))  # ties: fewer frames


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
    """A started pipeline with its engine and tokenizer, and the means to rebuild
    it after a fault (``rebuild``, which the engine calls)."""

    def __init__(self, config: ClusterConfig, observer: Optional[Observer] = None):
        self.config = config
        self.observer = observer  # handed to the engine (e.g. metrics.Metrics)
        self.local: Optional[LocalStages] = None
        self.engine: Optional[Engine] = None  # owns the running pipeline
        self.tokenizer = None
        self.model_path: Optional[Path] = None
        self.model_config: dict = {}
        self.addresses: List[str] = []   # every stage we may use, in pipeline order
        self.profiles: Dict[str, pb.ProfileReply] = {}  # by address
        self.plan_note = ""
        self.security = Security()
        self.weights: Optional[WeightSource] = None  # for remote nodes that lack the model
        self.draft = None  # draft_model.DraftModel (--draft-model), handed to the engine
        self.quant: Optional[QuantSpec] = None  # how stages quantize the model as they load it (None: as stored)
        self._quantized: Dict[str, QuantizedSource] = {}  # by spec, for remote nodes that lack the model
        self.joined: Dict[str, object] = {}  # address -> join.Joined
        self.join_server = None
        self._node_added = asyncio.Event()

    @property
    def _model_arg(self) -> str:
        # Local stages load the head's own folder; remote nodes resolve the name themselves.
        return str(self.model_path) if self.local is not None else self.config.model

    @property
    def pipeline(self) -> Pipeline:
        """The running pipeline (the engine's: it replaces it after a rebuild)."""
        return self.engine.pipeline

    @property
    def row_cost(self) -> float:
        """What an extra row of a step costs on these nodes (1 when not profiled: the safe guess)."""
        costs = sorted(p.row_cost for p in self.profiles.values() if p.layer_seconds)
        return costs[len(costs) // 2] if costs else 1.0

    @functools.cached_property
    def tokenizer_spec(self) -> pb.TokenizerSpec:
        """The tokenizer as the last stage needs it for grammars."""
        return pb.TokenizerSpec(json=tokenizer_json(self.tokenizer), eos_token_ids=sorted(self.tokenizer.eos_token_ids))

    @property
    def vocab_size(self) -> int:
        return int(self.model_config.get("vocab_size", 0)) or len(self.tokenizer)

    @property
    def num_layers(self) -> int:
        return int(self.model_config["num_hidden_layers"])

    async def start(self) -> "Cluster":
        from mlx_lm.utils import load_tokenizer

        from mlxpipe.shards.store import resolve_model

        cfg = self.config
        self.model_path = resolve_model(cfg.model)
        self.model_config = read_config(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path,
                                        eos_token_ids=self.model_config.get("eos_token_id"))
        if cfg.bits is not None:  # refuse what cannot be quantized before starting anything
            if "quantization" in self.model_config:
                raise ValueError(f"{self.model_path} is quantized already; --bits quantizes a full-precision "
                                 "model (bf16, fp16, fp32, or DeepSeek's FP8) as the stages load it")
            if cfg.bits == "auto" and cfg.split not in (None, "auto"):
                raise ValueError("--bits auto needs --split auto: the planner chooses the bits")
            if cfg.bits != "auto":
                self.quant = QuantSpec.parse(cfg.bits, cfg.group_size)
        if cfg.split not in (None, "auto"):  # refuse a bad --split before starting anything
            # (nodes that join are not known yet: then the split need only fit the model)
            named = len(cfg.split.split(",")) if cfg.join_listen else len(cfg.nodes) or cfg.stages
            fixed_ranges(self.num_layers, named, cfg.split)
        # A draft model that cannot draft for this one is refused before anything starts.
        self.draft = await asyncio.to_thread(load_draft_model, cfg.draft_model, self.tokenizer)
        pipeline = None
        try:
            if cfg.nodes or cfg.join_listen:
                self.addresses = list(cfg.nodes)
                self.security = cfg.security
                self.weights = WeightSource(self.model_path, fingerprint(self.model_path), self.num_layers,
                                            rate=cfg.weights_rate)
                if cfg.join_listen:
                    from mlxpipe.server.join import start_join_server

                    self.join_server = await start_join_server(self, cfg.join_listen, self.security)
                    while len(self.addresses) < max(cfg.wait_nodes, 1):
                        logger.warning("waiting for nodes to join at %s (%d of %d)", cfg.join_listen,
                                       len(self.addresses), max(cfg.wait_nodes, 1))
                        self._node_added.clear()
                        await self._node_added.wait()
                await self._await_nodes()
            else:
                # Local stages: a random cluster secret of their own, so that other
                # users of this machine cannot drive them either.
                self.security = Security(secret=secrets.token_urlsafe(32))
                self.local = LocalStages(cfg.stages, self.security.secret, self.model_path.parent,
                                         cpus=available_cpus() if cfg.pin else None, log_level=cfg.stage_log_level)
                self.addresses = self.local.start()
            pipeline = await self._build(self.addresses)
            n = len(pipeline.stages)  # the planner may have left nodes out
            kv = kv_token_budget(pipeline)
            sched = SchedulerConfig(
                max_kv_tokens=kv,
                block_tokens=cfg.block_tokens,
                prefix_blocks=prefix_blocks(pipeline, kv, cfg.prefix_cache_bytes),
                speculate=cfg.speculate,
                spec_max_running=n,
                spec_depth=cfg.spec_depth,
                spec_positions=verify_positions(self.row_cost, n),
                spec_frames=n,
                num_groups=cfg.groups or n,
                max_batch=cfg.max_batch,
                chunk_size=cfg.chunk_size,
                max_prefill_inflight=n,
                max_running=cfg.max_running,
                max_waiting=cfg.max_waiting,
            )
            self.engine = Engine(pipeline, sched,
                                 eos_token_ids=sorted(self.tokenizer.eos_token_ids),
                                 max_context=pipeline.stages[0].load.max_context,
                                 rebuild=self.rebuild, supervision=cfg.supervision, observer=self.observer,
                                 draft_model=self.draft)
            await self.engine.start()
        except BaseException:
            if self.engine is None and pipeline is not None:
                await pipeline.close()
            if self.engine is None and self.draft is not None:
                self.draft.close()
            await self.stop()
            raise
        return self

    def _pipeline(self, addresses: List[str]) -> Pipeline:
        cfg = self.config
        cap = 0  # remote nodes cap their KV caches at the memory they offer, less weights
        if self.local is not None:
            # Local stages share this machine's memory.
            from mlxpipe.shards.profile import offered_memory

            model_bytes = sum(f.stat().st_size for f in self.model_path.glob("*.safetensors"))
            cap = max(offered_memory() - model_bytes, 0) // len(addresses)
        return Pipeline(addresses, self._model_arg, self.security, max_batch=cfg.max_batch,
                        max_chunk_tokens=cfg.chunk_size, max_cache_bytes=cap,
                        block_tokens=cfg.block_tokens if cfg.prefix_cache_bytes != 0 else 0,
                        tokenizer=self.tokenizer_spec)

    async def _await_up(self, down: Dict[str, str], refuse: bool = False) -> Dict[str, str]:
        """Probe the stages in ``down`` (address -> why) about once a second until they
        answer or rejoin_timeout_s passes; returns those still down. With ``refuse``, a
        stage that refuses this head's secret raises at once: waiting will not help."""
        deadline = time.monotonic() + self.config.rejoin_timeout_s
        while True:
            refused = {a: e for a, e in down.items() if e.startswith("UNAUTHENTICATED")}
            if refuse and refused:
                raise PipelineError(f"nodes refused this head: {refused} (the cluster secret differs?)")
            if not down or time.monotonic() > deadline:
                return down
            await asyncio.sleep(1.0)
            down = {a: e for a, e in zip(down, await probe(list(down), self.security)) if e is not None}

    async def _await_nodes(self) -> None:
        """Wait (up to rejoin_timeout_s) for every --nodes worker to answer."""
        errors = zip(self.addresses, await probe(self.addresses, self.security))
        down = await self._await_up({a: e for a, e in errors if e is not None}, refuse=True)
        if down:
            raise PipelineError(f"nodes did not answer within {self.config.rejoin_timeout_s:.0f}s: {down}")

    async def _build(self, addresses: List[str]) -> Pipeline:
        """Split the layers over ``addresses`` and load them: a pipeline ready to open."""
        cfg = self.config
        pipeline = self._pipeline(addresses)
        try:
            if cfg.split in (None, "auto"):
                ranges, keep = await self._plan(pipeline)
                if keep != list(range(len(addresses))):  # the planner left nodes out
                    await pipeline.close()
                    pipeline = self._pipeline([addresses[i] for i in keep])
            elif cfg.split == "even" or len(cfg.split.split(",")) == len(addresses):
                ranges = fixed_ranges(self.num_layers, len(addresses), cfg.split)
            else:  # not the stages the fixed split names (one was lost, or joined): split evenly
                ranges = even_split(self.num_layers, len(addresses))
            pipeline.assign(ranges)
            await pipeline.load(progress=sys.stderr.isatty(), weights=self._weights(), quant=self.quant)
        except BaseException:
            await pipeline.close()
            raise
        return pipeline

    def _weights(self) -> Optional[WeightSource]:
        """What remote nodes that lack the model receive: the model folder, or its
        units quantized by the spec in effect (quantized on the head when first needed)."""
        if self.weights is None or self.quant is None:
            return self.weights
        key = self.quant.key()
        if key not in self._quantized:
            self._quantized[key] = QuantizedSource(self.model_path, self.weights.fingerprint, self.quant,
                                                   self.num_layers, rate=self.config.weights_rate)
        return self._quantized[key]

    async def rebuild(self, why: str, suspects: Sequence[str]) -> Rebuilt:
        """A new loaded pipeline after a fault, over the stages that work.

        Local stages that died or stalled are restarted in place (``restart``);
        remote nodes get ``rejoin_timeout_s`` to come back. Whatever still does
        not answer is left out and the layers are re-planned over the rest."""
        cfg = self.config
        # The suspects are a hint; what answers a health check now is the truth.
        errors = dict(zip(self.addresses, await probe(self.addresses, self.security)))
        up = {a: err is None for a, err in errors.items()}
        logger.warning("rebuilding after: %s; suspects %s; answering: %s", why, list(suspects),
                       [a for a, ok in up.items() if ok])
        if self.local is not None and cfg.restart:
            for i, address in enumerate(self.addresses):
                if not up[address] or not self.local.alive(i):
                    await asyncio.to_thread(self.local.restart, i)
                    up[address] = True
        elif self.local is None:
            still = await self._await_up({a: e for a, e in errors.items() if e is not None})
            up = {a: a not in still for a in self.addresses}
        alive = [a for a in self.addresses if up[a]]
        while alive:
            try:
                pipeline = await self._build(alive)
                kv = kv_token_budget(pipeline)
                return Rebuilt(pipeline, kv, prefix_blocks(pipeline, kv, self.config.prefix_cache_bytes))
            except PipelineError as err:  # e.g. a stage that cannot reach its successor
                gone = set(err.suspects) & set(alive)
                if not gone:
                    raise
                logger.warning("leaving out %s: %s", sorted(gone), err)
                alive = [a for a in alive if a not in gone]
        raise PipelineError(f"no stage is left to run the model ({why})")

    async def _plan(self, pipeline: Pipeline) -> Tuple[List[Tuple[int, int]], List[int]]:
        """Balance stage time within each node's memory (server/planner.py).

        Local stages share this machine: one profiles, each gets an equal share
        of the memory, and each gets layers (it is running already). Remote nodes
        each profile themselves; the planner may leave a node out when the
        pipeline is faster without it.
        """
        from mlxpipe.server import planner
        from mlxpipe.server.cost import load_model_cost

        cfg = self.config
        count = len(pipeline.stages)
        addresses = [st.address for st in pipeline.stages]
        local = self.local is not None
        wanted = [i for i, a in enumerate(addresses) if a not in self.profiles]
        if local and self.profiles:
            wanted = []  # one profile serves every local stage
        elif local:
            wanted = [0]
        auto = cfg.bits == "auto"
        # Nodes time the model as it will run: quantized (with --bits auto, at 4 bits,
        # scaled by bytes read to the bits each layer gets).
        profiled = QuantSpec("4", cfg.group_size) if auto else self.quant
        for i, reply in zip(wanted, await pipeline.profile(wanted, cfg.profile_batch, profiled)):
            self.profiles[addresses[i]] = reply
        if local:
            first = next(iter(self.profiles.values()))
            profiles = [first] * count
            memory = [first.memory_bytes // count] * count
        else:
            profiles = [self.profiles[a] for a in addresses]
            memory = [p.memory_bytes for p in profiles]
        cost = load_model_cost(self.model_path, quant=profiled)
        # A node without the model cannot time it: then every node is planned on
        # paper, from its measured memory bandwidth (as `mlxpipe plan` does).
        on_paper = any(not p.layer_seconds for p in profiles)
        nodes = []
        for address, prof, mem in zip(addresses, profiles, memory):
            if on_paper:
                nodes.append(planner.NodeSpec(name=address, memory_bytes=mem,
                                              bandwidth_bytes_per_s=prof.bandwidth_bytes_per_s or 1e9))
                continue
            by_kind: Dict[str, List[float]] = {}
            for layer, secs in zip(cost.layers, prof.layer_seconds):
                by_kind.setdefault(layer.kind, []).append(secs)
            nodes.append(planner.NodeSpec(
                name=address, memory_bytes=mem,
                layer_seconds={k: statistics.median(v) for k, v in by_kind.items()},
                embed_seconds=prof.embed_seconds, head_seconds=prof.head_seconds,
                profiled=cost if auto else None))
        context = cfg.context or min(int(self.model_config.get("max_position_embeddings") or 8192), 8192)
        if auto:
            choice = planner.plan_bits(lambda spec: load_model_cost(self.model_path, quant=spec), nodes,
                                       group_size=cfg.group_size, context=context, concurrency=cfg.concurrency,
                                       every_node=local)
            plan, self.quant = choice.plan, choice.spec
            logger.info("--bits auto: %s. %s", choice.spec.describe(), choice.trade())
        else:
            plan = planner.plan(cost, nodes, context=context, concurrency=cfg.concurrency, every_node=local)
        ranges, seconds = plan.ranges, [s.seconds for s in plan.stages]
        keep = [s.node_index for s in plan.stages]
        basis = "memory bandwidth" if on_paper else f"measured steps of {cfg.profile_batch} rows"
        self.plan_note = (f"planned from {basis}: " + ", ".join(
            f"[{a}, {b}) {1000 * t:.0f} ms" for (a, b), t in zip(ranges, seconds)))
        logger.info(self.plan_note)
        return ranges, keep

    async def add_node(self, joined) -> Tuple[bool, str]:
        """A node joined: plan over it too. Returns whether it is in the pipeline now."""
        if self.local is not None:
            return False, "this head runs local stages; start it with --nodes or --join-listen to accept nodes"
        self.joined[joined.address] = joined
        if joined.address not in self.addresses:
            self.addresses.append(joined.address)
        self._node_added.set()
        if self.engine is None:  # still starting: the first plan will include it
            return True, "joined; the cluster is starting"
        from mlxpipe.proto.rpc import REPLAN_WAIT_S

        await self.engine.request_replan(f"node {joined.address} joined", timeout=REPLAN_WAIT_S)
        in_plan = joined.address in [st.address for st in self.pipeline.stages]
        return in_plan, self.plan_note

    def describe(self) -> List[str]:
        lines = [f"model {self.model_path}" + (f", quantized on load: {self.quant.describe()}" if self.quant else "")]
        for i, st in enumerate(self.pipeline.stages):
            mb = st.load.weight_bytes / 1e6 if st.load else 0
            lines.append(f"stage {i}: {st.address} layers [{st.start}, {st.end}) {mb:.1f} MB")
        if self.plan_note:
            lines.append(self.plan_note)
        return lines

    async def stop(self) -> None:
        if self.join_server is not None:
            await self.join_server.stop(grace=None)
        if self.engine is not None:
            await self.engine.stop()
        if self.local is not None:
            self.local.stop()
        for source in self._quantized.values():
            source.close()

    async def __aenter__(self) -> "Cluster":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()
