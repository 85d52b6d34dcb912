"""Quantized KV caches on a stage: mlx-lm's ``QuantizedKVCache``, its batched form, and when
a sequence's caches turn quantized (``kv_quant.py`` says where and why there).

mlx-lm quantizes one sequence's cache (``KVCache.to_quantized``, ``QuantizedKVCache``) but
has no batched quantized cache; ``BatchQuantizedKVCache`` is ``BatchKVCache`` with each of
keys and values kept as mx.quantize's (packed, scales, biases), under the same
left-padding rules (``merge``, ``extend``, ``filter``, ``extract``, ``trim``,
``make_mask``). Quantization is group-wise along the head dimension, so every position
of every row is quantized on its own: a row of a batch holds exactly the bits the
sequence alone would, and mlx-lm's attention (``base.scaled_dot_product_attention``,
which takes any cache with ``bits``) reads it as it reads ``QuantizedKVCache``.

Only plain ``KVCache`` slots turn quantized, as in ``maybe_quantize_kv_cache``; rotating
windows, state-space arrays and lists of caches stay as they are, and a model whose
attention cannot read quantized keys (MLA's latent caches, DeepSeek-V3) keeps its caches
at full precision: ``check`` finds out by running a position through the range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache, _BaseCache

from mlxpipe.proto.errors import FrameError
from mlxpipe.shards.params.kv import KvQuant

Triple = Tuple[mx.array, mx.array, mx.array]  # mx.quantize's packed values, scales, biases


def _map(f: Callable, *triples: Triple) -> Triple:
    return tuple(f(*xs) for xs in zip(*triples))


class BatchQuantizedKVCache(_BaseCache):
    """``BatchKVCache`` with quantized keys and values (rows left-padded to a common length)."""

    step = 256

    def __init__(self, left_padding: List[int], group_size: int = 64, bits: int = 8):
        self.keys: Optional[Triple] = None
        self.values: Optional[Triple] = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self.group_size, self.bits = group_size, bits

    def _zeros(self, shape: tuple, dim: int, dtype) -> Triple:
        per_int = 32 // self.bits
        return (mx.zeros((*shape, dim // per_int), dtype=mx.uint32),
                mx.zeros((*shape, dim // self.group_size), dtype=dtype),
                mx.zeros((*shape, dim // self.group_size), dtype=dtype))

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, H, n, dk = keys.shape
        prev = self._idx
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            grow = (self.step + n - 1) // self.step * self.step
            new_k = self._zeros((B, H, grow), dk, keys.dtype)
            new_v = self._zeros((B, H, grow), values.shape[3], keys.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                if prev % self.step:
                    self.keys, self.values = (_map(lambda x: x[..., :prev, :], t) for t in (self.keys, self.values))
                cat = lambda a, b: mx.concatenate([a, b], axis=2)  # noqa: E731
                self.keys, self.values = _map(cat, self.keys, new_k), _map(cat, self.values, new_v)
        self.offset = self.offset + n
        self._idx += n
        for mine, new in ((self.keys, keys), (self.values, values)):
            for x, q in zip(mine, mx.quantize(new, group_size=self.group_size, bits=self.bits)):
                x[..., prev:self._idx, :] = q
        return self.keys_and_values()

    def keys_and_values(self):
        return tuple(_map(lambda x: x[..., : self._idx, :], t) for t in (self.keys, self.values))

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices) -> None:
        """Keep rows ``batch_indices`` (in that order), dropping padding no row needs."""
        if self.keys is not None:
            self.keys, self.values = (_map(lambda x: x[batch_indices], t) for t in (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = (_map(lambda x: x[..., shift:, :], t) for t in (self.keys, self.values))
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: "BatchQuantizedKVCache") -> None:
        """Append ``other``'s rows, both right-justified at the longer one's index."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like = self if self.keys is not None else other

        def pad(c: "BatchQuantizedKVCache"):
            if c.keys is None:
                rows = c.offset.shape[0]
                empty = lambda t: _map(lambda x: mx.zeros((rows, *x.shape[1:2], 0, x.shape[3]), x.dtype), t)  # noqa
                k, v = empty(like.keys), empty(like.values)
            else:
                k, v = c.keys, c.values
            left = idx - c._idx
            right = size - k[0].shape[2] - left
            if right < 0:
                k, v = (_map(lambda x: x[..., :right, :], t) for t in (k, v))
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k, v = (_map(lambda x: mx.pad(x, widths), t) for t in (k, v))
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = pad(self), pad(other)
        cat = lambda a, b: mx.concatenate([a, b])  # noqa: E731
        self.keys, self.values = _map(cat, k1, k2), _map(cat, v1, v2)
        self.offset, self.left_padding = cat(o1, o2), cat(p1, p2)
        self._idx = idx

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row ``idx`` as a cache of its own."""
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        pad = self.left_padding.tolist()[idx]
        if self.keys is not None:
            cache.keys, cache.values = (_map(lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self._idx]), t)
                                        for t in (self.keys, self.values))
        cache.offset = self._idx - pad
        return cache

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> "BatchQuantizedKVCache":
        """One batched cache of ``caches`` (left-padded to the longest, as ``BatchKVCache.merge``)."""
        group_size, bits = caches[0].group_size, caches[0].bits
        if any((c.group_size, c.bits) != (group_size, bits) for c in caches):
            raise ValueError("caches quantized differently cannot share a batch")
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), group_size, bits)
        full = [c for c in caches if c.keys is not None]
        B, H = len(caches), full[0].keys[0].shape[1]
        out = cls([longest - n for n in lengths], group_size, bits)
        out.keys, out.values = (_map(lambda x: mx.zeros((B, H, longest, x.shape[3]), x.dtype), t)
                                for t in (full[0].keys, full[0].values))
        for i, (c, n) in enumerate(zip(caches, lengths)):
            if c.keys is None:
                continue
            p = longest - n
            for mine, theirs in ((out.keys, c.keys), (out.values, c.values)):
                for x, y in zip(mine, theirs):
                    x[i : i + 1, :, p : p + n] = y[..., :n, :]
        out.offset += longest
        out._idx = longest
        return out

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else sum(x.nbytes for t in (self.keys, self.values) for x in t)


def merge(caches: Sequence) -> _BaseCache:
    """mlx-lm's ``merge`` of one slot's caches into a batched cache (``QuantizedKVCache`` has none)."""
    if isinstance(caches[0], QuantizedKVCache):
        return BatchQuantizedKVCache.merge(caches)
    return type(caches[0]).merge(list(caches))


def quantizable(cache) -> bool:
    """Whether ``cache`` turns quantized (mlx-lm's rule: a plain ``KVCache``; ``RotatingKVCache``'s
    ``to_quantized`` is not implemented, other kinds have none)."""
    return type(cache) is KVCache


def quantized(cache) -> bool:
    return isinstance(cache, (QuantizedKVCache, BatchQuantizedKVCache))


def quantize(caches: list, kv: KvQuant, slots: Sequence[int]) -> None:
    """Turn caches ``slots`` of one sequence's ``caches`` quantized, in place (mlx-lm's ``to_quantized``)."""
    for i in slots:
        if quantizable(caches[i]):
            caches[i] = caches[i].to_quantized(group_size=kv.group_size, bits=kv.bits)


def check(run: Callable[[list], mx.array], caches: list, kv: KvQuant) -> Tuple[List[int], str]:
    """Which of a sequence's ``caches`` (which have seen a position or two) this stage can
    quantize, and, if fewer than asked, why in one line: ``run(caches)`` computes one more
    position, which fails where the model's attention cannot read quantized keys and values."""
    slots = [i for i, c in enumerate(caches) if quantizable(c)]
    if not slots:
        return [], "its caches hold no plain keys and values to quantize (rotating windows, state-space arrays)"
    try:
        quantize(caches, kv, slots)
        mx.eval(run(caches))
    except Exception as err:  # noqa: BLE001 - the model's own attention, on caches it may not take
        return [], f"its attention cannot read quantized keys and values ({type(err).__name__}: {err})"
    left = len(caches) - len(slots)
    return slots, (f"{left} of its {len(caches)} caches (rotating windows, state-space arrays) stay as they are"
                   if left else "")


@dataclass(frozen=True)
class KvSwitch:
    """Where a stage's sequences' caches turn quantized, and the checks frames must pass."""

    kv: Optional[KvQuant] = None
    slots: Tuple[int, ...] = ()  # the caches of a sequence that turn quantized (empty: none do)

    def point(self, named: int) -> int:
        """Where a new sequence's caches turn quantized: where its first frame says, else
        (the node's own --kv-bits) before the first frame past the start, after a first
        call as mlx-lm's (0: never)."""
        return (named or max(self.kv.start, 1)) if self.slots else 0

    def turn(self, caches: list) -> None:
        quantize(caches, self.kv, self.slots)

    def check(self, e, seq=None) -> None:
        """Refuse (``FrameError``) a frame of entry ``e`` that crosses its sequence's switch
        point, or trims its quantized caches back before it (``seq``: the sequence, None
        for its first frame)."""
        if not self.slots:
            return
        at = e.kv_quantize_at if seq is None else seq.kv_at
        named = bool(e.kv_quantize_at) if seq is None else seq.kv_named
        if named and e.offset < at < e.offset + e.num_tokens:
            raise FrameError(f"sequence {e.seq_id}: positions [{e.offset}, {e.offset + e.num_tokens}) cross {at}, "
                             "where its KV cache turns quantized; cut the frame there")
        if seq is not None and seq.quantized and e.trim and seq.length - e.trim < at:
            raise FrameError(f"sequence {e.seq_id}: its KV cache turned quantized at {at}; positions before it "
                             f"cannot be taken back (trim {e.trim} of {seq.length})")

