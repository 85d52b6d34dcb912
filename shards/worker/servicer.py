"""The stage's gRPC servicer: the data path in front of one ``Shard``.

Threads: asyncio runs the gRPC server; one worker thread owns MLX and does all
array work (loading, every frame, frees), in the order it is given it.

Each ``Forward`` stream is a ``forward.ForwardStream``: every frame is handed to
the MLX thread as it is read and its output handed back once, to go to the next
stage's ``Forward`` stream or, on the last stage, the head's ``Results`` stream.
Activations go straight from a stage to the next, never through the head.
``node.py`` runs it as ``mlxpipe node``.
The prefix cache's disk tier outlives a shard (``disk_service.py``).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import platform
import time
from pathlib import Path
from typing import Optional

import grpc
import mlx.core as mx

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto import pipeline_pb2_grpc as pb_grpc
from mlxpipe.proto.rpc import Security, culprits_metadata, culprits_of, refuse_malformed
from mlxpipe.shards.cache.kinds import kv_switch
from mlxpipe.shards.cache.quantized import KvSwitch
from mlxpipe.shards.models.grammar import tokenizer_from_json
from mlxpipe.shards.models.layers import with_sizes
from mlxpipe.shards.models.metal import Metal
from mlxpipe.shards.models.profile import memory_bandwidth, node_name, offered_memory, profile
from mlxpipe.shards.models.digest import read_weights
from mlxpipe.shards.models.slicing import SlicedModel, load_stage, warm_up
from mlxpipe.shards.models.store import (BrokenModel, ModelNotFound, fingerprint, resolve_model,
                                  text_config)
from mlxpipe.shards.models.store import models_dir as default_models_dir
from mlxpipe.shards.net import hello, links
from mlxpipe.shards.params import wire
from mlxpipe.shards.params.kv import KvQuant
from mlxpipe.shards.params.quant import quantized_fingerprint
from mlxpipe.shards.worker import disk_service, memory
from mlxpipe.shards.worker.forward import QUEUE_FRAMES, ForwardStream, QueueDepth, StageFault
from mlxpipe.shards.worker.mlx_thread import MlxThread
from mlxpipe.shards.worker.mtp_drafts import load_drafting
from mlxpipe.shards.worker.stage import FrameError, ShardLimits, Shard
from mlxpipe.shards.worker.weight_service import WeightService

logger = logging.getLogger(__name__)

NEXT_HOP_TIMEOUT_S = 5.0  # how long Load waits to reach the next stage


def _model_status(err: ValueError) -> grpc.StatusCode:
    """The status for a model a node cannot profile or load, by why."""
    for kind, code in ((ModelNotFound, grpc.StatusCode.NOT_FOUND),
                       (BrokenModel, grpc.StatusCode.FAILED_PRECONDITION),
                       (memory.MemoryShort, grpc.StatusCode.RESOURCE_EXHAUSTED)):
        if isinstance(err, kind):
            return code
    return grpc.StatusCode.INVALID_ARGUMENT  # a range outside the model, a missing or misshapen tensor


class _Loaded:
    """A loaded shard plus what Load replied, and the head's offer of its weights (if any)."""

    def __init__(self, shard: Shard, reply: pb.LoadReply, request: pb.LoadRequest, offer=None):
        self.shard = shard
        self.reply = reply
        self.request = request
        self.offer = offer  # weight_service.Offer: the same request over other weights is another shard


class StageServicer(pb_grpc.StageServicer):
    """The Stage service of pipeline.proto on this node; Have and Receive go to ``WeightService``."""

    def __init__(self, security: Optional[Security] = None, memory_bytes: Optional[int] = None,
                 models_dir: Optional[Path] = None, progress: bool = False, launch_ahead: Optional[bool] = None,
                 kv: Optional[KvQuant] = None, disk_bytes: Optional[int] = None):
        self.security = security or Security()
        self.kv = kv  # the node's own --kv-bits: for a head that asks for no KV quantization
        self.progress = progress          # progress bars while loading (a node in a terminal)
        self.memory_bytes = memory_bytes  # offered to the planner; default: a share of physical memory
        self.models_dir = models_dir      # where model paths from a head must lie
        self.mlx = MlxThread(ahead=launch_ahead)  # all MLX work, in order; frames launched ahead (mlx_thread.py)
        self.loaded: Optional[_Loaded] = None
        self.state, self.detail = "empty", "no shard loaded yet"
        self.next_channel: Optional[grpc.aio.Channel] = None
        self.next_stub: Optional[pb_grpc.StageStub] = None
        self.results: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_FRAMES)
        self._results_reader: Optional[asyncio.Task] = None
        self.depth = QueueDepth()  # frames read by Forward streams, not yet started on the MLX thread
        self._load_lock = asyncio.Lock()
        self._sessions = itertools.count(1)
        self._streams: set = set()  # Forward handlers running now
        self.weights = WeightService(self._resolve, self.mlx, progress)
        self.metal = Metal()  # wired memory and working-set warnings on Apple silicon; a no-op elsewhere
        self.disk = disk_service.DiskService(disk_bytes)  # the prefix cache's disk tier, across Loads
        self.name = platform.node()  # what Hello and the announcement call this node
        self.listening = (0, "")     # our port and the address we advertise (node.py sets them once bound)
        self.next_link: Optional[links.Keeper] = None  # the hop to the next stage, kept current
        self.in_link = links.LiveLink()                # the hop into this stage, from live frames

    async def _mlx(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.mlx, fn, *args)

    def _resolve(self, model: str) -> Path:
        return resolve_model(model, within=self.models_dir or default_models_dir())

    async def Ping(self, request, context):
        return pb.PingReply()

    async def Hello(self, request, context):
        """Who this node is, and (for an address of ours) proof that it holds the secret (``hello.py``)."""
        port, advertise = self.listening
        mine = hello.own_addresses(port, [advertise] if advertise else [])
        return hello.reply(self.security.secret, offered_memory(self.memory_bytes), self.name,
                           context.invocation_metadata(), mine)

    async def Echo(self, request: pb.EchoRequest, context):
        await refuse_malformed(request, context)
        return pb.EchoReply(payload=bytes(min(request.reply_bytes, 1 << 20)))

    # -- Profile ---------------------------------------------------------------

    def _profile_sync(self, request: pb.ProfileRequest) -> pb.ProfileReply:
        reply = pb.ProfileReply(memory_bytes=offered_memory(self.memory_bytes),
                                node=node_name(), bandwidth_bytes_per_s=memory_bandwidth())
        try:
            path = self._resolve(request.model)
        except ModelNotFound:
            return reply  # no model here (yet): memory and bandwidth are all we can offer
        quant = wire.quant_from_wire(request.quantization)
        result = profile(path, quantized_fingerprint(fingerprint(path), quant), batch=request.batch or 8,
                         quant=quant)
        reply.layer_seconds.extend(result["layer_seconds"])
        reply.embed_seconds, reply.head_seconds = result["embed_seconds"], result["head_seconds"]
        reply.cached = result["cached"]
        reply.row_cost = result["row_cost"]
        reply.prefill_layer_seconds.extend(result["prefill_layer_seconds"])
        reply.prefill_embed_seconds, reply.prefill_tokens = result["prefill_embed_seconds"], result["prefill_tokens"]
        return reply

    async def Profile(self, request: pb.ProfileRequest, context):
        await refuse_malformed(request, context)
        try:
            return await self._mlx(self._profile_sync, request)
        except ValueError as err:
            await context.abort(_model_status(err), str(err))

    # -- weights from the head (weight_service.py) ---------------------------

    async def Have(self, request: pb.WeightsOffer, context):
        return await self.weights.Have(request, context)

    async def Receive(self, request_iterator, context):
        return await self.weights.Receive(request_iterator, context)

    # -- Load ------------------------------------------------------------------

    def _load_sync(self, request: pb.LoadRequest) -> _Loaded:
        path, partial = self.weights.model_path(request)
        # Weights received from the head come quantized already; a full-precision
        # folder of our own is quantized here, one module at a time.
        quant = None if partial else wire.quant_from_wire(request.quantization)
        gc.collect()  # let a replaced shard's arrays go before measuring
        mx.clear_cache()
        offered = offered_memory(self.memory_bytes)
        memory.check_load(path, request, quant, offered)  # MemoryShort: RESOURCE_EXHAUSTED, nothing read
        resident, before = memory.resident_bytes(), mx.get_active_memory()
        mx.reset_peak_memory()
        stage, config = load_stage(path, request.start, request.end, not partial, quant, request.vision)
        if self.mlx.ahead:  # build each block while MLX runs the last (slicing.py)
            stage.launch_blocks()
        hashing = read_weights(stage, progress=self.progress)  # (on threads, while it warms up)
        drafting, mtp = load_drafting(request.mtp, stage, path, config, quant)  # the model's MTP head (last stage)
        mlx_peak_bytes = max(mx.get_peak_memory() - before, 0)
        text = with_sizes(text_config(config))
        hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
        max_context = int(text.get("max_position_embeddings") or 1 << 20)
        footprint = warm_up(stage, hidden)
        switch, kv_reply = self._kv_switch(request, stage, hidden, footprint.kv_bytes_per_token)
        weight_bytes = max(mx.get_active_memory() - before, 0)
        peak_bytes = memory.load_peak_bytes(resident, mx.get_peak_memory() - before)
        model_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        limits = ShardLimits(
            max_batch=request.max_batch or ShardLimits.max_batch,
            max_chunk_tokens=request.max_chunk_tokens or ShardLimits.max_chunk_tokens,
            max_context=max_context,
            max_cache_bytes=request.max_cache_bytes or max(offered - weight_bytes, 0),
            block_tokens=request.block_tokens,
        )
        spec = request.tokenizer if request.HasField("tokenizer") and stage.last else None
        tokenizer = tokenizer_from_json(spec.json, vocab, spec.eos_token_ids) if spec is not None else None
        digest = hashing.result(config)
        shard = Shard(stage, hidden, vocab, limits, tokenizer, switch,
                      self.disk.for_load(request, digest, switch.kv if switch.slots else None), drafting)
        reply = pb.LoadReply(
            model_path=str(path),
            model_type=config.get("model_type", ""),
            num_layers=stage.num_layers,
            hidden_size=hidden,
            vocab_size=vocab,
            weight_bytes=weight_bytes,
            model_bytes=model_bytes,
            max_context=max_context,
            fingerprint=request.fingerprint or quantized_fingerprint(fingerprint(path), quant),
            unit_digests=digest.units, weights_digest=digest.stage,  # what it computes with (models/digest.py)
            max_cache_bytes=limits.max_cache_bytes,
            block_tokens=shard.prefix.block_tokens if shard.prefix is not None else 0,
            peak_bytes=peak_bytes,
            mlx_peak_bytes=mlx_peak_bytes,
            memory_warning=self.metal.settle(weight_bytes, limits.max_cache_bytes,
                                             f"layers [{request.start}, {request.end})"),
            max_rewind=limits.max_rewind if shard.stateful else limits.max_context,
            state_bytes=footprint.state_bytes, vision=request.vision,
            **mtp.reply(kv_reply),
        )
        return _Loaded(shard, reply, request, self.weights.offer(request))

    def close(self) -> None:
        """The node stops: finish the disk tier's writes (a while, at most)."""
        self.disk.close()

    def _kv_switch(self, request: pb.LoadRequest, stage: SlicedModel, hidden: int,
                   full_bytes: int) -> tuple[KvSwitch, dict]:
        """The KV quantization this stage applies (the head's, else the node's own): the
        switch, and what the Load reply says of it: a token's KV bytes as the head is to
        plan them, before and after the switch, and why fewer caches turn quantized than
        asked (``kv_note``: one line, logged here too)."""
        asked = wire.kv_from_wire(request.kv_cache) if request.HasField("kv_cache") else None
        kv = asked or self.kv
        if kv is None:
            return KvSwitch(), {"kv_bytes_per_token": full_bytes, "kv_full_bytes_per_token": full_bytes}
        switch, quantized_bytes, note = kv_switch(stage, hidden, kv)
        if note:
            logger.warning("layers [%d, %d): %s: %s", request.start, request.end, kv, note)
        # The node's own --kv-bits saves memory the head does not plan on: a token counts at full precision.
        return switch, {"kv_bytes_per_token": quantized_bytes if asked else full_bytes,
                        "kv_full_bytes_per_token": full_bytes, "kv_note": note,
                        "kv_cache": wire.kv_to_wire(switch.kv) if switch.slots else None}

    @staticmethod
    def _reply(loaded: _Loaded) -> pb.LoadReply:
        """What Load answers: the shard, and the prefix blocks it holds now (in memory and on disk)."""
        reply = pb.LoadReply()
        reply.CopyFrom(loaded.reply)
        prefix = loaded.shard.prefix
        if prefix is not None:
            reply.blocks.extend(prefix.blocks)
            reply.starts.extend(loaded.shard.starts())
        disk_service.report_load(reply, prefix)
        return reply

    async def Load(self, request: pb.LoadRequest, context):
        await refuse_malformed(request, context)
        async with self._load_lock:
            if request.end <= request.start:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"layer range [{request.start}, {request.end}) is empty",
                )
            # A new head session starts here: streams of the old one must not
            # run another frame (one could replay a stale prefill over a new
            # sequence of the same id), and their results are stale.
            await self._end_streams()
            if self.loaded is not None and self.loaded.request == request and \
                    self.loaded.offer == self.weights.offer(request):
                # The same shard again (a rebuilt pipeline): live sequences go, the
                # prefix cache stays (the head learns what it holds from the reply).
                await self._mlx(self.loaded.shard.free_all)
                return self._reply(self.loaded)
            self.loaded = None
            self.state, self.detail = "loading", f"loading {request.model} [{request.start}, {request.end})"
            try:
                loaded = await self._mlx(self._load_sync, request)
            except ValueError as err:  # no such model, a broken folder, a range outside the model
                self.state, self.detail = "empty", str(err)
                await context.abort(_model_status(err), str(err))
            except Exception as err:  # noqa: BLE001 - a broken model folder, reported to the caller
                logger.exception("loading failed")
                self.state, self.detail = "failed", f"{type(err).__name__}: {err}"
                await context.abort(grpc.StatusCode.INTERNAL, f"loading failed: {self.detail}")
            if self.next_link is not None:
                self.next_link.stop()
                self.next_link = None
            if self.next_channel is not None:
                await self.next_channel.close()
                self.next_channel = self.next_stub = None
            self.in_link = links.LiveLink()
            if request.next_address:
                self.next_channel = self.security.channel(request.next_address)
                self.next_stub = pb_grpc.StageStub(self.next_channel)
                try:  # a stage that cannot reach its successor is no use in this pipeline
                    await self.next_stub.Health(pb.HealthRequest(), timeout=NEXT_HOP_TIMEOUT_S,
                                                metadata=self.security.metadata())
                except grpc.aio.AioRpcError as err:
                    self.state, self.detail = "failed", f"next stage {request.next_address} unreachable"
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"next stage {request.next_address} is unreachable from this stage: "
                        f"{err.code().name}: {err.details()}",
                    )
            self.loaded = loaded
            self.state, self.detail = "ready", ""
            logger.info(
                "loaded %s layers [%d, %d) of %d: %.1f MB",
                loaded.reply.model_path, request.start, request.end,
                loaded.reply.num_layers, loaded.reply.weight_bytes / 1e6,
            )
            return self._reply(loaded)

    async def TimeNextHop(self, request: pb.LinkProbe, context):
        """Time the hop to the next stage (``links.py``), then keep its latency current. The head
        asks each stage in turn, so that no two probes share a link."""
        await refuse_malformed(request, context)
        loaded, stub = self.loaded, self.next_stub
        if not 0 < request.small <= links.MAX_PROBE or request.large > links.MAX_PROBE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"probe sizes must be within {links.MAX_PROBE}")
        if request.address:  # another node (with the secret, as to a next stage): timed once
            async with self.security.channel(request.address) as channel:
                return await self._time_hop(context, pb_grpc.StageStub(channel), request, request.address)
        if loaded is None or stub is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no next stage to time (load one first)")
        first = await self._time_hop(context, stub, request, loaded.request.next_address)
        if self.next_link is not None:
            self.next_link.stop()
        self.next_link = links.Keeper(stub, self.security.metadata(), first)
        return first

    async def _time_hop(self, context, stub, request: pb.LinkProbe, to: str) -> pb.LinkFigures:
        try:
            return await links.measure(stub, self.security.metadata(), request.small, request.large, to,
                                       large_repeats=links.LARGE_REPEATS if request.large else 0)
        except grpc.aio.AioRpcError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot time the hop to {to}: {err.code().name}: "
                                f"{err.details()}")

    async def _end_streams(self) -> None:
        for task in list(self._streams):
            task.cancel()
        await asyncio.gather(*self._streams, return_exceptions=True)
        while not self.results.empty():
            self.results.get_nowait()

    # -- Forward -------------------------------------------------------------

    async def Forward(self, request_iterator, context):
        loaded = self.loaded
        if loaded is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no shard loaded ({self.detail})")
        stream = ForwardStream(self, loaded, request_iterator, next(self._sessions))
        me = asyncio.current_task()
        self._streams.add(me)
        try:
            await stream.run()
        except FrameError as err:  # the frame's own fault: refused, nothing changed
            await context.abort(getattr(grpc.StatusCode, err.code), str(err))
        except StageFault as err:  # this stage could not run a frame: the pipeline's fault
            await context.abort(grpc.StatusCode.INTERNAL, str(err), trailing_metadata=err.metadata())
        except grpc.aio.AioRpcError as err:  # the next stage's stream ended: so does this one, at once
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"next stage {loaded.request.next_address} failed: {err.code().name}: {err.details()}",
                trailing_metadata=culprits_metadata(culprits_of(err)),
            )
        except asyncio.CancelledError:  # the node stopping, or its streams ended for a new shard: the call just
            pass                         # ends (raised on, grpc logs an "Exception not handled" traceback)
        finally:
            try:
                await stream.close()
            except asyncio.CancelledError:  # cancelled again while closing: its sequences are freed all the same
                pass
            self._streams.discard(me)
        return pb.ForwardSummary(frames=stream.count)

    async def Results(self, request, context):
        if self.loaded is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no shard loaded ({self.detail})")
        if self.loaded.request.next_address:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "only the last stage has results")
        # One head at a time: a new subscriber replaces the old one.
        if self._results_reader is not None:
            self._results_reader.cancel()
        self._results_reader = asyncio.current_task()
        try:
            while True:
                yield await self.results.get()
        except asyncio.CancelledError:  # replaced, or the node stopping: the call just ends
            return

    # -- Fetch, Free, Health ---------------------------------------------------

    async def Fetch(self, request: pb.FetchRequest, context):
        await refuse_malformed(request, context)
        loaded = self.loaded
        if loaded is None or loaded.shard.prefix is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no shard with a prefix cache is loaded")
        return await disk_service.fetch(loaded.shard.prefix, request)

    async def Free(self, request: pb.FreeRequest, context):
        await refuse_malformed(request, context)
        loaded = self.loaded
        if loaded is None:
            return pb.FreeReply(freed=0)
        if request.seq_ids:
            freed = await self._mlx(loaded.shard.free_and_publish, list(request.seq_ids))
        else:
            freed = await self._mlx(loaded.shard.free_all)
        return pb.FreeReply(freed=freed)

    async def Health(self, request, context):
        reply = pb.HealthReply(
            state=self.state,
            detail=self.detail,
            active_bytes=mx.get_active_memory(),
            rss_bytes=memory.resident_bytes(),
        )
        loaded = self.loaded
        if loaded is not None:
            view, clock = loaded.shard.view, loaded.shard.view.clock  # published by the MLX thread
            reply.model = loaded.reply.model_path
            reply.start, reply.end = loaded.request.start, loaded.request.end
            reply.num_layers = loaded.reply.num_layers
            reply.weight_bytes = loaded.reply.weight_bytes
            reply.next_address = loaded.request.next_address
            reply.live_seqs.extend(view.live_seqs)
            reply.cache_bytes = view.cache_bytes
            reply.prefix_bytes = view.prefix_bytes
            reply.prefix_blocks = view.prefix_blocks
            if self.next_link is not None:
                reply.next_link.CopyFrom(self.next_link.link)
            reply.in_link.CopyFrom(self.in_link.figures())
            busy_fraction, tokens_per_s = clock.window()
            reply.stats.CopyFrom(
                pb.StageStats(
                    busy_seconds=clock.busy_now(), busy_fraction=busy_fraction, tokens_per_s=tokens_per_s,
                    uptime_seconds=time.monotonic() - clock.started, frames=clock.frames, tokens=clock.tokens,
                    queue_depth=int(self.depth), reused_tokens=clock.reused_tokens,
                    prefilled_tokens=clock.prefilled_tokens,
                )
            )
            disk_service.report_health(reply, loaded.shard.prefix)
        return reply
