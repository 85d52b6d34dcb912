"""Putting a pipeline together: the model, its stages (local processes or remote
nodes, some of which join), the layer split, the engine; and putting it together
again after a fault. Shared by ``mlxpipe generate``, ``serve`` and ``bench``."""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from mlxpipe.proto.rpc import REPLAN_WAIT_S, Security
from mlxpipe.server.cluster import groups, mix
from mlxpipe.server.cluster.checks import vet
from mlxpipe.server.cluster.discovery import DROP_AFTER_S, Discovery
from mlxpipe.server.cluster.draft_model import load_draft_model
from mlxpipe.server.cluster.embedding_model import load_embedding_model
from mlxpipe.server.cluster.head_model import check_head_memory, head_memory_lines, load_head_models
from mlxpipe.server.cluster.vision import load_vision
from mlxpipe.server.cluster.join import joined_table, start_join_server
from mlxpipe.server.cluster.local import LocalStages, placement
from mlxpipe.server.cluster.model import Model, open_model
from mlxpipe.server.cluster.placement import Placer
from mlxpipe.server.cluster.rebuild import answering, await_nodes, await_up, build_leaving_out
from mlxpipe.server.cluster.sizing import (disk_blocks, kv_quant, kv_token_budget, prefix_blocks, scheduler_config,
                                           stage_limits, uses_mtp)
from mlxpipe.server.cluster.splits import even_split, fixed_ranges
from mlxpipe.server.cluster.stage_client import Pipeline
from mlxpipe.server.cluster.weights import QuantizedSource, WeightSource
from mlxpipe.server.config import PLANNED_CONTEXT, ClusterConfig
from mlxpipe.server.core.engine import Engine, Observer
from mlxpipe.server.core.supervision import Rebuilt
from mlxpipe.server.core.transport import PipelineError
from mlxpipe.shards.models.profile import offered_memory
from mlxpipe.shards.models.store import fingerprint
from mlxpipe.shards.net.links import probe_sizes
from mlxpipe.shards.params.quant import quantized_fingerprint

logger = logging.getLogger(__name__)


class Cluster:
    """A started pipeline with its engine and tokenizer, and the means to rebuild
    it after a fault (``rebuild``, which the engine calls)."""

    def __init__(self, config: ClusterConfig, observer: Optional[Observer] = None,
                 listening: Sequence[Tuple[str, int]] = ()):
        self.config = config
        self.observer = observer  # handed to the engine (e.g. metrics.Metrics)
        self.listening = list(listening)  # the head's own sockets (its HTTP API): discovery never dials them
        self.local: Optional[LocalStages] = None
        self.engine: Optional[Engine] = None  # owns the running pipeline
        self.model: Optional[Model] = None
        self.placer: Optional[Placer] = None
        self.addresses: List[str] = []   # every stage we may use, in pipeline order (a group's leader)
        self.layout = groups.Layout([])  # the stages' tensor-parallel groups: each leader's other ranks
        self.security = Security()
        self.weights: Optional[WeightSource] = None  # for remote nodes that lack the model
        self.draft = None  # draft_model.DraftModel (--draft-model), handed to the engine
        self.embedder = None  # embedding_model.EmbeddingModel (--embedding-model), which the API reaches
        self.extras: List = []  # head_model.HeadModel (--also): more models the head serves itself
        self.vision = None  # vision.VisionRunner: a vision model's processor and tower, for the API
        self._quantized: Dict[str, QuantizedSource] = {}  # by spec, for remote nodes that lack the model
        self.joined: Dict[str, object] = {}  # address -> join.Joined
        self.join_server = None
        self.discovery: Optional[Discovery] = None  # --discover: this cluster's nodes on the LAN
        self._node_added = asyncio.Event()

    # -- what the rest of the head reads --------------------------------------------

    @property
    def pipeline(self) -> Pipeline:
        """The running pipeline (the engine's: it replaces it after a rebuild)."""
        return self.engine.pipeline

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def model_path(self) -> Path:
        return self.model.path

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def quant(self):
        """How stages quantize the model as they load it (None: as stored)."""
        return self.model.quant if self.model is not None else None

    @property
    def vision_note(self) -> str:
        """Why a model with a vision tower takes no images here (empty: it does, or has none)."""
        return self.model.tower_note if self.model is not None and self.vision is None else ""

    @property
    def plan_note(self) -> str:
        return self.placer.note if self.placer is not None else ""

    def model_facts(self) -> dict:
        """What the model is, as APIs that list models describe it (Ollama's ``/api/tags``)."""
        load = self.pipeline.stages[0].load
        bits = (self.model.config.get("quantization") or {}).get("bits")
        if bits is None and self.quant is not None:
            bits = self.quant.bits
        return {"model_type": self.model.config.get("model_type") or "", "num_layers": self.model.num_layers,
                "model_bytes": self.model.weight_bytes, "fingerprint": load.fingerprint if load else "",
                "bits": bits, "context_length": self.engine.max_context, "vision": self.vision is not None}

    def head_models(self) -> List[Tuple[str, int]]:
        """What the head runs itself beside the pipeline, and the bytes each may hold: (what, bytes)."""
        out = [(f"draft model {self.draft.path.name}", self.draft.weight_bytes())] if self.draft is not None else []
        if self.embedder is not None:
            out.append((f"embedding model {self.embedder.facts.name}", self.embedder.facts.weight_bytes))
        return out + [(f"--also {m.name} ({m.max_batch} x {m.context} tokens of KV cache)", m.memory())
                      for m in self.extras]

    def joined_nodes(self) -> List[dict]:
        """The nodes that joined, and whether each is in the pipeline now (``/nodes``)."""
        return joined_table(self.joined, {st.address for st in self.pipeline.stages})

    def report(self) -> dict:
        """What ``/health``, ``/metrics`` and ``/nodes`` say of the cluster beyond its stages:
        every link's latency and throughput and the warnings about them."""
        out: dict = {}
        if self.engine is not None:
            table = self.pipeline.links
            out["links"] = [link.to_dict() for link in table.links()]
            out["link_warnings"] = table.warnings()
            meter = self.engine.framer.meter
            stages = self.pipeline.stages
            try:
                out["workload"] = mix.report(self.placer, [(st.start, st.end) for st in stages],
                                             [st.address for st in stages], meter.mix(), meter.enough,
                                             self.config.prompt_ratio)
            except ValueError as err:  # a cost the planner cannot read: say so, /health stays up
                out["workload"] = {"measured": meter.mix(), "lines": [f"measured workload: no split from it ({err})"]}
        if self.discovery is not None:
            out["discovered"] = self.discovery.table()
            out["discovery"] = {"drop_after_s": DROP_AFTER_S, "usable": self.discovery.usable()}
        return out

    def describe(self) -> List[str]:
        quant = self.quant
        lines = [f"model {self.model_path}" + (f", quantized on load: {quant.describe()}" if quant else "")]
        for i, st in enumerate(self.pipeline.stages):
            mb = st.load.weight_bytes / 1e6 if st.load else 0
            group = ""
            if st.ranks and st.load is not None:  # a tensor-parallel group: the leader's share, and its sums
                group = (f" per rank, a group of {1 + len(st.ranks)} ranks; all-reduces "
                         f"{st.load.allreduce_seconds * st.load.allreduces_per_token * 1e3:.2f} ms a token")
            lines.append(f"stage {i}: {'+'.join([st.address, *st.ranks])} layers [{st.start}, {st.end}) {mb:.1f} MB"
                         + group)
        if self.plan_note:
            lines.append(self.plan_note)
        if self.placer is not None:
            lines += self.placer.prediction
        kv, mtp = self.kv_line(), self.mtp_line()
        lines += head_memory_lines(self.head_models())
        lines.append(self.context_note())
        if self.vision is not None:  # a vision model's tower, on this head
            lines.append(self.vision.cost.line())
        return lines + ([kv] if kv else []) + ([mtp] if mtp else [])

    def mtp_line(self) -> str:
        """One line on the model's MTP head, where asked for (empty: not asked)."""
        last = self.pipeline.stages[-1].load
        if last is None or not uses_mtp(self.config):
            return ""
        if last.mtp_layers:
            return (f"MTP:       drafting with the model's own multi-token-prediction head on the last stage "
                    f"({last.mtp_bytes / 1e6:.1f} MB)")
        return f"MTP:       none ({last.mtp_note or 'the last stage loaded none'}): drafts from prompt lookup only" + \
            (" and the draft model" if self.draft is not None else "")

    def kv_line(self) -> str:
        """One line on the stages' KV quantization, where asked or applied (empty: neither)."""
        loads = [st.load for st in self.pipeline.stages if st.load is not None]
        on = [i for i, r in enumerate(loads) if r.HasField("kv_cache")]
        notes = [f"stage {i}: {r.kv_note}" for i, r in enumerate(loads) if r.kv_note]
        if not on and kv_quant(self.config) is None:
            return ""
        if not on:
            return f"KV cache at full precision ({'; '.join(notes) or 'no stage quantizes it'})"
        kv = loads[on[0]].kv_cache
        full = sum(r.kv_full_bytes_per_token for r in loads)
        now = sum(r.kv_bytes_per_token for r in loads)
        return (f"KV cache {kv.bits}-bit (group {kv.group_size}) from mlx-lm's switch point (start {kv.start}) on "
                f"stage{'s' if len(on) > 1 else ''} {', '.join(map(str, on))}: {full / 1e3:.1f} -> {now / 1e3:.1f} KB "
                f"a token" + (f" ({'; '.join(notes)})" if notes else ""))

    def context_note(self) -> str:
        """The served context, and what sets it (serve's banner)."""
        engine = self.engine
        kv = engine.kv_tokens
        return (f"context:   {engine.max_context} tokens per request, prompt and reply ({engine.context_limit()}); "
                f"the KV cache holds {kv} tokens in all requests at once")

    # -- starting ---------------------------------------------------------------------

    async def start(self) -> "Cluster":
        cfg = self.config
        self.model = open_model(cfg)  # refuses what cannot apply before starting anything
        # A draft model that cannot draft for this one is refused before anything starts.
        self.draft = await asyncio.to_thread(load_draft_model, cfg.draft_model, self.model.tokenizer)
        self.vision = await asyncio.to_thread(load_vision, self.model)  # None: the model takes no images
        try:
            self.embedder = await asyncio.to_thread(load_embedding_model, cfg.embedding_model)
            self.extras = await asyncio.to_thread(load_head_models, cfg.also, PLANNED_CONTEXT, cfg.also_batch,
                                                  (cfg.model, self.model.path.name))
            check_head_memory(self.head_models(), self.model.weight_bytes)
        except BaseException:
            for m in [self.draft, self.vision, self.embedder, *self.extras]:
                if m is not None:
                    m.close()
            raise
        pipeline = None
        try:
            await self._gather_stages()
            self.placer = Placer(cfg, self.model, local=self.local is not None)
            self.placer.measured = mix.load(fingerprint(self.model.path))  # the last run's workload, if any
            pipeline = await self._build(self.addresses)
            await self._start_engine(pipeline)
        except BaseException:
            if self.engine is None and pipeline is not None:
                await pipeline.close()
            if self.engine is None and self.draft is not None:
                self.draft.close()
            await self.stop()
            raise
        return self

    async def _gather_stages(self) -> None:
        """Local stage processes, or the --nodes workers (and, with --join-listen, the
        nodes that join), every one answering."""
        cfg = self.config
        if not (cfg.nodes or cfg.join_listen or cfg.discover):
            # Local stages: a random cluster secret of their own, so that other
            # users of this machine cannot drive them either. A stage of k ranks: k processes.
            self.security = Security(secret=secrets.token_urlsafe(32))
            widths = groups.widths_of(cfg.stages, cfg.tp)
            self.local = LocalStages(sum(widths), self.security.secret, self.model.path.parent,
                                     cpus=placement(sum(widths), cfg.pin), log_level=cfg.stage_log_level,
                                     launch_ahead=cfg.launch_ahead)
            self.layout = groups.layout_of(self.local.start(), widths)
            self.addresses = list(self.layout.leaders)
            return
        self.layout = groups.from_nodes(cfg.nodes)
        self.addresses = list(self.layout.leaders)
        self.security = cfg.security
        self.weights = WeightSource(self.model.path, fingerprint(self.model.path), self.model.num_layers,
                                    rate=cfg.weights_rate, mtp=uses_mtp(cfg))
        if cfg.join_listen:
            self.join_server = await start_join_server(self, cfg.join_listen, self.security)
            while len(self.addresses) < max(cfg.wait_nodes, 1):
                logger.warning("waiting for nodes to join at %s (%d of %d)", cfg.join_listen,
                               len(self.addresses), max(cfg.wait_nodes, 1))
                self._node_added.clear()
                await self._node_added.wait()
        if cfg.discover:
            await self._discover()
        await await_nodes(self._every(), self.security, cfg.rejoin_timeout_s)
        found = set(self.discovery.usable()) if self.discovery is not None else set()
        listed = await vet([a for a in self._every() if a not in found], self.security)
        # (a node found on the LAN proves the secret again before it is sent any)
        proved = await vet([a for a in self._every() if a in found], self.security, need_proof=True)
        refused = {a: why for a, why in {**listed, **proved}.items() if why}
        if refused:
            raise PipelineError("; ".join(refused.values()), list(refused))

    def _every(self) -> List[str]:
        """Every node the stages may use, a group's ranks beside its leader."""
        return [a for leader in self.addresses for a in self.layout.ranks(leader)]

    def _budget(self, pipeline: Pipeline) -> Tuple[int, int, int]:
        """The KV positions and prefix-cache blocks (in memory, on disk) a loaded pipeline's stages hold."""
        loads = [st.load for st in pipeline.stages]
        kv = kv_token_budget(loads)
        return kv, prefix_blocks(loads, kv, self.config.prefix_cache_bytes), disk_blocks(loads)

    async def _start_engine(self, pipeline: Pipeline) -> None:
        n = len(pipeline.stages)  # the planner may have left nodes out
        kv, blocks, disk = self._budget(pipeline)
        model_max = pipeline.stages[0].load.max_context
        self.engine = Engine(pipeline, scheduler_config(self.config, n, kv, blocks, self.placer.row_cost, disk),
                             eos_token_ids=sorted(self.model.tokenizer.eos_token_ids),
                             max_context=min(model_max, self.config.context or model_max),
                             rebuild=self.rebuild, supervision=self.config.supervision, observer=self.observer,
                             draft_model=self.draft, vocab_size=self.model.vocab_size,
                             speculation=self.config.speculation if self.config.speculate else "none")
        if self.config.context and self.config.context < model_max:
            self.engine.context_source = "--context"
        await self.engine.start()

    # -- building a pipeline -----------------------------------------------------------

    def _pipeline(self, addresses: List[str]) -> Pipeline:
        cap = 0  # remote nodes cap their KV caches at the memory they offer, less weights
        if self.local is not None:  # local stages and ranks share this machine's memory (and the head's own models)
            head = sum(b for _, b in self.head_models()) + (self.vision.planned_bytes if self.vision is not None else 0)
            cap = max(offered_memory() - self.model.weight_bytes - head, 0) // len(self.local.procs)
        # Local stages load the head's own folder; remote nodes resolve the name themselves.
        name = str(self.model.path) if self.local is not None else self.config.model
        # Links are timed between machines; local stages share this one's loopback.
        probe = (0, 0) if self.local is not None else probe_sizes(int(self.model.config["hidden_size"]), 4,
                                                                     self.config.chunk_size)
        limits = replace(stage_limits(self.config, cap), vision=self.model.vision)  # a vision model: mlx-vlm's
        return Pipeline(addresses, name, self.security, limits, tokenizer=self.model.tokenizer_spec, probe=probe,
                        followers=self.layout.followers)

    async def _build(self, addresses: List[str]) -> Pipeline:
        """Split the layers over ``addresses`` and load them: a pipeline ready to open."""
        split, layers = self.config.split, self.model.num_layers
        if self.config.tp == [0]:  # --tp auto: every node planned alone first, then grouped as the plan says
            self.layout = groups.Layout(list(addresses))
        pipeline = self._pipeline(addresses)
        try:
            if split in (None, "auto"):
                ranges, keep = await self.placer.plan(pipeline)
                if self.config.tp == [0] and self.placer.widths:
                    self.layout = groups.layout_of([addresses[i] for i in keep], self.placer.widths)
                if keep != list(range(len(addresses))) or self.layout.followers:  # nodes left out, or grouped
                    await pipeline.close()
                    pipeline = self._pipeline(self.layout.leaders if self.layout.followers
                                              else [addresses[i] for i in keep])
            elif split == "even" or len(split.split(",")) == len(addresses):
                ranges = fixed_ranges(layers, len(addresses), split, self.model.cuts)
            else:  # not the stages the fixed split names (one was lost, or joined): split evenly
                ranges = even_split(layers, len(addresses), self.model.cuts)
            pipeline.assign(ranges)
            pipeline.fingerprint = quantized_fingerprint(self.weights.fingerprint if self.weights else
                                                         fingerprint(self.model.path), self.model.quant)
            await pipeline.load(progress=sys.stderr.isatty(), weights=await self._weights(), quant=self.model.quant)
            for line in await self.placer.predict(pipeline):
                logger.info("%s", line)
        except BaseException:
            await pipeline.close()
            raise
        return pipeline

    async def _weights(self) -> Optional[WeightSource]:
        """What remote nodes that lack the model receive: the model folder, or its
        units quantized by the spec in effect (quantized on the head when first needed)."""
        quant = self.model.quant
        if self.weights is None or quant is None:
            return self.weights
        key = quant.key()
        if key not in self._quantized:  # (hashes the source, once: on a thread)
            self._quantized[key] = await asyncio.to_thread(QuantizedSource, self.weights, quant,
                                                           rate=self.config.weights_rate)
        return self._quantized[key]

    async def rebuild(self, why: str, suspects: Sequence[str]) -> Rebuilt:
        """A new loaded pipeline after a fault, over the stages that work (``rebuild.py``;
        nodes that discovery dropped are not waited for)."""
        cfg = self.config
        meter = self.engine.framer.meter if self.engine is not None else None
        if meter is not None and meter.enough:
            self.placer.measured = meter.mix()  # a re-plan balances for what the head measured
        gone = self.discovery.gone if self.discovery is not None else set
        followers = {} if cfg.tp == [0] else self.layout.followers  # (--tp auto: the plan groups them again)
        layout = groups.Layout([a for a in self.addresses if a not in gone()], followers)
        alive = await answering(layout, self.security, self.local, cfg.restart, cfg.rejoin_timeout_s, why, suspects,
                                gone=gone)
        pipeline = await build_leaving_out(alive, self._build, why, self.layout, wait=lambda restarting: await_up(
            dict.fromkeys(restarting, "restarting"), self.security, cfg.rejoin_timeout_s))
        return Rebuilt(pipeline, *self._budget(pipeline))

    # -- nodes found on the LAN, nodes that join, stopping --------------------------------

    async def _discover(self) -> None:
        """Find this cluster's nodes on the LAN (``discovery.py``): wait for ``--wait-nodes``
        of them (listed ones count), then for no more to come."""
        if not self.security.secret:
            raise ValueError("--discover needs the cluster secret (--secret-file or $MLXPIPE_SECRET): nodes are "
                             "found, and proved, by it")
        listening = list(self.listening)
        if self.config.join_listen:
            host, _, port = self.config.join_listen.rpartition(":")
            listening.append((host.strip("[]"), int(port) if port.isdigit() else 0))
        self.discovery = await Discovery(self.security, self._found, self._lost, listening=listening).start()
        want = max(self.config.wait_nodes, 1) - len(self.addresses)
        for address in await self.discovery.wait(max(want, 0)):
            if address not in self.addresses:
                self.addresses.append(address)

    async def _found(self, found) -> None:
        """A node of this cluster appeared on the LAN: plan over it too (as a node that joins)."""
        if self.engine is None or found.address in self.addresses:
            return  # (still starting: the first plan takes every node found by then)
        self.addresses.append(found.address)
        await self.engine.request_replan(f"node {found.address} found on the local network", timeout=REPLAN_WAIT_S)

    async def _lost(self, found) -> None:
        """A node stopped answering (or said goodbye): the next plan leaves it out. (If it
        held layers, its broken stream has the engine rebuild without it already.)"""
        if found.address in self.addresses:
            self.addresses.remove(found.address)


    async def add_node(self, joined) -> Tuple[bool, str]:
        """A node joined: plan over it too. Returns whether it is in the pipeline now."""
        if self.local is not None:
            return False, "this head runs local stages; start it with --nodes or --join-listen to accept nodes"
        why = (await vet([joined.address], self.security))[joined.address]
        if why:
            logger.warning("refused node %s: %s", joined.address, why)
            return False, why
        self.joined[joined.address] = joined
        if joined.address not in self.addresses:
            self.addresses.append(joined.address)
        self._node_added.set()
        if self.engine is None:  # still starting: the first plan will include it
            return True, "joined; the cluster is starting"
        await self.engine.request_replan(f"node {joined.address} joined", timeout=REPLAN_WAIT_S)
        in_plan = joined.address in [st.address for st in self.pipeline.stages]
        return in_plan, self.plan_note

    async def stop(self) -> None:
        if self.engine is not None and self.engine.framer.meter.enough:  # for the next start's plan
            mix.save(fingerprint(self.model.path), self.engine.framer.meter.mix())
        if self.discovery is not None:
            await self.discovery.stop()
        if self.join_server is not None:
            await self.join_server.stop(grace=None)
        if self.engine is not None:
            await self.engine.stop()
        if self.local is not None:
            self.local.stop()
        for source in self._quantized.values():
            source.close()
        for m in [self.vision, self.embedder, *self.extras]:
            if m is not None:
                m.close()

    async def __aenter__(self) -> "Cluster":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()
