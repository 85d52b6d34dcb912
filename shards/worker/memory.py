"""A stage's memory: what a shard will need before it is loaded, and the process's real peak.

The bound a stage keeps (measured at two shard sizes in docs/multi-mac.md):

    peak resident memory <= weights + max(KV budget, read transient) + fixed overhead

- weights: the range's tensors (``range_weights``: from the safetensors headers,
  nothing read; quantized on load, at the bits they get);
- KV budget: the KV-cache cap the head asked for (``LoadRequest.max_cache_bytes``);
  caches fill it only once the stage serves;
- read transient: what loading adds for a moment, before any cache exists.
  Reading as stored, one block at a time, at most about the largest tensor
  (warm-up's one token, MLX's allocator); quantizing on load, one module at
  full precision (MoE experts stacked, through float32: ``quantize.py``);
- fixed overhead: the interpreter and its libraries (about 100 MiB resident:
  MLX, mlx-lm with transformers, gRPC, protobuf, llguidance, numpy), on the last
  stage llguidance's tokenizer for grammars (about 20x its tokenizer.json: 70
  MiB for a 49k vocabulary), and the memory-bandwidth probe a node runs once,
  before any shard (``profile.memory_bandwidth``: 128 MiB, then given back).

A stage refuses a plan whose weights and KV budget (or read transient) exceed
the memory it offers (``--memory``; by default 75% of RAM, on Apple silicon at
most 90% of what the GPU may wire: ``metal.py``): ``check`` raises
``MemoryShort`` before anything is read, and Load answers RESOURCE_EXHAUSTED.
The fixed overhead comes on top of the budget; the default share leaves room.
Pure Python and file reads (headers only): no MLX.
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Optional

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.shards.models.store import text_config
from mlxpipe.shards.models.weights import LAYER_RE, model_units, units_for_range
from mlxpipe.shards.params.quant import QuantSpec, rung_bits

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}


_EXPERT = re.compile(r"\.experts\.\d+\.")


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


class MemoryShort(ValueError):
    """A shard whose weights and KV budget would not fit the memory this node offers."""


def process_peak_bytes() -> int:
    """The process's peak resident memory so far. Linux: ``VmHWM``, since ``ru_maxrss``
    keeps the parent's resident size at fork across exec (a stage a head started would
    report the head's); macOS: ``ru_maxrss``, in bytes there."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def resident_bytes() -> int:
    """The process's resident memory now (Linux: /proc; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return process_peak_bytes()


def load_peak_bytes(resident_before: int, mlx_peak_over_before: int) -> int:
    """The real peak of a process that was at ``resident_before`` when loading began.
    MLX's own peak counts too: Metal's buffers need not show in the resident size."""
    return max(process_peak_bytes(), resident_before + mlx_peak_over_before)


@dataclass(frozen=True)
class StageNeed:
    """What a shard will take, in bytes: its weights, and beside them its KV budget (once
    serving) or what reading adds (while loading, before any cache exists)."""

    weights: int
    kv: int
    transient: int

    @property
    def total(self) -> int:
        return self.weights + max(self.kv, self.transient)

    def check(self, budget: int, what: str) -> None:
        """Raise ``MemoryShort`` when the shard does not fit ``budget``; ``what`` names it."""
        if self.total <= budget:
            return
        beside = (f"{_size(self.kv)} of KV cache" if self.kv >= self.transient
                  else f"{_size(self.transient)} more while reading")
        raise MemoryShort(f"{what} needs {_size(self.weights)} of weights + {beside} = {_size(self.total)}, more "
                          f"than the {_size(budget)} this node offers (mlxpipe node --memory): give it fewer "
                          "layers or a smaller KV cache")


def _quantized_bytes(nbytes: int, dtype: str, shape, bits: int, group: int) -> int:
    """A tensor's bytes once quantized (a matrix whose rows divide into groups), else as stored."""
    itemsize = _ITEMSIZE.get(dtype, 2)
    if len(shape) < 2 or shape[-1] % group:
        return nbytes
    params = nbytes // itemsize
    return params * bits // 8 + params // group * 4  # a 16-bit scale and bias per group


def range_weights(path: Path, start: int, end: int, quant: Optional[QuantSpec] = None,
                  mtp: bool = False) -> StageNeed:
    """Weights and read transient of layers ``[start, end)`` of the folder ``path``
    (the embedding and head where the stage holds them, and the MTP head where it drafts
    with it), from the headers alone."""
    config = text_config(json.loads((path / "config.json").read_text()))
    layers = int(config["num_hidden_layers"])
    units = units_for_range(model_units(path), start, end, layers, mtp)
    tensors = [t for u in units for t in u.tensors]
    if quant is None:
        weights = sum(t.nbytes for t in tensors)
        return StageNeed(weights, 0, max((t.nbytes for t in tensors), default=0))
    weights = 0
    for t in tensors:
        m = LAYER_RE.search(t.name)
        bits = rung_bits(quant.layer(int(m.group(1))) if m and int(m.group(1)) < layers else quant.bits)[1]
        weights += _quantized_bytes(t.nbytes, t.dtype, t.shape, bits, quant.group_size)
    # One module at a time at full precision: a projection of all experts stacked (from per-expert
    # tensors, as mlx-lm's sanitize stacks them), about three times its bf16 size while it is built.
    modules: Dict[str, int] = {}
    for t in tensors:
        key = _EXPERT.sub(".experts.*.", t.name)
        modules[key] = modules.get(key, 0) + t.nbytes * 2 // _ITEMSIZE.get(t.dtype, 2)
    return StageNeed(weights, 0, 3 * max(modules.values(), default=0))


def check_load(path: Path, request: pb.LoadRequest, quant: Optional[QuantSpec], budget: int,
               ranks: int = 1) -> StageNeed:
    """Raise ``MemoryShort`` when the shard ``request`` names would not fit ``budget``; else
    return what it needs (``ranks``: a tensor-parallel group's, each holding about its share of
    the weights, and reading each tensor whole before it slices it). A range or folder that
    cannot be read is left for loading to report."""
    try:
        need = range_weights(path, request.start, request.end, quant, request.mtp)
    except (OSError, ValueError, KeyError):
        return StageNeed(0, 0, 0)
    need = replace(need, weights=need.weights // ranks, kv=request.max_cache_bytes)
    need.check(budget, f"layers [{request.start}, {request.end})")
    return need
