"""How a full-precision model is quantized: the bits of every layer, as the head, the
planner and the stages name them. Pure Python (no MLX, no protobuf: the wire form is
``wire.py``'s); ``models/quantize.py`` does the work.

A *rung* is one way to quantize a layer: a number of bits (``"4"``: MLX's affine
quantization, a 16-bit scale and bias per group of ``group_size`` weights) or one
of mlx-lm's mixed recipes (``"mixed_3_6"``: low bits, high bits for the value and
down projections of some layers and the output head, as ``mlx_lm.convert
--quant-predicate`` does). A ``QuantSpec`` gives the embedding, the head and
every layer one rung, and may give layers rungs of their own (``layer_bits``),
which mlx-lm records as per-module entries of the config's ``quantization``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

BITS = ("2", "3", "4", "5", "6", "8")  # what MLX's affine quantization takes
RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")  # mlx-lm's QUANT_RECIPES (a test checks)
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64
# What `--bits auto` may choose from: 8/6/4/3 bits and mlx-lm's recipes that lie in between
# (mixed_2_6 and 2 bits cost too much quality to pick unasked).
AUTO_RUNGS = ("8", "6", "mixed_4_6", "4", "mixed_3_6", "mixed_3_4", "3")


def check_rung(rung: str) -> str:
    """``rung`` if it names bits MLX takes or an mlx-lm recipe; else a ValueError that says what does."""
    if rung not in BITS and rung not in RECIPES:
        raise ValueError(f"bits {rung!r}: give one of {', '.join(BITS)}, or a mixed recipe "
                         f"({', '.join(RECIPES)}), or 'auto'")
    return rung


def rung_bits(rung: str) -> Tuple[int, int]:
    """(low, high) bits of a rung: ``"4"`` -> (4, 4), ``"mixed_3_6"`` -> (3, 6)."""
    if rung in RECIPES:
        low, high = rung.split("_")[1:]
        return int(low), int(high)
    return int(rung), int(rung)


@dataclass(frozen=True)
class QuantSpec:
    """The rung of every part of a model (see the module docstring)."""

    bits: str                                   # embedding, head, and every layer not in layer_bits
    group_size: int = DEFAULT_GROUP_SIZE        # weights per scale and bias
    layer_bits: Optional[Tuple[str, ...]] = None  # one rung per layer, or None: all at `bits`

    def __post_init__(self) -> None:
        check_rung(self.bits)
        for r in self.layer_bits or ():
            check_rung(r)
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group size {self.group_size}: give one of {', '.join(map(str, GROUP_SIZES))}")
        if self.layer_bits is not None and self.layer_bits == (self.bits,) * len(self.layer_bits):
            object.__setattr__(self, "layer_bits", None)  # one spelling per spec: uniform has no list

    @classmethod
    def parse(cls, bits: str, group_size: Optional[int] = None,
              layer_bits: Optional[Sequence[str]] = None) -> "QuantSpec":
        """From the command line: ``--bits 4`` (or a recipe), ``--group-size``, per-layer rungs."""
        return cls(check_rung(str(bits).strip()), group_size or DEFAULT_GROUP_SIZE,
                   tuple(str(b).strip() for b in layer_bits) if layer_bits else None)

    def layer(self, i: int) -> str:
        """The rung of layer ``i``."""
        return self.layer_bits[i] if self.layer_bits is not None else self.bits

    def check_layers(self, num_layers: int) -> None:
        if self.layer_bits is not None and len(self.layer_bits) != num_layers:
            raise ValueError(f"per-layer bits name {len(self.layer_bits)} layers; the model has {num_layers}")

    def key(self) -> str:
        """A canonical text of the spec (what cached quantized weights are filed under)."""
        return json.dumps({"bits": self.bits, "group_size": self.group_size,
                           "layer_bits": list(self.layer_bits) if self.layer_bits else None}, sort_keys=True)

    def describe(self) -> str:
        """``4-bit, group 64``; ``mixed_3_6, group 64``; or the count of layers at each rung."""
        name = lambda r: f"{r}-bit" if r in BITS else r  # noqa: E731
        if self.layer_bits is None:
            return f"{name(self.bits)}, group {self.group_size}"
        counts = {}
        for r in self.layer_bits:
            counts[r] = counts.get(r, 0) + 1
        parts = ", ".join(f"{n} layers {name(r)}" for r, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        return f"{parts}; embedding and head {name(self.bits)}; group {self.group_size}"


def quantized_fingerprint(source_fingerprint: str, spec: Optional[QuantSpec]) -> str:
    """What a model quantized by ``spec`` is known by: the source's fingerprint and the spec."""
    if spec is None:
        return source_fingerprint
    return hashlib.sha256(f"{source_fingerprint}:{spec.key()}".encode()).hexdigest()[:16]


# -- the KV cache ---------------------------------------------------------------------

KV_BITS = (16, 8, 4)  # the KV precisions `mlxpipe plan` tabulates (16: the model's dtype, unquantized)


def kv_bytes(values: int, bits: int = 16, group_size: int = DEFAULT_GROUP_SIZE, dtype_bytes: int = 2) -> int:
    """Bytes of ``values`` cached keys and values at ``bits``, as mlx-lm's ``QuantizedKVCache``
    holds them: at 16, as computed (``dtype_bytes`` each); at fewer, ``bits``/8 bytes a value
    plus a scale and a bias in the KV dtype per ``group_size`` values (groups run along the
    head dimension: one position's vectors quantize alone)."""
    if bits >= 16:
        return values * dtype_bytes
    if str(bits) not in BITS:
        raise ValueError(f"KV bits {bits}: give 16 (unquantized) or one of {', '.join(BITS)}")
    return -(-values * bits // 8) + -(-values // group_size) * 2 * dtype_bytes
