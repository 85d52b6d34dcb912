"""The stage process: a gRPC server in front of one ``StageRuntime``.

Threads: asyncio runs the gRPC server; one worker thread owns MLX and does all
array work (loading, every frame, frees). They meet through queues.

Per ``Forward`` stream three tasks run: a reader (frames off the wire into a
bounded queue: its length is the stage's queue depth), a computer (one frame at
a time on the MLX thread) and a sender (outputs to the next stage's
``Forward`` stream, or, on the last stage, to the head's ``Results`` stream).
Activations go straight from a stage to the next, never through the head.

    python -m mlxpipe.shards.worker --listen 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import logging
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import grpc

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto import pipeline_pb2_grpc as pb_grpc
from mlxpipe.proto.rpc import SECRET_ENV, Security, add_security_arguments, malformed, stage_server
from mlxpipe.shards.stage import FrameError, StageLimits, StageRuntime
from mlxpipe.shards.store import fingerprint, mlxpipe_home, text_config
from mlxpipe.shards.units import parse_size
from mlxpipe.shards.weights import CHUNK_BYTES

logger = logging.getLogger(__name__)

QUEUE_FRAMES = 64  # frames buffered per Forward stream before gRPC flow control pushes back
NEXT_HOP_TIMEOUT_S = 5.0  # how long Load waits to reach the next stage


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # macOS: ru_maxrss is in bytes there
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _model_status(err: ValueError) -> grpc.StatusCode:
    """The status for a model a node cannot profile or load, by why."""
    from mlxpipe.shards.store import BrokenModel, ModelNotFound, ModelPathRefused

    for kind, code in ((ModelPathRefused, grpc.StatusCode.PERMISSION_DENIED),
                       (ModelNotFound, grpc.StatusCode.NOT_FOUND),
                       (BrokenModel, grpc.StatusCode.FAILED_PRECONDITION)):
        if isinstance(err, kind):
            return code
    return grpc.StatusCode.INVALID_ARGUMENT  # a range outside the model, a missing or misshapen tensor


class _Loaded:
    """A loaded shard: the runtime plus what Load replied."""

    def __init__(self, runtime: StageRuntime, reply: pb.LoadReply, request: pb.LoadRequest):
        self.runtime = runtime
        self.reply = reply
        self.request = request


class StageServicer(pb_grpc.StageServicer):
    def __init__(self, security: Optional[Security] = None, memory_bytes: Optional[int] = None,
                 models_dir: Optional[Path] = None, progress: bool = False):
        self.security = security or Security()
        self.progress = progress          # progress bars while loading (a node in a terminal)
        self.memory_bytes = memory_bytes  # offered to the planner; default: a share of physical memory
        self.models_dir = models_dir      # where model paths from a head must lie
        self.mlx = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx")
        self.loaded: Optional[_Loaded] = None
        self.state, self.detail = "empty", "no shard loaded yet"
        self.next_channel: Optional[grpc.aio.Channel] = None
        self.next_stub: Optional[pb_grpc.StageStub] = None
        self.results: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_FRAMES)
        self._results_reader: Optional[asyncio.Task] = None
        self._queued = 0
        self._load_lock = asyncio.Lock()
        self._sessions = itertools.count(1)
        self._streams: set = set()  # Forward handlers running now
        self._offered: dict = {}    # (fingerprint, start, end) -> units the head offered
        self._receivers: dict = {}  # fingerprint -> Receiver

    async def _mlx(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.mlx, fn, *args)

    def _resolve(self, model: str) -> Path:
        from mlxpipe.shards.store import models_dir, resolve_model

        return resolve_model(model, within=self.models_dir or models_dir())

    @staticmethod
    async def _refuse_malformed(request, context) -> None:
        if (why := malformed(request)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)

    async def Ping(self, request, context):
        return pb.PingReply()

    # -- Profile, Load --------------------------------------------------------

    def _profile_sync(self, request: pb.ProfileRequest) -> pb.ProfileReply:
        from mlxpipe.shards.profile import memory_bandwidth, node_name, offered_memory, profile
        from mlxpipe.shards.store import ModelNotFound

        reply = pb.ProfileReply(memory_bytes=offered_memory(self.memory_bytes),
                                node=node_name(), bandwidth_bytes_per_s=memory_bandwidth())
        try:
            path = self._resolve(request.model)
        except ModelNotFound:
            return reply  # no model here (yet): memory and bandwidth are all we can offer
        result = profile(path, fingerprint(path), batch=request.batch or 8)
        reply.layer_seconds.extend(result["layer_seconds"])
        reply.embed_seconds, reply.head_seconds = result["embed_seconds"], result["head_seconds"]
        reply.cached = result["cached"]
        return reply

    async def Profile(self, request: pb.ProfileRequest, context):
        await self._refuse_malformed(request, context)
        try:
            return await self._mlx(self._profile_sync, request)
        except ValueError as err:
            await context.abort(_model_status(err), str(err))

    # -- weights from the head ------------------------------------------------

    def _have_sync(self, offer: pb.WeightsOffer) -> pb.WeightsNeed:
        from mlxpipe.shards.store import ModelNotFound
        from mlxpipe.shards.weights import Receiver

        try:
            path = self._resolve(offer.model)
            if fingerprint(path) == offer.fingerprint:
                return pb.WeightsNeed(local=True)
        except ModelNotFound:
            pass
        receiver = Receiver(mlxpipe_home(), offer.fingerprint, offer.chunk_bytes or CHUNK_BYTES)
        receiver.write_files(dict(offer.files))
        need = pb.WeightsNeed()
        for unit in offer.units:
            missing = receiver.need(unit.name, unit.header, unit.data_bytes)
            if missing:
                need.units.append(pb.UnitNeed(name=unit.name, chunks=missing))
        need.have_bytes = receiver.verified_bytes()
        self._offered[(offer.fingerprint, offer.start, offer.end)] = [u.name for u in offer.units]
        self._receivers[offer.fingerprint] = receiver
        return need

    async def Have(self, request: pb.WeightsOffer, context):
        from mlxpipe.shards.weights import WeightsError

        await self._refuse_malformed(request, context)
        try:
            return await self._mlx(self._have_sync, request)
        except WeightsError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

    async def Receive(self, request_iterator, context):
        from mlxpipe.shards.weights import WeightsError

        summary = pb.ReceiveSummary()
        rejected: dict = {}
        bar = None
        try:
            async for chunk in request_iterator:
                if (why := malformed(chunk)) is not None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
                receiver = self._receivers.get(chunk.fingerprint)
                if receiver is None:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                        f"no offer of model {chunk.fingerprint} yet (call Have first)")
                try:  # disk writes: off the event loop, not on the MLX thread
                    ok = await asyncio.to_thread(receiver.write_chunk, chunk.unit, chunk.index, chunk.data,
                                                 chunk.sha256)
                except WeightsError as err:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
                if ok:
                    summary.bytes += len(chunk.data)
                    if self.progress:
                        if bar is None:
                            from tqdm import tqdm

                            bar = tqdm(desc="receiving weights", unit="B", unit_scale=True, file=sys.stderr)
                        bar.update(len(chunk.data))
                else:
                    logger.warning("chunk %d of %s failed its checksum; asking for it again", chunk.index,
                                   chunk.unit)
                    rejected.setdefault(chunk.unit, []).append(chunk.index)
        finally:
            if bar is not None:
                bar.close()
        summary.rejected.extend(pb.UnitNeed(name=u, chunks=c) for u, c in rejected.items())
        return summary

    def _model_path(self, request: pb.LoadRequest) -> tuple:
        """The folder to load, and whether it holds only the weights received for this range."""
        from mlxpipe.shards.store import ModelNotFound
        from mlxpipe.shards.weights import Receiver

        try:
            return self._resolve(request.model), False
        except ModelNotFound:
            if not request.fingerprint:
                raise
        receiver = Receiver(mlxpipe_home(), request.fingerprint)
        units = self._offered.get((request.fingerprint, request.start, request.end))
        if units is None or not receiver.complete(units):
            raise ModelNotFound(f"model {request.model!r} is not on this node and the weights of layers "
                                f"[{request.start}, {request.end}) have not all been received")
        return receiver.dir, True

    def _load_sync(self, request: pb.LoadRequest) -> _Loaded:
        import mlx.core as mx

        from mlxpipe.shards.profile import offered_memory
        from mlxpipe.shards.slicing import load_stage, read_weights, warm_up

        path, partial = self._model_path(request)
        gc.collect()  # let a replaced shard's arrays go before measuring
        mx.clear_cache()
        before = mx.get_active_memory()
        stage, config = load_stage(path, request.start, request.end, strict=not partial)
        read_weights(stage, progress=self.progress)
        text = text_config(config)
        hidden = int(text["hidden_size"])
        vocab = int(text["vocab_size"])
        max_context = int(text.get("max_position_embeddings") or 1 << 20)
        kv_bytes_per_token = warm_up(stage, hidden)
        weight_bytes = max(mx.get_active_memory() - before, 0)
        model_bytes = sum(
            f.stat().st_size for f in path.glob("*.safetensors")
        )
        offered = offered_memory(self.memory_bytes)
        limits = StageLimits(
            max_batch=request.max_batch or StageLimits.max_batch,
            max_tokens=request.max_tokens or StageLimits.max_tokens,
            max_context=max_context,
            max_cache_bytes=request.max_cache_bytes or max(offered - weight_bytes, 0),
        )
        runtime = StageRuntime(stage, hidden, vocab, limits)
        reply = pb.LoadReply(
            model_path=str(path),
            model_type=config.get("model_type", ""),
            num_layers=stage.num_layers,
            hidden_size=hidden,
            vocab_size=vocab,
            weight_bytes=weight_bytes,
            model_bytes=model_bytes,
            max_context=max_context,
            fingerprint=request.fingerprint if partial else fingerprint(path),
            kv_bytes_per_token=kv_bytes_per_token,
            max_cache_bytes=limits.max_cache_bytes,
        )
        return _Loaded(runtime, reply, request)

    async def Load(self, request: pb.LoadRequest, context):
        await self._refuse_malformed(request, context)
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
            if self.loaded is not None and self.loaded.request == request:
                await self._mlx(self.loaded.runtime.free_all)
                return self.loaded.reply
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
            if self.next_channel is not None:
                await self.next_channel.close()
                self.next_channel = self.next_stub = None
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
            return loaded.reply

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
        last = not loaded.request.next_address
        inbox: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_FRAMES)
        outbox: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_FRAMES)
        downstream = None if last else self.next_stub.Forward(metadata=self.security.metadata())
        session = next(self._sessions)
        me = asyncio.current_task()
        self._streams.add(me)
        count = 0

        async def read():
            async for frame in request_iterator:
                if (why := malformed(frame)) is not None:
                    raise FrameError(why)
                self._queued += 1
                await inbox.put(frame)
            await inbox.put(None)

        async def compute():
            nonlocal count
            while (frame := await inbox.get()) is not None:
                self._queued -= 1
                out = await self._mlx(loaded.runtime.run, frame, session)
                count += 1
                await outbox.put(out)
            await outbox.put(None)

        async def send():
            while (out := await outbox.get()) is not None:
                if last:
                    await self.results.put(out)
                else:
                    await downstream.write(out)
            if downstream is not None:
                await downstream.done_writing()
                await downstream

        tasks = [asyncio.ensure_future(t()) for t in (read, compute, send)]
        try:
            await asyncio.gather(*tasks)
        except FrameError as err:
            await context.abort(getattr(grpc.StatusCode, err.code), str(err))
        except grpc.aio.AioRpcError as err:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"next stage {loaded.request.next_address} failed: {err.code().name}: {err.details()}",
            )
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._queued -= inbox.qsize()
            if downstream is not None and not downstream.done():
                downstream.cancel()
            # However the stream ended, its sequences go: the head replays them.
            freed = await asyncio.shield(self._mlx(loaded.runtime.free_session, session))
            if freed:
                logger.info("stream %d ended; freed %d sequences", session, freed)
            self._streams.discard(me)
        return pb.ForwardSummary(frames=count)

    async def Results(self, request, context):
        if self.loaded is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no shard loaded ({self.detail})")
        if self.loaded.request.next_address:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "only the last stage has results")
        # One head at a time: a new subscriber replaces the old one.
        if self._results_reader is not None:
            self._results_reader.cancel()
        self._results_reader = asyncio.current_task()
        while True:
            yield await self.results.get()

    # -- Free, Health ----------------------------------------------------------

    async def Free(self, request: pb.FreeRequest, context):
        await self._refuse_malformed(request, context)
        loaded = self.loaded
        if loaded is None:
            return pb.FreeReply(freed=0)
        if request.seq_ids:
            freed = await self._mlx(loaded.runtime.free, list(request.seq_ids))
        else:
            freed = await self._mlx(loaded.runtime.free_all)
        return pb.FreeReply(freed=freed)

    async def Health(self, request, context):
        import mlx.core as mx

        reply = pb.HealthReply(
            state=self.state,
            detail=self.detail,
            active_bytes=mx.get_active_memory(),
            rss_bytes=_rss_bytes(),
        )
        loaded = self.loaded
        if loaded is not None:
            rt = loaded.runtime
            reply.model = loaded.reply.model_path
            reply.start, reply.end = loaded.request.start, loaded.request.end
            reply.num_layers = loaded.reply.num_layers
            reply.weight_bytes = loaded.reply.weight_bytes
            reply.next_address = loaded.request.next_address
            reply.live_seqs.extend(sorted(list(rt.seqs)))
            reply.cache_bytes = rt.cache_bytes()
            busy_fraction, tokens_per_s = rt.stats.window()
            reply.stats.CopyFrom(
                pb.StageStats(
                    busy_seconds=rt.stats.busy_now(),
                    busy_fraction=busy_fraction,
                    tokens_per_s=tokens_per_s,
                    uptime_seconds=time.monotonic() - rt.stats.started,
                    frames=rt.stats.frames,
                    tokens=rt.stats.tokens,
                    queue_depth=max(self._queued, 0),
                )
            )
        return reply


async def _exit_with_parent(server) -> None:
    """Stop when the process that started us is gone (a head killed with -9
    must not leave stage processes behind)."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    logger.warning("parent process %d is gone; stopping", parent)
    await server.stop(grace=None)
    os._exit(0)  # skip interpreter teardown: MLX's threads need none, and abort noisily


async def _join(head: str, address: str, security: Security, memory_bytes: Optional[int]) -> None:
    """Offer ourselves to the head; stop the node if it refuses our secret."""
    import platform

    from mlxpipe.server.join import join
    from mlxpipe.shards.profile import memory_bandwidth, offered_memory

    memory = offered_memory(memory_bytes)
    bandwidth = await asyncio.to_thread(memory_bandwidth)
    try:
        reply = await join(head, address, platform.node(), memory, bandwidth, security)
    except (PermissionError, ConnectionError) as err:
        print(f"mlxpipe node: {err}", file=sys.stderr, flush=True)
        os._exit(1)  # a node the head will not have is of no use
    logger.warning("joined the head at %s (%s): %s", head, "in the pipeline" if reply.in_plan else "standing by",
                   reply.detail)


def _advertised(listen: str, head: str) -> str:
    """The address the head should use for us: ours on the route toward the head."""
    import socket

    host, _, port = listen.rpartition(":")
    if host not in ("0.0.0.0", "::", "[::]", ""):
        return listen
    head_host, _, head_port = head.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((head_host, int(head_port)))
        return f"{s.getsockname()[0]}:{port}"


async def serve(listen: str, security: Optional[Security] = None, memory_bytes: Optional[int] = None,
                models_dir: Optional[Path] = None, exit_with_parent: bool = False,
                join: Optional[str] = None, advertise: Optional[str] = None) -> None:
    """Run a stage server on ``listen`` (host:port; port 0 picks a free one)."""
    security = security or Security()
    # A node in a terminal shows progress; stages a head started stay quiet.
    servicer = StageServicer(security, memory_bytes, models_dir,
                             progress=sys.stderr.isatty() and not exit_with_parent)
    server = stage_server(servicer, security)
    host, _, port = listen.rpartition(":")
    bound = security.add_port(server, f"{host}:{port}")
    if bound == 0:
        raise SystemExit(f"cannot listen on {listen}")
    await server.start()
    # The one line a parent process waits for to learn the address.
    print(f"mlxpipe node listening on {host}:{bound}", flush=True)
    logger.info("stage listening on %s:%d (%s, %s)", host, bound,
                "secret required" if security.secret else "no secret",
                "mutual TLS" if security.cert and security.ca else "TLS" if security.cert else "no TLS")
    watcher = asyncio.ensure_future(_exit_with_parent(server)) if exit_with_parent else None
    joiner = None
    if join:
        address = advertise or _advertised(f"{host}:{bound}", join)
        joiner = asyncio.ensure_future(_join(join, address, security, memory_bytes))
    await server.wait_for_termination()
    for task in (watcher, joiner):
        if task is not None:
            task.cancel()


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "[::1]", "localhost") or host.startswith("127.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:50051",
                        help="host:port to listen on (default 127.0.0.1:50051; port 0 picks one). "
                             "Any other host than loopback needs the cluster secret.")
    add_security_arguments(parser, node=True)
    parser.add_argument("--insecure", action="store_true",
                        help="allow listening beyond loopback without a cluster secret (not recommended)")
    parser.add_argument("--models-dir", default=None,
                        help="the folder model paths from a head must lie in (default $MLXPIPE_HOME/models); "
                             "Hugging Face repo ids are looked up in the local HF cache")
    parser.add_argument("--memory", default=None,
                        help="memory this node offers for weights and caches, e.g. 150GB "
                             "(default: 75%% of physical memory)")
    parser.add_argument("--cpu", type=int, default=None,
                        help="pin this process to one CPU core (Linux), so that it stands for one node")
    parser.add_argument("--join", default=None, metavar="HEAD:PORT",
                        help="offer this node to a head (`mlxpipe serve --join-listen`), with the cluster secret")
    parser.add_argument("--advertise", default=None, metavar="HOST:PORT",
                        help="the address the head should reach this node at (default: the listen address, "
                             "or this machine's address toward the head)")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="stop when the parent process exits (for stages a head starts itself)")
    parser.add_argument("--log-level", default="INFO")


def run(args) -> int:
    logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger().setLevel(args.log_level)
    security = Security.from_args(args)
    host = args.listen.rpartition(":")[0]
    if not _loopback(host) and not security.secret and not args.insecure:
        raise SystemExit(f"refusing to listen on {args.listen} without a cluster secret: anyone who can reach "
                         f"the port could run and read computations. Give --secret-file or ${SECRET_ENV} "
                         f"(the same on every node and the head), or --insecure to accept the risk.")
    if args.cpu is not None:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {args.cpu})
        else:
            logger.warning("--cpu is not supported on this platform")
    memory = None
    if args.memory:
        memory = parse_size(args.memory)
    try:
        asyncio.run(serve(args.listen, security, memory,
                          Path(args.models_dir).expanduser() if args.models_dir else None,
                          exit_with_parent=args.exit_with_parent, join=args.join, advertise=args.advertise))
    except KeyboardInterrupt:
        pass
    return 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="mlxpipe node", description="Run one pipeline stage worker.")
    add_arguments(parser)
    sys.exit(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
