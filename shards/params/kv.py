"""KV-cache quantization, as mlx-lm's ``generate_step(kv_bits=...)`` does it. Pure Python (no MLX, no
protobuf: the wire form is ``wire.py``'s).

mlx-lm keeps a sequence's keys and values at full precision until a model call
leaves its cache at ``quantized_kv_start`` positions or more; then
``maybe_quantize_kv_cache`` turns every ``KVCache`` into a ``QuantizedKVCache``
(``mx.quantize``: ``bits`` per value, a scale and a bias per ``group_size``
values along the head dimension, so each position quantizes on its own), and
every later position is quantized as it is written and attended in that form.
Where the switch falls depends on the calls: ``generate_step`` prefills all but
the last prompt token in chunks of ``prefill_step_size`` (2048) and checks after
each call, so the switch is the end of the first of its calls that reaches
the start (``quantize_at``). Positions before it were computed against
full-precision keys, positions from it on against quantized ones.

A pipeline matches that exactly when every stage switches a sequence at the
same position and no frame crosses it: the head computes the position from
the prompt's length (``quantize_at``), names it in the sequence's first frame
(``SeqEntry.kv_quantize_at``), cuts prefill chunks there and keeps speculation
short of it until it is confirmed; a stage turns the sequence's caches before
the first frame that starts at or past it. ``shards/cache/quantized.py`` holds
the MLX side (the batched quantized cache, the conversions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mlxpipe.shards.params.quant import GROUP_SIZES, KV_BITS

QUANTIZED_KV_BITS = tuple(b for b in KV_BITS if b < 16)  # 8, 4 (16: the model's dtype, not quantized)
DEFAULT_KV_GROUP_SIZE = 64      # mlx-lm's generate_step default (a test checks)
DEFAULT_QUANTIZED_KV_START = 5000  # mlx_lm.generate.DEFAULT_QUANTIZED_KV_START (a test checks)
PREFILL_STEP = 2048             # generate_step's prefill_step_size default: where its prefill calls end

KV_BITS_HELP = ("bits of each cached key and value: 16 (the model's dtype, unquantized: the default), or 8 or 4 as "
                "mlx-lm's --kv-bits (QuantizedKVCache: a scale and bias per --kv-group-size values of each "
                "position); caches that cannot be (MLA latents, rotating windows, state-space arrays) stay as "
                "they are. The planner counts the KV cache at these bits")
KV_GROUP_SIZE_HELP = "values per scale and bias of a quantized KV cache (default %(default)s, as mlx-lm)"
KV_START_HELP = ("a sequence's KV cache turns quantized where mlx-lm's generate_step would turn it: after its first "
                 "model call that reaches this many positions (default %(default)s, as mlx-lm)")


@dataclass(frozen=True)
class KvQuant:
    """How a stage quantizes its positional KV caches."""

    bits: int                                 # 8 or 4 (QUANTIZED_KV_BITS)
    group_size: int = DEFAULT_KV_GROUP_SIZE   # values per scale and bias, along the head dimension
    start: int = DEFAULT_QUANTIZED_KV_START   # mlx-lm's quantized_kv_start

    def __post_init__(self):
        if self.bits not in QUANTIZED_KV_BITS:
            raise ValueError(f"kv bits {self.bits}: give 8 or 4")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"kv group size {self.group_size}: give 32, 64 or 128")
        if self.start < 0:
            raise ValueError(f"quantized kv start {self.start}: give 0 or more")

    @classmethod
    def of(cls, bits: Optional[int], group_size: int = DEFAULT_KV_GROUP_SIZE,
           start: int = DEFAULT_QUANTIZED_KV_START) -> Optional["KvQuant"]:
        """The settings for ``bits`` (None or 16: no KV quantization)."""
        return None if not bits or bits == 16 else cls(bits, group_size, start)

    def __str__(self) -> str:
        return f"{self.bits}-bit KV (group {self.group_size}, from position {self.start})"


def quantize_at(prompt_len: int, start: int, step: int = PREFILL_STEP) -> int:
    """The position at which mlx-lm's ``generate_step`` turns the cache of a prompt of
    ``prompt_len`` tokens quantized: the end of its first model call that reaches ``start``
    positions. Its calls end at ``step``, 2 ``step``, ... below ``prompt_len - 1``, then at
    ``prompt_len - 1`` (the prefill), then at ``prompt_len``, ``prompt_len + 1``, ... (the last
    prompt token, then one call per generated token)."""
    body = prompt_len - 1
    if body > 0:
        first = max(1, -(-start // step)) * step
        if first < body:
            return first
        if body >= start:
            return body
    return max(start, prompt_len, 1)

