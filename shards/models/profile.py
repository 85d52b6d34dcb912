"""How fast this node runs a model: one block of each kind, the embedding, the head.

The planner needs seconds per decode step for each layer and for the first
and last stages' extras. A profile times, on a batch of ``batch`` rows of one
token each, one block of every kind the model has (blocks alike in class and
sub-module classes cost alike), the first block with the embedding, and the
last block with the final norm, output head and sampling; each kind and the
embedding also on one row's prompt chunk of ``PREFILL_TOKENS`` positions (per
prompt token; no head: an unsampled chunk reads only its caches on the last
stage), for the planner's prefill cost; and one block on a single row too, to
tell what extra rows cost (``row_cost``: near 1 where a step's time grows with
its rows, as on CPUs; near 0 where reading the weights dominates, as on Apple
silicon). Where a model's structure forbids some cuts (``cuts.py``), what is
timed is a unit of blocks that can run as a stage, never one that cannot.
Each measurement loads just the blocks it runs. Results are cached
per model fingerprint, node and batch under ``$MLXPIPE_HOME/profiles``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from mlxpipe.shards.cache import kinds
from mlxpipe.shards.models.cuts import Cuts, of_model
from mlxpipe.shards.models.layers import layer_list, with_sizes
from mlxpipe.shards.models.metal import Metal
from mlxpipe.shards.models.slicing import load_stage
from mlxpipe.shards.models.store import mlxpipe_home, text_config
from mlxpipe.shards.params.quant import QuantSpec

logger = logging.getLogger(__name__)

PREFILL_TOKENS = 128  # a prompt chunk's positions, as timed for the planner's prefill cost
MEMORY_SHARE = 0.75  # of physical memory a node offers by default (macOS's default GPU wired limit)


def node_name() -> str:
    return f"{platform.node()}-{platform.machine()}"


def total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def offered_memory(given: Optional[int] = None) -> int:
    """Bytes this node offers for weights and caches: ``given``, or a share of physical
    memory (on Apple silicon, no more than 90% of what the GPU may wire: ``metal.py``)."""
    return given or Metal().budget(int(total_memory() * MEMORY_SHARE))


@functools.lru_cache(maxsize=None)
def memory_bandwidth(megabytes: int = 128) -> float:
    """Bytes per second this node moves through memory (read + write), measured once per process.

    ``a = a + 1`` on an array nothing else holds: MLX donates the input's buffer to the
    output, so the probe streams through one buffer in place (larger than any Apple
    silicon system cache) and never holds two; nor does a fresh output's first touch count."""
    a = mx.ones((megabytes << 18,), dtype=mx.float32)
    mx.eval(a)
    best = float("inf")
    for _ in range(4):
        t0 = time.perf_counter()
        a = a + 1
        mx.eval(a)
        best = min(best, time.perf_counter() - t0)
    del a
    mx.clear_cache()
    return 2 * (megabytes << 20) / best


def block_kind(block: nn.Module) -> str:
    """Blocks of one class with the same classes of sub-modules cost the same."""
    parts = sorted(f"{k}:{type(v).__name__}" for k, v in block.children().items() if isinstance(v, nn.Module))
    return f"{type(block).__name__}({','.join(parts)})"


def _time_range(path: Path, start: int, end: int, batch: int, hidden_size: int, repeats: int,
                quant: Optional[QuantSpec], prefill: int = 0) -> Tuple[float, float]:
    """Seconds of a decode step of ``batch`` rows through ``[start, end)``, and (with ``prefill``)
    per prompt token of one row's chunk of ``prefill`` tokens (no head: a prefill chunk samples nothing)."""
    stage, _ = load_stage(path, start, end, quant=quant)

    def once(rows: int, positions: int, head: bool) -> float:
        tokens = mx.zeros((rows, positions), dtype=mx.int32)
        hidden = None if stage.first else mx.zeros((rows, positions, hidden_size), dtype=mx.float32)
        caches = stage.make_cache()
        t0 = time.perf_counter()
        out = stage(tokens, hidden, caches)
        if stage.last and head:  # what sampling adds: log-softmax and a pick per row
            logits = out[:, -1, :]
            out = mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)
        elif stage.last:
            out = kinds.arrays(caches)  # the chunk's work, as the stage does it: its caches, not its logits
        mx.eval(out)
        return time.perf_counter() - t0

    def timed(rows: int, positions: int, head: bool) -> float:
        once(rows, positions, head)  # reads the weights and compiles kernels
        return statistics.median(once(rows, positions, head) for _ in range(repeats))

    step = timed(batch, 1, True)
    return step, (timed(1, prefill, False) / prefill if prefill else 0.0)


def _structure(path: Path) -> Tuple[List[str], Cuts, int]:
    """The kind of each block, the valid cuts and the hidden size, from the model built lazily."""
    from mlx_lm.utils import load_model

    from mlxpipe.shards.models.mtp import without_mtp

    model, config = load_model(path, lazy=True, get_model_classes=without_mtp)
    kinds_of = [block_kind(b) for b in layer_list(model)]
    cuts = of_model(model, config.get("model_type", ""))
    return kinds_of, cuts, int(with_sizes(text_config(config))["hidden_size"])


def _inner(units: List[Tuple[int, int]], n: int) -> Tuple[int, int]:
    """The middle one of ``units`` that holds neither the embedding nor the head (if any does not)."""
    inner = [u for u in units if u[0] > 0 and u[1] < n] or units
    return inner[len(inner) // 2]


def _unit_kinds(kinds_of: List[str], units: List[Tuple[int, int]]) -> Dict[tuple, List[Tuple[int, int]]]:
    """Units alike in the kinds of their blocks cost alike: unit kind -> its units."""
    out: Dict[tuple, List[Tuple[int, int]]] = {}
    for a, b in units:
        out.setdefault(tuple(kinds_of[a:b]), []).append((a, b))
    return out


def profile(path: Path, fingerprint: str, batch: int = 8, repeats: int = 3,
            quant: Optional[QuantSpec] = None) -> Dict:
    """Seconds per decode step of ``batch`` rows: per layer, embedding, head. With
    ``quant``, of the blocks quantized so (``fingerprint`` should say so too).

    What is timed runs as a stage would: a *unit* (the blocks between two valid cuts,
    ``cuts.py``; one block where every cut is valid), one of each kind of unit, and
    the first and last with the embedding and the head. A unit of several blocks
    shares its time among them evenly (the planner never cuts inside it)."""
    cache_file = mlxpipe_home() / "profiles" / f"{fingerprint}-{node_name()}-b{batch}.json"
    if cache_file.exists():
        cached = json.loads(cache_file.read_text())
        if "units" in cached:  # (older profiles lack the valid cuts: measure again)
            return cached | {"cached": True}
    kinds_of, cuts, hidden = _structure(path)
    n, units = len(kinds_of), cuts.units()
    timed: Dict[Tuple[int, int], Tuple[float, float]] = {}  # unit -> (decode step, prefill per token)

    def unit_time(u: Tuple[int, int], prefill: int = PREFILL_TOKENS) -> Tuple[float, float]:
        if u not in timed:
            timed[u] = _time_range(path, u[0], u[1], batch, hidden, repeats, quant, prefill)
        return timed[u]

    layer_seconds, prefill_seconds = [0.0] * n, [0.0] * n
    alike = _unit_kinds(kinds_of, units)
    for group in alike.values():
        step, pre = unit_time(_inner(group, n))
        for a, b in group:
            for i in range(a, b):
                layer_seconds[i], prefill_seconds[i] = step / (b - a), pre / (b - a)
    first, last = units[0], units[-1]
    step0, pre0 = unit_time(first)
    last_step = unit_time(last)[0]  # (the first's, when the model is one unit)
    middle = _inner(max(alike.values(), key=len), n)  # timed above, at `batch` rows
    one_row = _time_range(path, middle[0], middle[1], 1, hidden, repeats, quant)[0]
    row_cost = (timed[middle][0] / one_row - 1) / (batch - 1) if batch > 1 and one_row > 0 else 1.0
    result = {
        "layer_seconds": layer_seconds,
        "row_cost": min(max(row_cost, 0.0), 1.0),
        "embed_seconds": max(step0 - sum(layer_seconds[first[0]:first[1]]), 0.0),
        "head_seconds": max(last_step - sum(layer_seconds[last[0]:last[1]]), 0.0),
        "prefill_layer_seconds": prefill_seconds,
        "prefill_embed_seconds": max(pre0 - sum(prefill_seconds[first[0]:first[1]]), 0.0),
        "prefill_tokens": PREFILL_TOKENS,
        "units": [list(u) for u in units],
        "batch": batch,
        "node": node_name(),
    }
    mx.clear_cache()
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    cache_file.write_text(json.dumps(result))
    logger.info("profiled %s: %.1f ms per layer (median), head %.1f ms, batch %d; prefill %.2f ms per layer "
                "and prompt token; %s", path, 1000 * statistics.median(layer_seconds), 1000 * result["head_seconds"],
                batch, 1000 * statistics.median(prefill_seconds), cuts.describe())
    return result | {"cached": False}
