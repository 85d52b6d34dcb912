"""What a stage's caches can do, decided from mlx-lm's cache classes (never from the model's name).

Two kinds:

- **Positional** caches keep keys and values along a position axis, one entry per
  position, each independent of the later ones (mlx-lm's ``KVCache``,
  ``QuantizedKVCache``, ``ConcatenateKVCache``, the batched ``BatchKVCache`` and
  our ``BatchQuantizedKVCache``): dropping the last positions (``trim``) is
  always exact, and the plain and quantized ones (and a row of their batched
  forms) can be cut into prefix blocks.
- **State** caches hold something that is valid only for exactly the prefix
  computed so far: rotating windows (``RotatingKVCache``: it overwrites what
  falls out of its window), the arrays of state-space and linear-attention
  layers (``ArraysCache``), lists of caches (``CacheList``), and any cache class
  a model brings itself. They are never trimmed: a stage copies their state
  (``snapshot``; arrays are shared, not copied, until a cache writes over them)
  and puts it back (``restore``).

``Rewind`` uses both to take back the positions speculative decoding rejected:
positional caches are trimmed; state caches go back to the snapshot taken
before the verify frame that added the first rejected position, and the
positions of that frame which were accepted are computed again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import (ArraysCache, BatchKVCache, BatchRotatingKVCache, CacheList, ConcatenateKVCache,
                                  KVCache, QuantizedKVCache, RotatingKVCache, _BaseCache)

from mlxpipe.shards.cache.quantized import BatchQuantizedKVCache, KvSwitch, check

if TYPE_CHECKING:
    from mlxpipe.shards.params.kv import KvQuant

# trim is exact at any length
TRIMMABLE = (KVCache, QuantizedKVCache, ConcatenateKVCache, BatchKVCache, BatchQuantizedKVCache)
# prefix blocks are slices of their keys and values
SLICEABLE = (KVCache, BatchKVCache, QuantizedKVCache, BatchQuantizedKVCache)


def _kids(cache) -> Optional[list]:
    """The caches inside a ``CacheList`` (None for any other cache)."""
    return list(cache.caches) if isinstance(cache, CacheList) else None


def positional(cache) -> bool:
    """Whether dropping positions from ``cache`` is always exact (exact classes: a
    model's subclass may keep more than keys and values; a list of such caches)."""
    kids = _kids(cache)
    return all(positional(c) for c in kids) if kids is not None else type(cache) in TRIMMABLE


def sliceable(cache) -> bool:
    """Whether prefix blocks can be cut from ``cache`` (keys and values along positions)."""
    kids = _kids(cache)
    return all(sliceable(c) for c in kids) if kids is not None else type(cache) in SLICEABLE


def batchable(cache) -> bool:
    """Whether caches of this kind merge into one batched cache (mlx-lm's ``merge``)."""
    kids = _kids(cache)
    if kids is not None:
        return all(batchable(c) for c in kids)
    return callable(getattr(type(cache), "merge", None))


def signature(cache) -> tuple:
    """What a model may read from a cache besides its content: its class, a window's
    size, the kinds inside a list of caches. Caches of one signature stand in for
    each other (``slicing.SlicedModel``)."""
    kids = getattr(cache, "caches", None)
    inner = tuple(signature(c) for c in kids) if isinstance(kids, (list, tuple)) else ()
    return (type(cache).__name__, getattr(cache, "max_size", None), getattr(cache, "keep", None), inner)


def _leaves(caches: Sequence):
    for c in caches:
        kids = _kids(c)
        if kids is not None:
            yield from _leaves(kids)
        else:
            yield c


@dataclass(frozen=True)
class Footprint:
    """What one sequence's caches cost on a stage."""

    kv_bytes_per_token: int  # keys and values (rotating windows too, at most: they hold up to their window)
    state_bytes: int         # one snapshot of its state caches (a full window, state-space arrays)


def _kv(cache) -> Optional[List[mx.array]]:
    """The arrays of a cache's keys and values, [B, heads, positions, ...] each (mx.quantize's
    three parts of each, quantized), or None for a cache that keeps none."""
    keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
    parts = [*(keys if isinstance(keys, (tuple, list)) else (keys,)),
             *(values if isinstance(values, (tuple, list)) else (values,))]
    return parts if all(isinstance(a, mx.array) and a.ndim == 4 for a in parts) else None


def footprint(caches: Sequence) -> Footprint:
    """Measured on caches that have seen a position or two (buffers allocated ahead count
    per position they allocated)."""
    per_token = state = 0
    for top in caches:
        for c in _leaves([top]):
            kv = _kv(c)
            if kv is not None:
                cost = sum(a.nbytes for a in kv) // kv[0].shape[2]
                per_token += cost
                if not sliceable(top):  # in a snapshot: a window, or (inside a list) what it holds
                    state += cost * (getattr(c, "max_size", None) or kv[0].shape[2])
            elif not sliceable(top):
                state += nbytes(vars(c))
    return Footprint(per_token, state)


def phantom(template, lengths: List[int]):
    """An empty cache of ``template``'s kind whose offsets say each row is ``lengths``
    long: what a model reads of a cache of a kind the stage holds none of."""
    if isinstance(template, CacheList):
        return CacheList(*(phantom(c, lengths) for c in template.caches))
    if isinstance(template, ArraysCache):
        return ArraysCache(len(template.cache))
    longest = max(lengths) if lengths else 0
    if len(lengths) > 1 and type(template) in (KVCache, RotatingKVCache):
        pad = [longest - n for n in lengths]
        if isinstance(template, RotatingKVCache):
            c = BatchRotatingKVCache(template.max_size, pad)
            c._offset, c._idx = longest, min(longest, template.max_size)
        else:
            c = BatchKVCache(pad)
            c._idx = longest
        c.offset = mx.array(lengths)
        return c
    c = clone(template)
    if isinstance(getattr(c, "offset", None), int):
        c.offset = longest
    return c


# -- copies of a cache's state --------------------------------------------------------


def _copy(value: Any) -> Any:
    """A copy of a cache attribute: containers copied, arrays as new handles (a cache
    that writes into its arrays in place then leaves the copy's alone)."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, _BaseCache) or hasattr(value, "update_and_fetch"):
        return clone(value)
    return value


def snapshot(cache) -> dict:
    """The state of ``cache`` now (every attribute); cheap: arrays are shared."""
    return {k: _copy(v) for k, v in vars(cache).items()}


def restore(cache, state: dict) -> None:
    """Put ``cache`` back to a ``snapshot`` (which stays usable)."""
    cache.__dict__.clear()
    cache.__dict__.update(_copy(state))


def clone(cache):
    """A cache of the same class with the same state."""
    out = type(cache).__new__(type(cache))
    out.__dict__.update(snapshot(cache))
    return out


def arrays(state: Any) -> List[mx.array]:
    """The arrays in a snapshot (to evaluate or to count)."""
    if isinstance(state, mx.array):
        return [state]
    if isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, (list, tuple)):
        return [a for v in state for a in arrays(v)]
    if isinstance(state, _BaseCache) or hasattr(state, "update_and_fetch"):
        return arrays(vars(state))
    return []


def nbytes(state: Any) -> int:
    return sum(a.nbytes for a in arrays(state))


def row_snapshot(cache, row: int) -> dict:
    """The state of row ``row`` of a batched cache (or of an own cache, ``row`` < 0)."""
    if row < 0:
        return snapshot(cache)
    return snapshot(cache.extract(row))


# -- taking back positions ------------------------------------------------------------


@dataclass
class _Mark:
    start: int                          # the sequence's length before the frame
    saved: Dict[int, dict]              # cache index -> its state then (state caches only)
    tokens: List[int]                   # the frame's inputs, to compute accepted positions again
    hidden: Optional[mx.array]


@dataclass
class Rewind:
    """What taking back up to ``horizon`` positions of one sequence needs: a mark
    before each verify frame (its inputs, and the state of every state cache)."""

    horizon: int
    marks: List[_Mark] = field(default_factory=list)

    def mark(self, caches: Sequence, length: int, tokens: Sequence[int], hidden: Optional[mx.array]) -> None:
        saved = {i: snapshot(c) for i, c in enumerate(caches) if not positional(c)}
        self.marks.append(_Mark(length, saved, list(tokens), hidden))
        end = length + len(tokens)
        # Keep the latest mark a rewind of `horizon` positions may need, and every later one.
        while len(self.marks) > 1 and self.marks[1].start <= end - self.horizon:
            self.marks.pop(0)

    def can(self, length: int, n: int) -> bool:
        """Whether ``n`` positions can be taken back from ``length``."""
        if all(not m.saved for m in self.marks) or n == 0:
            return True
        return bool(self.marks) and self.marks[0].start <= length - n

    def back(self, caches: Sequence, length: int, n: int, run: Callable) -> None:
        """Take the last ``n`` positions off ``caches`` (now ``length`` long);
        ``run(tokens, hidden, caches)`` computes positions again."""
        target = length - n
        if all(not m.saved for m in self.marks):
            for c in caches:
                c.trim(n)
            self._forget_after(target)
            return
        mark = next(m for m in reversed(self.marks) if m.start <= target)
        for i, c in enumerate(caches):
            if i in mark.saved:
                restore(c, mark.saved[i])
            else:
                c.trim(length - mark.start)
        again = target - mark.start
        if again:
            hidden = None if mark.hidden is None else mark.hidden[:, :again]
            run(mark.tokens[:again], hidden, caches)
        self._forget_after(target)

    def _forget_after(self, target: int) -> None:
        self.marks = [m for m in self.marks if m.start < target]
        for m in self.marks:  # what they say beyond target is void
            del m.tokens[target - m.start:]
            if m.hidden is not None:
                m.hidden = m.hidden[:, : target - m.start]


def kv_switch(stage: Any, hidden_size: int, kv: "KvQuant") -> Tuple[KvSwitch, int, str]:
    """Which of ``stage``'s caches (a ``slicing.SlicedModel``'s) turn quantized with ``kv``
    (two positions through fresh caches, then one more on quantized ones): the switch, a
    token's KV bytes once they did, and why fewer caches than asked turn (one line; empty:
    none)."""
    caches = stage.make_cache()
    hidden = None if stage.first else mx.zeros((1, 1, hidden_size), dtype=mx.float32)

    def run(cs: list, i: int) -> mx.array:
        return stage(mx.zeros((1, 1), dtype=mx.int32), hidden, cs, lengths=[i])

    for i in range(2):
        mx.eval(run(caches, i))
    full = footprint(caches).kv_bytes_per_token
    slots, note = check(lambda cs: run(cs, 2), caches, kv)
    per_token = footprint(caches).kv_bytes_per_token if slots else full
    del caches
    mx.clear_cache()
    return (KvSwitch(kv, tuple(slots)) if slots else KvSwitch()), per_token, note
