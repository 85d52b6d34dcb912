"""Weights for nodes that lack the model: the head's sources and the transfer.

Before ``Load``, the head offers each remote node the units of its range
(``Have``, ``shards/models/weights.py``); the node answers which chunks it lacks and
the head streams them (``Receive``), each with its SHA-256, at most ``rate``
bytes a second, and sends again what fails its checksum. With ``--bits`` what
travels is quantized (``QuantizedSource``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional


from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.core.transport import PipelineError
from mlxpipe.shards.models.progress import Progress
from mlxpipe.shards.models.quantize import QuantizeError, prepare, stage_units, write_config, write_units
from mlxpipe.shards.models.store import mlxpipe_home
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


class QuantizedSource(WeightSource):
    """The head's full-precision model, quantized by ``spec`` for nodes that lack it.

    Units are quantized when a node first needs them, one at a time
    (``shards/models/quantize.py``: the head never holds the full-precision model), into
    ``$MLXPIPE_HOME/quantized/<fingerprint>/``, a folder keyed by the source's
    fingerprint and the spec; from there they travel like any folder's units.
    One thread of its own does the MLX work (MLX arrays belong to the thread
    that made them), one unit after another.
    """

    def __init__(self, source: Path, source_fingerprint: str, spec: QuantSpec, num_layers: int,
                 rate: Optional[float] = None):
        self.source, self.spec = source, spec
        self._mlx = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantize")
        config = self._mlx.submit(self._prepare).result()  # a lazy graph: nothing read yet
        fp = quantized_fingerprint(source_fingerprint, spec)
        folder = mlxpipe_home() / "quantized" / fp
        write_config(config, folder)
        super().__init__(folder, fp, num_layers, rate, source_fingerprint=source_fingerprint)

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


def chunk_message(source: WeightSource, unit: str, index: int, data: bytes) -> pb.WeightChunk:
    """One chunk as it travels, with the checksum the node verifies."""
    return pb.WeightChunk(fingerprint=source.fingerprint, unit=unit, index=index, data=data,
                          sha256=hashlib.sha256(data).digest())


async def send_weights(stub, stage: int, address: str, offer: pb.WeightsOffer, source: WeightSource, md,
                       progress: bool = False) -> int:
    """Offer stage ``stage`` (``stub``, at ``address``) the units of its range; send the
    chunks it lacks (again, for any whose checksum failed). Returns the data bytes sent."""
    if source.source_fingerprint:  # quantized units: first ask whether the node quantizes its own copy
        if (await stub.Have(offer, timeout=TIMEOUT_S, metadata=md)).local:
            return 0
    units = await asyncio.to_thread(source.range_units, offer.start, offer.end)
    offer.units.extend(pb.WeightUnit(name=u.name, header=u.header(), data_bytes=u.data_bytes) for u in units)
    need = await stub.Have(offer, timeout=TIMEOUT_S, metadata=md)
    if need.local:
        return 0
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
