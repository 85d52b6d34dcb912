"""``Have`` and ``Receive``: the weights a head streams to a node that lacks the model.

The head offers a layer range (``Have``); the node answers that it holds the
model, or which chunks it lacks, and the head streams those (``Receive``).
``weights.py`` checks and writes the bytes; this is the RPC side, which the
stage servicer holds and delegates to, and which tells ``Load`` where a range's
weights are.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import grpc

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto.rpc import refuse_malformed
from mlxpipe.shards.models.progress import Progress
from mlxpipe.shards.models.store import ModelNotFound, fingerprint, mlxpipe_home
from mlxpipe.shards.models.weights import CHUNK_BYTES, Receiver, WeightsError

logger = logging.getLogger(__name__)


class WeightService:
    """The Have/Receive handlers, and the offers and receivers they keep."""

    def __init__(self, resolve: Callable[[str], Path], mlx: ThreadPoolExecutor, progress: bool = False):
        self.resolve = resolve    # a model name from the head -> this node's folder (raises ModelNotFound)
        self.mlx = mlx            # the thread that owns MLX: offers are answered there, between loads
        self.following = lambda: False  # a tensor group's other rank, its MLX thread following its leader:
                                        # offers are answered on a thread of their own (no load runs meanwhile)
        self.progress = progress  # show progress while receiving (a node, not a head's own stage)
        self._offered: Dict[Tuple[str, int, int], List[str]] = {}  # (fingerprint, start, end) -> units offered
        self._receivers: Dict[str, Receiver] = {}  # fingerprint -> Receiver

    def _have_sync(self, offer: pb.WeightsOffer) -> pb.WeightsNeed:
        try:
            path = self.resolve(offer.model)
            if fingerprint(path) in (offer.fingerprint, offer.source_fingerprint):
                return pb.WeightsNeed(local=True)  # (quantized units: we quantize our own copy on Load)
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
        await refuse_malformed(request, context)
        try:
            return await asyncio.get_running_loop().run_in_executor(None if self.following() else self.mlx,
                                                                     self._have_sync, request)
        except WeightsError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

    async def Receive(self, request_iterator, context):
        summary = pb.ReceiveSummary()
        rejected: dict = {}
        bar = None
        try:
            async for chunk in request_iterator:
                await refuse_malformed(chunk, context)
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
                            bar = Progress("receiving weights", "B")  # a bar on a terminal, else lines
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

    def model_path(self, request: pb.LoadRequest) -> Tuple[Path, bool]:
        """The folder to load, and whether it holds only the weights received for this range."""
        try:
            return self.resolve(request.model), False
        except ModelNotFound:
            if not request.fingerprint:
                raise
        receiver = Receiver(mlxpipe_home(), request.fingerprint)
        units = self._offered.get((request.fingerprint, request.start, request.end))
        if units is None or not receiver.complete(units):
            raise ModelNotFound(f"model {request.model!r} is not on this node and the weights of layers "
                                f"[{request.start}, {request.end}) have not all been received")
        return receiver.dir, True
