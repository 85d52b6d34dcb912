"""Reading a stage's weights, and naming what it computes with by content: a digest of
exactly the tensors it loaded.

A stage's tensors fall into units (``weights.py``: one per layer, ``embed``, ``head``): its
layers', ``embed`` if it is first (or last, with a head tied to the embedding) and ``head``
if last (``stage_units``). ``read_weights`` evaluates them one unit at a time on the MLX
thread and hands each to a ``Digester``, whose threads hash it while the MLX thread reads
the next (and then warms the stage up): MLX reads every byte from disk once, and the
threads hash it from memory (SHA-256, a tensor in pieces of ``PIECE_BYTES`` hashed in
parallel, with its name, dtype and shape). What is hashed is what the stage computes with: a range quantized on load,
quantized; weights received from the head, as received; every model after mlx-lm's
``sanitize``. A layer's tensors are named as in their block, so a layer's digest is the
same on any stage. The config the model was built from is one more unit (``config``):
it shapes the computation too. The tokenizer is not: the KV of a token sequence depends
on the weights and the config only.

``WeightsDigest.units`` holds each unit's digest; ``WeightsDigest.stage`` names the
stage's weights (its prefix cache's disk tier is a directory of that name,
``shards/cache/tier_dirs.py``). The head salts every prefix-cache key with all stages'
units (``server/core/prefix_index.model_salt``): a changed tensor in any stage's range,
another quantization or another config is another salt, and so a miss, never a wrong
hit; a re-plan that moves layers between stages keeps the salt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxpipe.shards.models.progress import Progress
from mlxpipe.shards.models.weights import range_unit_names, unit_of

if TYPE_CHECKING:
    from mlxpipe.shards.models.slicing import SlicedModel

logger = logging.getLogger(__name__)

PIECE_BYTES = 16 << 20  # one hashing job: a larger tensor is hashed in pieces, on several threads
THREADS = min(8, max(1, (os.cpu_count() or 2) - 2))  # hashing threads beside the MLX thread (and its readers)
CONFIG = "config"       # the unit of the config


def combine(units: Mapping[str, str]) -> str:
    """One SHA-256 (hex) of units and their digests, in the order of their names."""
    return hashlib.sha256("".join(f"{u}={d}\n" for u, d in sorted(units.items())).encode()).hexdigest()


@dataclass(frozen=True)
class WeightsDigest:
    """What one stage computes with (module docstring)."""

    units: Dict[str, str]  # unit (layer-NNNNN, embed, head, config) -> SHA-256 hex of its tensors as loaded
    nbytes: int = field(default=0, compare=False)      # bytes hashed
    wait_s: float = field(default=0.0, compare=False)  # how long the hashing outlasted the reading

    @property
    def stage(self) -> str:
        """The stage's own digest (32 hex digits): of its units, so of its range, its
        weights, their quantization and its config."""
        return combine(self.units)[:32]

    def agrees(self, other: Mapping[str, str], start: int, end: int) -> bool:
        """Whether ``other`` (another stage's units) has this config and these layers ``[start, end)``."""
        names = [CONFIG] + [f"layer-{i:05d}" for i in range(start, end)]
        return all(n in self.units and other.get(n) == self.units[n] for n in names)


def _sha256(data) -> bytes:
    return hashlib.sha256(data).digest()


def _raw(arr: mx.array):
    """An evaluated array's bytes in row-major order (without a copy where they lie so)."""
    if arr.size == 0:
        return b""
    view = memoryview(arr)
    if not view.c_contiguous:
        arr = mx.contiguous(arr)
        mx.eval(arr)
        view = memoryview(arr)
    return view.cast("B") if view.ndim else bytes(view)


class Digester:
    """Hashes evaluated tensors on threads of its own, unit by unit (module docstring)."""

    def __init__(self, threads: int = THREADS, label: str = "weights"):
        self._pool = ThreadPoolExecutor(max(threads, 1), thread_name_prefix="weights-digest")
        self._units: Dict[str, List[Tuple[str, str, Tuple[int, ...], List[Future]]]] = {}
        self.nbytes = 0
        self.label = label  # what it hashes, for the log line

    def add(self, unit: str, tensors: Mapping[str, mx.array]) -> None:
        """Hash ``tensors`` (evaluated, by name) as part of ``unit`` (on the MLX thread: the
        threads only read the bytes)."""
        entries = self._units.setdefault(unit, [])
        for name in sorted(tensors):
            arr = tensors[name]
            raw = _raw(arr)
            pieces = [self._pool.submit(_sha256, raw[i:i + PIECE_BYTES])
                      for i in range(0, len(raw), PIECE_BYTES)] or [self._pool.submit(_sha256, b"")]
            entries.append((name, str(arr.dtype), tuple(arr.shape), pieces))
            self.nbytes += len(raw)

    def result(self, config: Optional[dict] = None) -> WeightsDigest:
        """Every unit's digest (and the ``config``'s), once the threads are done (once only)."""
        t0 = time.perf_counter()
        units = {}
        try:
            for unit, entries in self._units.items():
                h = hashlib.sha256()
                for name, dtype, shape, pieces in entries:
                    h.update(f"{name}\0{dtype}\0{shape}\0{len(pieces)}\0".encode())
                    for piece in pieces:
                        h.update(piece.result())
                units[unit] = h.hexdigest()
        finally:
            self.close()
        if config is not None:
            units[CONFIG] = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
        digest = WeightsDigest(units, self.nbytes, time.perf_counter() - t0)
        logger.info("%s: weights digest %s, %.1f MB hashed (waited %.2f s for it)", self.label, digest.stage,
                    digest.nbytes / 1e6, digest.wait_s)
        return digest

    def close(self) -> None:
        """Let the threads go (what they were still to hash is dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def stage_units(stage: "SlicedModel") -> Dict[str, Dict[str, mx.array]]:
    """The tensors ``stage`` computes with, by unit (lazy until read): each of its blocks'
    (named as in the block), and of the rest of the model ``embed`` if it is first (or
    last with a tied head) and ``head`` if last, as the head sends weights (``weights.py``)."""
    units = {f"layer-{stage.start + i:05d}": dict(tree_flatten(block.parameters()))
             for i, block in enumerate(stage.blocks)}
    own = {id(a) for tensors in units.values() for a in tensors.values()}
    rest: Dict[str, Dict[str, mx.array]] = {}
    for name, arr in tree_flatten(stage.model.parameters()):
        if id(arr) not in own:
            rest.setdefault(unit_of(name), {})[name] = arr
    tied = not any("lm_head" in name for name in rest.get("head", {}))
    for unit in range_unit_names(stage.start, stage.end, stage.num_layers, tied):
        if unit in rest:
            units[unit] = rest[unit]
    return units


def read_weights(stage: "SlicedModel", progress: bool = False, threads: int = THREADS) -> Digester:
    """Read the stage's units from disk one at a time (``progress``: saying how far in
    layers), each hashed on ``threads`` threads while the next is read. Returns the
    ``Digester``, still hashing: its ``result`` (with the config the model was built
    from) waits for the last, so that a caller may warm the stage up meanwhile."""
    shown = Progress(f"reading layers [{stage.start}, {stage.end})", "layers", total=len(stage.blocks)) \
        if progress else None
    digester = Digester(threads, f"layers [{stage.start}, {stage.end})")
    try:
        for unit, tensors in stage_units(stage).items():
            mx.eval(list(tensors.values()))
            digester.add(unit, tensors)
            if shown is not None and unit.startswith("layer"):
                shown.update()
    except BaseException:
        digester.close()
        raise
    finally:
        if shown is not None:
            shown.close()
    return digester
