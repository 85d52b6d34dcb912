"""Weights for nodes that lack the model: the head's sources and the transfer.

Before ``Load``, the head offers each remote node the units of its range
(``Have``, ``shards/models/weights.py``), each named by its content digest
(``shards/models/unit_digests.py``: hashed once, kept in ``$MLXPIPE_HOME/digests/``
while the files are unchanged); the node answers that its own copy has those very
units (and says their digests, which the head checks), or which chunks it lacks, and
the head streams them (``Receive``), each with its SHA-256, at most ``rate`` bytes a
second, and sends again what fails its checksum. With ``--bits`` what travels is
quantized (``QuantizedSource``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional

import mlx.core as mx
import mlx_lm

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.core.transport import PipelineError
from mlxpipe.shards.models.progress import Progress
from mlxpipe.shards.models.quantize import QuantizeError, prepare, stage_units, write_config, write_units
from mlxpipe.shards.models.store import mlxpipe_home
from mlxpipe.shards.models.unit_digests import unit_digests
from mlxpipe.shards.models.vision import takes_images
from mlxpipe.shards.models.weights import CHUNK_BYTES, Unit, chunk_size, model_units, units_for_range
from mlxpipe.shards.params.quant import QuantSpec, quantized_fingerprint

logger = logging.getLogger(__name__)

TIMEOUT_S = 900.0  # one Have or Receive call, at most


@dataclass
class WeightSource:
    """The head's copy of the model, for nodes that lack it (shards/models/weights.py)."""

    folder: Path
    fingerprint: str
    num_layers: int
    rate: Optional[float] = None      # bytes per second at most, per node
    source_fingerprint: str = ""      # of the full-precision folder, when what is sent is quantized

    def __post_init__(self):
        self.units = model_units(self.folder)
        self.files = {n: (self.folder / n).read_bytes()
                      for n in ("config.json", "generation_config.json") if (self.folder / n).exists()}

    def range_units(self, start: int, end: int) -> List[Unit]:
        """The units a stage with layers ``[start, end)`` needs."""
        return units_for_range(self.units, start, end, self.num_layers)

    def digests(self, units: Iterable[Unit]) -> Dict[str, str]:
        """Each unit's content digest (kept ones while its files are unchanged, else hashed now)."""
        return unit_digests(mlxpipe_home(), self.folder, {u.name: u for u in units})

    def file_digests(self) -> Dict[str, str]:
        """The config files' SHA-256s, as a node that holds its own copy names them."""
        return {n: hashlib.sha256(d).hexdigest() for n, d in self.files.items()}


def quantized_key(digests: Mapping[str, str], spec: QuantSpec) -> str:
    """What the head's quantized units of a source are kept under: every source unit's
    digest and its config files', the spec, and the MLX and mlx-lm that quantize."""
    what = {"source": dict(digests), "spec": spec.key(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


class QuantizedSource(WeightSource):
    """The head's full-precision model, quantized by ``spec`` for nodes that lack it.

    Units are quantized when a node first needs them, one at a time
    (``shards/models/quantize.py``: the head never holds the full-precision model), into
    ``$MLXPIPE_HOME/quantized/<key>/``, a folder keyed by the content of the source
    (every unit's digest, its config) and the spec (``quantized_key``): a source changed
    in place is quantized afresh. From there they travel like any folder's units.
    One thread of its own does the MLX work (MLX arrays belong to the thread
    that made them), one unit after another. Hashes the whole source once (a blocking
    call: make it on a thread).
    """

    def __init__(self, full: WeightSource, spec: QuantSpec, rate: Optional[float] = None):
        self.full, self.source, self.spec = full, full.folder, spec
        self._mlx = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantize")
        config = self._mlx.submit(self._prepare).result()  # a lazy graph: nothing read yet
        folder = mlxpipe_home() / "quantized" / quantized_key(
            full.digests(full.units.values()) | full.file_digests(), spec)
        write_config(config, folder)
        super().__init__(folder, quantized_fingerprint(full.fingerprint, spec), full.num_layers, rate,
                         source_fingerprint=full.fingerprint)

    def _prepare(self) -> dict:
        self._model, config = prepare(self.source, self.spec, takes_images(self.source))
        return config

    def range_units(self, start: int, end: int) -> List[Unit]:
        return self._mlx.submit(self._range_units, start, end).result()

    def _range_units(self, start: int, end: int) -> List[Unit]:
        missing = [u for u in stage_units(self._model, start, end) if u not in self.units]
        if missing:
            logger.info("quantizing %s for layers [%d, %d): %s", self.source, start, end, ", ".join(missing))
            try:
                write_units(self._model, self.folder, missing)
            except QuantizeError:  # written and released before, but its file is gone: start afresh
                self._prepare()
                write_units(self._model, self.folder, missing)
            self.units = model_units(self.folder)
        return units_for_range(self.units, start, end, self.num_layers)

    def close(self) -> None:
        self._mlx.shutdown(wait=False)


def _holds(need: pb.WeightsNeed, offered: Dict[str, str], stage: int, address: str) -> int:
    """A node that answered that its own copy is the one offered must name the same digests
    (one that names none answered by name and size, as mlxpipe did before). Returns 0 (bytes sent)."""
    said = dict(need.local_digests)
    differ = sorted(n for n in offered if said.get(n) != offered[n])
    if differ:
        raise PipelineError(
            f"node {address} (stage {stage}) answered that it holds the head's model, but "
            + (f"its {', '.join(differ[:3])} differ{'s' if len(differ) == 1 else ''} from the head's"
               if said else "named no digests of it (another mlxpipe than the head's?)")
            + ": update the node, or remove its copy so that the head sends the layers", [address])
    return 0


def chunk_message(source: WeightSource, unit: str, index: int, data: bytes) -> pb.WeightChunk:
    """One chunk as it travels, with the checksum the node verifies."""
    return pb.WeightChunk(fingerprint=source.fingerprint, unit=unit, index=index, data=data,
                          sha256=hashlib.sha256(data).digest())


async def send_weights(stub, stage: int, address: str, offer: pb.WeightsOffer, source: WeightSource, md,
                       progress: bool = False) -> int:
    """Offer stage ``stage`` (``stub``, at ``address``) the units of its range; send the
    chunks it lacks (again, for any whose checksum failed). Returns the data bytes sent."""
    if isinstance(source, QuantizedSource):  # first ask whether the node quantizes its own copy
        full = source.full
        digests = await asyncio.to_thread(full.digests, full.range_units(offer.start, offer.end))
        offer.source_digests.update(digests | full.file_digests())
        need = await stub.Have(offer, timeout=TIMEOUT_S, metadata=md)
        if need.local:
            return _holds(need, dict(offer.source_digests), stage, address)
        offer.ClearField("source_digests")
    units = await asyncio.to_thread(source.range_units, offer.start, offer.end)
    digests = await asyncio.to_thread(source.digests, units)
    offer.units.extend(pb.WeightUnit(name=u.name, header=u.header(), data_bytes=u.data_bytes,
                                     digest=digests[u.name]) for u in units)
    need = await stub.Have(offer, timeout=TIMEOUT_S, metadata=md)
    if need.local:
        return _holds(need, digests | source.file_digests(), stage, address)
    by_name = {u.name: u for u in units}
    todo = [(n.name, list(n.chunks)) for n in need.units]
    total = sum(chunk_size(by_name[n].data_bytes, c) for n, cs in todo for c in cs)
    bar = Progress(f"weights to {address}", "B", total=total, terminal=progress) if total else None
    sent, t0 = 0, time.monotonic()

    async def chunks():
        nonlocal sent
        for name, indices in todo:
            for idx in indices:
                data = await asyncio.to_thread(by_name[name].read, idx, CHUNK_BYTES)
                message = chunk_message(source, name, idx, data)
                sent += len(data)
                if bar is not None:
                    bar.update(len(data))
                if source.rate:  # stay under the rate: sleep off any lead
                    ahead = sent / source.rate - (time.monotonic() - t0)
                    if ahead > 0:
                        await asyncio.sleep(ahead)
                yield message

    try:
        for _ in range(5):
            if not todo:
                break
            summary = await stub.Receive(chunks(), timeout=TIMEOUT_S, metadata=md)
            todo = [(r.name, list(r.chunks)) for r in summary.rejected]
        if todo:
            raise PipelineError(f"chunks for stage {stage} at {address} kept failing their checksum: {todo}",
                                [address])
    finally:
        if bar is not None:
            bar.close()
    logger.info("sent %.1f MB of weights to %s", sent / 1e6, address)
    return sent
