"""``Have`` and ``Receive``: the weights a head streams to a node that lacks the model.

The head offers a layer range (``Have``), each unit named by its content digest
(``shards/models/unit_digests.py``); the node answers ``local`` when its own copy of
the model has those very units and config files (their digests computed the same
way, kept the same way), else which chunks it lacks, and the head streams those
(``Receive``) into the node's store of received units (``shards/models/received.py``),
kept under their digests. ``Load`` then reads the node's own folder or a folder of the
received units of its range (``model_path``). ``weights.py`` checks and writes the
bytes; this is the RPC side, which the stage servicer holds and delegates to.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Tuple

import grpc

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto.rpc import refuse_malformed
from mlxpipe.shards.models.progress import Progress
from mlxpipe.shards.models.received import FILES, Receiver, check_digest, check_files
from mlxpipe.shards.models.store import ModelNotFound, mlxpipe_home
from mlxpipe.shards.models.unit_digests import file_sha256, unit_digests
from mlxpipe.shards.models.weights import CHUNK_BYTES, WeightsError, model_units

logger = logging.getLogger(__name__)


@dataclass
class Offer:
    """What a head offered for a range, and what the node answered."""

    units: Dict[str, str]     # unit -> digest
    files: Dict[str, bytes]   # config.json (and generation_config.json)
    local: Optional[Path]     # the node's own folder, when it holds what was offered


def offered(offer: pb.WeightsOffer) -> Dict[str, str]:
    """What a node must hold to load its own copy: the offer's units by digest (or, with
    quantized units, the source's) and its config files by SHA-256 (module docstring)."""
    if offer.source_fingerprint and not offer.units:
        want = dict(offer.source_digests)
        for unit, digest in want.items():
            if unit not in FILES:
                check_digest(unit, digest)
        return want
    want = {}
    for u in offer.units:
        check_digest(u.name, u.digest)
        want[u.name] = u.digest
    return want | {n: hashlib.sha256(d).hexdigest() for n, d in offer.files.items()}


def own_digests(folder: Path, want: Mapping[str, str]) -> Dict[str, str]:
    """What ``folder`` holds of ``want``'s names (units by digest, files by SHA-256; a
    unit or file it lacks: absent)."""
    units = model_units(folder)
    have = unit_digests(mlxpipe_home(), folder, {n: units[n] for n in want if n not in FILES and n in units})
    for name in FILES:
        if (sha := file_sha256(folder / name)) is not None:
            have[name] = sha
    return have


class WeightService:
    """The Have/Receive handlers, and the offers and receivers they keep."""

    def __init__(self, resolve: Callable[[str], Path], mlx: ThreadPoolExecutor, progress: bool = False):
        self.resolve = resolve    # a model name from the head -> this node's folder (raises ModelNotFound)
        self.mlx = mlx            # the thread that owns MLX: offers are answered there, between loads
        self.following = lambda: False  # a tensor group's other rank, its MLX thread following its leader:
                                        # offers are answered on a thread of their own (no load runs meanwhile)
        self.progress = progress  # show progress while receiving (a node, not a head's own stage)
        self._offers: Dict[Tuple[str, int, int], Offer] = {}    # (fingerprint, start, end) -> the last offer
        self._digests: Dict[Tuple[str, str], str] = {}          # (fingerprint, unit) -> digest offered
        self._receivers: Dict[str, Receiver] = {}               # fingerprint -> Receiver (its chunk size)

    def _own_copy(self, offer: pb.WeightsOffer, want: Dict[str, str]) -> Optional[Tuple[Path, Dict[str, str]]]:
        """The node's own folder and its digests, when they are ``want``'s (None: no copy, or another)."""
        if offer.source_fingerprint and offer.units:
            return None  # quantized units: only the source, quantized here on Load, is "local"
        try:
            path = self.resolve(offer.model)
            have = own_digests(path, want)
        except ModelNotFound:
            return None
        except (WeightsError, OSError) as err:  # a damaged copy of our own: take the head's
            logger.warning("%s cannot be read (%s): receiving the head's layers [%d, %d)", offer.model, err,
                           offer.start, offer.end)
            return None
        differ = sorted(n for n in set(want) | (set(have) & set(FILES)) if have.get(n) != want.get(n))
        if not differ:
            return path, have
        logger.warning("%s here is not the head's copy (%s differ%s): receiving the head's layers [%d, %d)",
                       path, ", ".join(differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else ""),
                       "s" if len(differ) == 1 else "", offer.start, offer.end)
        return None

    def _have_sync(self, offer: pb.WeightsOffer) -> pb.WeightsNeed:
        check_files(offer.files)
        want = offered(offer)
        key = (offer.fingerprint, offer.start, offer.end)
        units = {u.name: u.digest for u in offer.units}
        own = self._own_copy(offer, want)
        if own is not None:
            self._offers[key] = Offer(units, dict(offer.files), own[0])
            return pb.WeightsNeed(local=True, local_digests={n: own[1][n] for n in want})
        receiver = Receiver(mlxpipe_home(), offer.chunk_bytes or CHUNK_BYTES)
        need = pb.WeightsNeed()
        for unit in offer.units:
            missing = receiver.need(unit.name, unit.digest, unit.header, unit.data_bytes)
            if missing:
                need.units.append(pb.UnitNeed(name=unit.name, chunks=missing))
            self._digests[(offer.fingerprint, unit.name)] = unit.digest
        need.have_bytes = receiver.verified_bytes(units.values())
        self._offers[key] = Offer(units, dict(offer.files), None)
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
                digest = self._digests.get((chunk.fingerprint, chunk.unit))
                if receiver is None or digest is None:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                        f"no offer of unit {chunk.unit[:40]!r} of model {chunk.fingerprint[:40]} "
                                        "yet (call Have first)")
                try:  # disk writes: off the event loop, not on the MLX thread
                    ok = await asyncio.to_thread(receiver.write_chunk, chunk.unit, digest, chunk.index, chunk.data,
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

    def offer(self, request: pb.LoadRequest) -> Optional[Offer]:
        """The head's last offer of the range a Load asks for (None: none)."""
        return self._offers.get((request.fingerprint, request.start, request.end)) if request.fingerprint else None

    def model_path(self, request: pb.LoadRequest) -> Tuple[Path, bool]:
        """The folder to load, and whether it holds only the weights received for this range.
        A head that sends weights (``request.fingerprint``: the name the stage then reports,
        its own copy's or the received units' content being the head's) offered the range
        first: the node loads its own copy only if it answered that it holds the units offered."""
        if not request.fingerprint:
            return self.resolve(request.model), False
        offer = self.offer(request)
        if offer is None:
            raise ModelNotFound(f"layers [{request.start}, {request.end}) of model {request.model!r} were not "
                                "offered to this node (the head offers them with Have before Load)")
        if offer.local is not None:
            return offer.local, False
        receiver = Receiver(mlxpipe_home())
        if not offer.units or not receiver.complete(offer.units.values()):
            raise ModelNotFound(f"model {request.model!r} is not on this node and the weights of layers "
                                f"[{request.start}, {request.end}) have not all been received")
        return receiver.stage_dir(offer.files, offer.units), True
