"""The gRPC stage client: the head's side of the wire, and core's ``Transport``.

``Pipeline`` connects to a list of stage addresses (local processes,
``local.py``, or remote nodes), tells each which layers of which model to load
and where its next stage is (sending weights first to a node that lacks them,
``weights.py``), then keeps two long-lived streams open: ``Forward`` into stage
0 and ``Results`` out of the last stage. Activations never pass through here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Dict, List, Optional, Sequence, Tuple

import grpc

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto import pipeline_pb2_grpc as pb_grpc
from mlxpipe.proto.errors import GROUP_BROKEN
from mlxpipe.proto.rpc import Security, culprits_of
from mlxpipe.server.cluster import groups, tp_backend
from mlxpipe.server.cluster.budget import FrameBudget
from mlxpipe.server.cluster.links import LinkTable
from mlxpipe.server.cluster.sizing import StageLimits
from mlxpipe.server.cluster.weights import WeightSource, send_weights
from mlxpipe.server.core.transport import PipelineError, StageCaches
from mlxpipe.shards.models.progress import Progress
from mlxpipe.shards.models.weights import CHUNK_BYTES
from mlxpipe.shards.params import wire
from mlxpipe.shards.params.quant import QuantSpec

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 900.0
CALL_TIMEOUT_S = 10.0


def _rank_requests(req: pb.LoadRequest, peers: List[str],
                   backend: tp_backend.Backend = tp_backend.Backend("ring")) -> List[pb.LoadRequest]:
    """Each rank's Load of a group's stage: the leader's as the stage's, the others' without the next
    stage and the tokenizer (only the leader sends on and samples)."""
    out = []
    rows = [pb.RdmaRow(to=row) for row in backend.rdma]
    for rank in range(len(peers)):
        r = pb.LoadRequest()
        r.CopyFrom(req)
        r.group.CopyFrom(pb.TensorGroup(rank=rank, size=len(peers), peers=peers, backend=backend.name, rdma=rows))
        if rank:
            r.next_address = ""
            r.ClearField("tokenizer")
        out.append(r)
    return out


async def probe(addresses: Sequence[str], security: Security, timeout: float = 2.0) -> List[Optional[str]]:
    """For each stage: None when it answers a health check within ``timeout``, else why not (a
    node whose tensor group broke answers, but is about to start afresh: not yet)."""

    async def one(address: str) -> Optional[str]:
        async with security.channel(address) as channel:
            try:
                reply = await pb_grpc.StageStub(channel).Health(pb.HealthRequest(), timeout=timeout,
                                                                metadata=security.metadata())
                return f"restarting: {reply.detail}" if reply.detail.startswith(GROUP_BROKEN) else None
            except grpc.aio.AioRpcError as err:
                return f"{err.code().name}: {err.details()}"

    return list(await asyncio.gather(*(one(a) for a in addresses)))


@dataclass
class Placement:
    """One stage of a pipeline, as the head knows it: where it runs and which layers."""

    address: str
    start: int
    end: int
    load: Optional[pb.LoadReply] = None
    weights_sent: int = 0  # data bytes of weights the head streamed to it
    ranks: List[str] = field(default_factory=list)  # a tensor-parallel group's other ranks (groups.py)
    rank_health: List[Tuple[str, Optional[pb.HealthReply], str]] = field(default_factory=list)  # theirs, last asked


class Pipeline:
    """A chain of stages holding one model, driven by the head."""

    def __init__(self, addresses: Sequence[str], model: str, security: Optional[Security] = None,
                 limits: StageLimits = StageLimits(), tokenizer: Optional[pb.TokenizerSpec] = None,
                 probe: Tuple[int, int] = (0, 0), fingerprint: str = "",
                 followers: Optional[Dict[str, List[str]]] = None):
        self.stages = [Placement(a, 0, 0, ranks=list((followers or {}).get(a, []))) for a in addresses]
        self.model = model
        self.security = security or Security()
        self.md = self.security.metadata()  # every call carries the cluster secret
        self.limits = limits  # what each stage holds to (from the config tree: config.stage_limits)
        self.tokenizer = tokenizer  # for the last stage's grammars (None: it refuses sequences with one)
        self.channels = [self.security.channel(a) for a in addresses]
        self.stubs = [pb_grpc.StageStub(c) for c in self.channels]
        self.rank_channels = {a: self.security.channel(a) for st in self.stages for a in st.ranks}
        self.rank_stubs = {a: pb_grpc.StageStub(c) for a, c in self.rank_channels.items()}
        self._forward = None
        self._results = None
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._writer: Optional[asyncio.Task] = None
        self.budget = FrameBudget()  # where frames' time goes (cluster/budget.py)
        self.probe = probe  # bytes of a decode-sized and a prefill-sized frame, to time the links with (0: don't)
        self.fingerprint = fingerprint  # of the model as the head has it (empty: not checked)
        self.links = LinkTable(addresses)  # every hop's latency and throughput (links.py)

    async def profile(self, indices: Sequence[int], batch: int,
                      quant: Optional[QuantSpec] = None) -> List[pb.ProfileReply]:
        """Ask stages (by index) to time the model (quantized by ``quant``), for the planner."""
        request = pb.ProfileRequest(model=self.model, batch=batch,
                                    quantization=wire.quant_to_wire(quant) if quant else None)

        async def one(i: int) -> pb.ProfileReply:
            try:
                return await self.stubs[i].Profile(request, timeout=LOAD_TIMEOUT_S, metadata=self.md)
            except grpc.aio.AioRpcError as err:
                raise PipelineError(f"stage {i} at {self.stages[i].address} could not profile the model: "
                                    f"{err.code().name}: {err.details()}") from err

        return list(await asyncio.gather(*(one(i) for i in indices)))

    def assign(self, ranges: Sequence[Tuple[int, int]]) -> None:
        """Give stage i the layers ``ranges[i]``."""
        if len(ranges) != len(self.stages):
            raise ValueError(f"{len(ranges)} layer ranges for {len(self.stages)} stages")
        for st, (s, e) in zip(self.stages, ranges):
            st.start, st.end = s, e

    async def load(self, progress: bool = False, weights: Optional[WeightSource] = None,
                   quant: Optional[QuantSpec] = None) -> List[pb.LoadReply]:
        """Every stage loads its range, all at once (a progress bar counts them in).
        With ``weights``, a stage without the model first receives its range's.
        With ``quant``, a stage holding the full-precision model quantizes its range
        as it loads it (and ``weights`` should be a ``QuantizedSource`` of the same spec)."""
        n = len(self.stages)
        bar = Progress(f"loading {Path(self.model).name} on {n} stage{'s' if n != 1 else ''}", "stages loaded",
                       total=n, terminal=progress, every_s=0)

        async def one(i: int) -> pb.LoadReply:
            st = self.stages[i]
            nxt = self.stages[i + 1].address if i + 1 < len(self.stages) else ""
            req = self._request(st, nxt, quant)
            ranks, stubs = [st.address, *st.ranks], [self.stubs[i], *(self.rank_stubs[a] for a in st.ranks)]
            try:
                if weights is not None:
                    for address, stub in zip(ranks, stubs):
                        st.weights_sent += await send_weights(stub, i, address, self._offer(st, weights), weights,
                                                              self.md, progress)
                    req.fingerprint = weights.fingerprint
                reqs = [req]
                if st.ranks:  # every rank at once: they form their group's collective inside Load
                    peers, hellos = await groups.hello(stubs, ranks, self.md)
                    backend = tp_backend.choose(self.limits.tp_backend, [h.rdma_ports for h in hellos], ranks)
                    reqs = _rank_requests(req, peers, backend)
                replies = await asyncio.gather(*(s.Load(r, timeout=LOAD_TIMEOUT_S, metadata=self.md)
                                                 for s, r in zip(stubs, reqs)))
                st.load = replies[0]
                self._check_fingerprints(replies, ranks)
                bar.update()
            except (grpc.aio.AioRpcError, ValueError) as err:
                details = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
                code = err.code().name + ": " if isinstance(err, grpc.aio.AioRpcError) else ""
                # A stage that cannot reach its successor blames the successor; a group goes as a unit.
                suspects = [self.stages[i + 1].address] if "next stage" in (details or "") else ranks
                raise PipelineError(f"stage {i} at {'+'.join(ranks)} could not load layers [{st.start}, {st.end}): "
                                    f"{code}{details}", suspects) from err
            return st.load

        try:
            replies = await asyncio.gather(*(one(i) for i in range(len(self.stages))))
        finally:
            bar.close()
        self._check_fingerprints(replies, [st.address for st in self.stages])
        self._check_digests(replies)
        if self.probe[1]:
            await self.links.measure(self.stubs, self.md, *self.probe)
            self.links.warn_new()
            if self.links.head:
                logger.info("links: %s", "; ".join(link.describe() for link in self.links.links()))
        return replies

    def _request(self, st: Placement, nxt: str, quant: Optional[QuantSpec]) -> pb.LoadRequest:
        lim = self.limits
        req = pb.LoadRequest(model=self.model, start=st.start, end=st.end, next_address=nxt,
                             max_batch=lim.max_batch, max_chunk_tokens=lim.max_chunk_tokens,
                             max_cache_bytes=lim.max_cache_bytes, block_tokens=lim.block_tokens,
                             quantization=wire.quant_to_wire(quant) if quant else None,
                             tokenizer=self.tokenizer if not nxt else None,
                             kv_cache=wire.kv_to_wire(lim.kv) if lim.kv else None, mtp=lim.mtp,
                             vision=lim.vision)
        if lim.disk_bytes is not None:
            req.prefix_disk_bytes = lim.disk_bytes
        return req

    def _offer(self, st: Placement, source: WeightSource) -> pb.WeightsOffer:
        return pb.WeightsOffer(model=self.model, fingerprint=source.fingerprint, start=st.start, end=st.end,
                               chunk_bytes=CHUNK_BYTES, files=source.files,
                               source_fingerprint=source.source_fingerprint)

    def _check_fingerprints(self, replies: Sequence[pb.LoadReply], addresses: Sequence[str]) -> None:
        """Every stage (every rank of a group) holds the head's model (one line naming those that do not)."""
        want = self.fingerprint or replies[0].fingerprint
        wrong = [(a, r.fingerprint) for a, r in zip(addresses, replies) if r.fingerprint != want]
        if wrong:
            raise PipelineError("; ".join(
                f"node {a} holds another copy of {Path(self.model).name} (fingerprint {f[:12]}, the head's "
                f"{want[:12]}): update it, or remove it so that the head sends the layers" for a, f in wrong),
                [a for a, _ in wrong])

    def _check_digests(self, replies: Sequence[pb.LoadReply]) -> None:
        """Stages of one model agree where what they loaded meets (``LoadReply.unit_digests``):
        the config on every stage, the embedding on the first and a last stage that ties its
        head to it. A node that loaded a copy other than the head's (one that answered by
        name, not by content) is refused, in one line."""
        seen: Dict[str, Tuple[str, int]] = {}
        for i, reply in enumerate(replies):
            for unit, digest in sorted(reply.unit_digests.items()):
                first = seen.setdefault(unit, (digest, i))
                if first[0] != digest:
                    j, a = first[1], self.stages[i].address
                    raise PipelineError(
                        f"node {a} (stage {i}) loaded another {unit} than stage {j} at {self.stages[j].address} "
                        f"(digest {digest[:12]}, not {first[0][:12]}): its copy of {Path(self.model).name} is "
                        "not the head's; update it, or remove it so that the head sends the layers", [a])

    async def open(self) -> None:
        """Open the Results stream of the last stage, then the Forward stream of the first."""
        self._results = self.stubs[-1].Results(pb.ResultsRequest(), metadata=self.md)
        self._forward = self.stubs[0].Forward(metadata=self.md)
        self._writer = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        try:
            while True:
                frame = await self._outbox.get()
                self.budget.sent(frame)
                frame.sent_us = time.time_ns() // 1000  # for stage 0's view of this hop (shards/net/links.py)
                await self._forward.write(frame)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as err:
            # The stream broke; watch_forward reports why.
            logger.info("forward stream write failed: %s", err)

    def send(self, frame: pb.Frame) -> None:
        """Queue a frame for stage 0; frames go out in the order sent."""
        self._outbox.put_nowait(frame)

    async def results(self) -> AsyncIterator[pb.Result]:
        """Results from the last stage, until the pipeline breaks (PipelineError)."""
        last = len(self.stages) - 1
        try:
            async for result in self._results:
                arrived = time.perf_counter()
                yield result
                self.budget.done(result, arrived)
        except grpc.aio.AioRpcError as err:
            raise PipelineError(f"results stream of the last stage at {self.stages[last].address} broke: "
                                f"{err.code().name}: {err.details()}", [self.stages[last].address]) from err
        raise PipelineError("the last stage closed its results stream", [self.stages[last].address])

    async def watch_forward(self) -> None:
        """Return never; raise PipelineError when the Forward stream into stage 0 ends.

        A stage that loses its successor ends its own upstream stream with
        UNAVAILABLE, so a break anywhere along the chain arrives here."""
        try:
            await self._forward
        except grpc.aio.AioRpcError as err:
            raise PipelineError(f"forward stream into stage 0 at {self.stages[0].address} broke: "
                                f"{err.code().name}: {err.details()}", culprits=culprits_of(err)) from err
        raise PipelineError("stage 0 closed the forward stream")

    async def health(self, timeout: float = CALL_TIMEOUT_S) -> List[Tuple[Placement, Optional[pb.HealthReply], str]]:
        """(stage, reply or None, error) for every stage, asked at once; a group's other ranks too
        (``Placement.rank_health``): one of them down or not ready is its stage's error."""

        async def ask(stub, address: str) -> Tuple[Optional[pb.HealthReply], str]:
            try:
                return await stub.Health(pb.HealthRequest(), timeout=timeout, metadata=self.md), ""
            except grpc.aio.AioRpcError as err:
                return None, f"{err.code().name}: {err.details()}"
            except grpc.aio.UsageError as err:  # closed under us: a recovery replaced this pipeline
                return None, f"{err} (the pipeline is being rebuilt)"
            except asyncio.CancelledError:
                # gRPC cancels calls in flight when their channel closes (a recovery
                # replacing this pipeline); only a cancel of the caller itself goes on.
                task = asyncio.current_task()
                if task is not None and getattr(task, "cancelling", lambda: 1)():
                    raise
                return None, "the call was cancelled: the pipeline is being rebuilt"

        async def one(i: int):
            st = self.stages[i]
            (reply, err), *ranks = await asyncio.gather(ask(self.stubs[i], st.address),
                                                        *(ask(self.rank_stubs[a], a) for a in st.ranks))
            st.rank_health = [(a, r, e) for a, (r, e) in zip(st.ranks, ranks)]
            if reply is not None:
                self.links.saw_health(i, reply)
            bad = next(((a, r, e) for a, r, e in st.rank_health if r is None or r.state != "ready"), None)
            if reply is not None and reply.state == "ready" and bad is not None:
                a, r, e = bad
                return st, None, f"its group's rank at {a} is " + (f"unreachable ({e})" if r is None else
                                                                  f"{r.state}: {r.detail}")
            return st, reply, err

        return list(await asyncio.gather(*(one(i) for i in range(len(self.stages)))))

    def caches(self) -> List[StageCaches]:
        """What each stage reported of its caches when it loaded."""
        return [StageCaches(list(r.blocks), list(r.starts) + list(r.disk_starts) if r.state_bytes else None,
                            r.kv_bytes_per_token, r.state_bytes, r.max_rewind,
                            r.kv_full_bytes_per_token if r.HasField("kv_cache") else 0, list(r.disk_blocks),
                            list(r.disk_starts), dict(r.unit_digests), mtp_layers=r.mtp_layers, mtp_note=r.mtp_note)
                for r in (st.load for st in self.stages)]

    async def fetch(self, seq_id: int, keys: Sequence[Sequence[int]]) -> List[Tuple[List[int], List[int]]]:
        """Have each stage read ``keys[i]`` back from its disk (all at once); per stage,
        (keys read, keys it could not). A stage that fails to answer read none: the
        sequence computes those positions again (and the health checks find the stage)."""

        async def one(i: int) -> Tuple[List[int], List[int]]:
            if not keys[i]:
                return [], []
            try:
                reply = await self.stubs[i].Fetch(pb.FetchRequest(seq_id=seq_id, keys=keys[i]),
                                                  timeout=LOAD_TIMEOUT_S, metadata=self.md)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError) as err:
                logger.warning("stage %d could not read prefix blocks back from disk: %s", i, err)
                return [], []
            return list(reply.loaded), list(reply.dropped)

        return list(await asyncio.gather(*(one(i) for i in range(len(self.stages)))))

    async def close(self) -> None:
        self.links.close()
        if self._writer is not None:
            self._writer.cancel()
        for call in (self._forward, self._results):
            if call is not None:
                call.cancel()
        for ch in [*self.channels, *self.rank_channels.values()]:
            await ch.close()
