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
import itertools
import logging
import os
import platform
import threading
import time
from pathlib import Path
from typing import Optional

import grpc
import mlx.core as mx

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto import pipeline_pb2_grpc as pb_grpc
from mlxpipe.proto.errors import GROUP_BROKEN
from mlxpipe.proto.rpc import Security, culprits_metadata, culprits_of, refuse_malformed
from mlxpipe.shards.models.metal import Metal
from mlxpipe.shards.models.profile import memory_bandwidth, node_name, offered_memory, profile
from mlxpipe.shards.models.store import BrokenModel, ModelNotFound, fingerprint, resolve_model
from mlxpipe.shards.models.store import models_dir as default_models_dir
from mlxpipe.shards.net import hello, links
from mlxpipe.shards.params import wire
from mlxpipe.shards.params.kv import KvQuant
from mlxpipe.shards.params.quant import quantized_fingerprint
from mlxpipe.shards.worker import disk_service, memory
from mlxpipe.shards.worker import group as groups
from mlxpipe.shards.worker.forward import QUEUE_FRAMES, ForwardStream, QueueDepth, StageFault
from mlxpipe.shards.worker.loading import Loaded, load
from mlxpipe.shards.worker.mlx_thread import MlxThread
from mlxpipe.shards.worker.stage import FrameError
from mlxpipe.shards.worker.weight_service import WeightService

logger = logging.getLogger(__name__)

NEXT_HOP_TIMEOUT_S = 5.0  # how long Load waits to reach the next stage
BEAT_S = 1.0  # a group's leader hands its other ranks a beat this often while idle: a rank gone is found
GROUP_RESTART_S = 0.5  # a node whose group broke restarts this long after (its last replies go out first)


def _model_status(err: ValueError) -> grpc.StatusCode:
    """The status for a model a node cannot profile or load, by why."""
    for kind, code in ((ModelNotFound, grpc.StatusCode.NOT_FOUND),
                       (BrokenModel, grpc.StatusCode.FAILED_PRECONDITION),
                       (memory.MemoryShort, grpc.StatusCode.RESOURCE_EXHAUSTED)):
        if isinstance(err, kind):
            return code
    return grpc.StatusCode.INVALID_ARGUMENT  # a range outside the model, a missing or misshapen tensor


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
        self.loaded: Optional[Loaded] = None
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
        self.weights.following = self._following
        self.metal = Metal()  # wired memory and working-set warnings on Apple silicon; a no-op elsewhere
        self.disk = disk_service.DiskService(disk_bytes)  # the prefix cache's disk tier, across Loads
        self.name = platform.node()  # what Hello and the announcement call this node
        self.listening = (0, "")     # our port and the address we advertise (node.py sets them once bound)
        self.next_link: Optional[links.Keeper] = None  # the hop to the next stage, kept current
        self.in_link = links.LiveLink()                # the hop into this stage, from live frames
        self.restart = lambda: os._exit(75)  # a node whose tensor group broke starts afresh (node.py: in place)
        self.group_port = 0  # where its rank of a tensor group listens (node.py picks it)
        self._beat: Optional[asyncio.Task] = None  # a group leader's heartbeat to its other ranks

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
                           context.invocation_metadata(), mine, self.group_port)

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

    def close(self) -> None:
        """The node stops: finish the disk tier's writes (a while, at most)."""
        self.disk.close()

    @staticmethod
    def _reply(loaded: Loaded) -> pb.LoadReply:
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
                if not self._following():  # (a group's other ranks: their leader frees for them)
                    await self._mlx(self.loaded.shard.free_all)
                return self._reply(self.loaded)
            await self._leave_group()
            self.loaded = None
            self.state, self.detail = "loading", f"loading {request.model} [{request.start}, {request.end})"
            try:
                loaded = await self._mlx(load, self, request)
            except ValueError as err:  # no such model, a broken folder, a range outside the model, a layer not split
                self.state, self.detail = "empty", str(err)
                await context.abort(_model_status(err), str(err))
            except groups.GroupError as err:  # the group could not form, or broke: this node starts afresh
                self.group_broken(str(err))
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{err}; this node restarts")
            except Exception as err:  # noqa: BLE001 - a broken model folder, reported to the caller
                logger.exception("loading failed")
                self.state, self.detail = "failed", f"{type(err).__name__}: {err}"
                await context.abort(grpc.StatusCode.INTERNAL, f"loading failed: {self.detail}")
            await self._connect_next(request, context)
            self.loaded = loaded
            self.state, self.detail = "ready", ""
            self._join_group(loaded)
            logger.info(
                "loaded %s layers [%d, %d) of %d: %.1f MB",
                loaded.reply.model_path, request.start, request.end,
                loaded.reply.num_layers, loaded.reply.weight_bytes / 1e6,
            )
            return self._reply(loaded)

    async def _connect_next(self, request: pb.LoadRequest, context) -> None:
        """The channel to the next stage (none on the last), checked: a stage that cannot reach
        its successor is no use in this pipeline."""
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

    # -- a tensor-parallel group (group.py) ----------------------------------------

    def _following(self) -> bool:
        """Whether this node is a rank of a group other than its leader."""
        return self.loaded is not None and self.loaded.spec is not None and not self.loaded.spec.leader

    def _join_group(self, loaded: Loaded) -> None:
        """Loaded as a group's rank: the leader beats, the others follow it on the MLX thread."""
        if loaded.spec is None:
            return
        loop = asyncio.get_running_loop()
        if loaded.spec.leader:  # (a hand-off that fails, on any path: the node restarts)
            loaded.shard.mirror.broken = lambda why: loop.call_soon_threadsafe(self.group_broken, why)
            self._beat = asyncio.ensure_future(self._heartbeat(loaded))
            return

        def ended(future) -> None:  # (MLX thread) the leader said stop, or the group broke
            if future.exception() is not None:
                loop.call_soon_threadsafe(self.group_broken, str(future.exception()))

        self.mlx.submit(groups.follow, loaded.group, loaded.shard, threading.Event()).add_done_callback(ended)

    async def _leave_group(self) -> None:
        """Before another Load: a leader stops its beat and tells its other ranks to stop following."""
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None
        loaded = self.loaded
        if loaded is not None and loaded.spec is not None and loaded.spec.leader:
            try:
                await self._mlx(loaded.shard.mirror.stop)
            except groups.GroupError as err:
                self.group_broken(str(err))

    async def _heartbeat(self, loaded: Loaded) -> None:
        while True:
            await asyncio.sleep(BEAT_S)
            try:
                await self._mlx(loaded.shard.mirror.beat)
            except groups.GroupError as err:
                self.group_broken(str(err))
                return

    def group_broken(self, why: str) -> None:
        """The group this node is a rank of broke (a rank gone, a frame failed mid-forward): out of
        step for good, the node starts afresh (``restart``), shortly, so that its last replies go out."""
        if self.state == "failed" and self.detail.startswith(GROUP_BROKEN):
            return
        logger.error("tensor group broken: %s; this node restarts", why)
        self.state, self.detail = "failed", f"{GROUP_BROKEN}: {why}"
        asyncio.get_running_loop().call_later(GROUP_RESTART_S, self.restart)

    async def _refuse_follower(self, context) -> None:
        if self._following():
            spec = self.loaded.spec
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this node is rank {spec.rank} of a tensor "
                                f"group; its leader at {spec.peers[0]} takes the stage's work")

    # -- Forward -------------------------------------------------------------

    async def Forward(self, request_iterator, context):
        await self._refuse_follower(context)
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
        await self._refuse_follower(context)
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
        await self._refuse_follower(context)
        loaded = self.loaded
        if loaded is None or loaded.shard.prefix is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no shard with a prefix cache is loaded")
        if loaded.spec is not None:  # every rank reads its own disk, in the leader's order (on the MLX thread)
            try:
                got, dropped = await self._mlx(loaded.shard.mirror.fetch, loaded.shard.prefix, request)
            except groups.GroupError as err:
                self.group_broken(str(err))
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
            return pb.FetchReply(loaded=got, dropped=dropped)
        return await disk_service.fetch(loaded.shard.prefix, request)

    async def Free(self, request: pb.FreeRequest, context):
        await refuse_malformed(request, context)
        await self._refuse_follower(context)
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
            if loaded.spec is not None:
                reply.group_rank, reply.group_size = loaded.spec.rank, loaded.spec.size
                reply.allreduce_seconds = loaded.reply.allreduce_seconds
                reply.allreduces_per_token = loaded.reply.allreduces_per_token
                mirror = loaded.shard.mirror
                if mirror is not None:
                    reply.stats.mirror_seconds, reply.stats.mirrored = mirror.seconds, mirror.count
        return reply
