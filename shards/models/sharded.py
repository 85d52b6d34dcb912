"""What a rank of a tensor-parallel group holds of a split layer (``tensor_parallel.py`` decides
where to cut): the modules a split layer is made of, each sum one ``mx.distributed.all_sum``
(MLX's own collective, in float32, cast back once, so that a split block rounds as the whole
one does but for the order of float32 additions), and the slicing of one projection, dense or
quantized (only on quantization-group boundaries: ``Unsplittable`` otherwise).

mlx.nn's sharded layers (``AllToShardedLinear``, ``ShardedToAllLinear`` and their quantized
kin) split evenly only; these take the already-sliced projection, whatever its share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn


class Unsplittable(ValueError):
    """A block (or a model) whose layers this group cannot split; the message says which and why."""


@dataclass(frozen=True)
class Part:
    """Rank ``rank`` of a group of ``size``."""

    rank: int
    size: int

    def run(self, n: int, unit: int = 1) -> Tuple[int, int]:
        """This rank's contiguous share of ``n`` (in whole ``unit``s), first ranks the larger."""
        a, b = runs(n // unit, self.size)[self.rank]
        return a * unit, min(b * unit, n)


def runs(n: int, k: int) -> List[Tuple[int, int]]:
    """``n`` cut into ``k`` contiguous runs as even as possible, the first ones the larger."""
    q, rem = divmod(n, k)
    out, at = [], 0
    for r in range(k):
        size = q + (1 if r < rem else 0)
        out.append((at, at + size))
        at += size
    return out


@dataclass
class Sums:
    """A group's collective, and the sums a forward built with it, in order (``Taped`` launches them)."""

    group: object
    tape: List[mx.array] = field(default_factory=list)


class SumOut(nn.Module):
    """An output projection sliced by input columns (``keep``: the columns of its input that are
    this rank's, pads dropped), its result summed over the group in float32; its bias once."""

    def __init__(self, inner: nn.Module, sums: Sums, keep: Optional[Tuple[int, int]] = None):
        super().__init__()
        self.bias = inner.bias if "bias" in inner else None
        if "bias" in inner:
            del inner["bias"]
        self.inner, self._sums, self._keep = inner, sums, keep
        self._dtype = inner.scales.dtype if "scales" in inner else inner.weight.dtype

    def __call__(self, x: mx.array) -> mx.array:
        if self._keep is not None:
            x = x[..., self._keep[0]:self._keep[1]]
        out = mx.result_type(x.dtype, self._dtype)
        y = mx.distributed.all_sum(self.inner(x.astype(mx.float32)), group=self._sums.group)
        self._sums.tape.append(y)
        if self.bias is not None:
            y = y + self.bias
        return y.astype(out)


class SumModule(nn.Module):
    """A whole layer (a mixture of experts) whose output is summed over the group."""

    def __init__(self, inner: nn.Module, sums: Sums):
        super().__init__()
        self.inner, self._sums = inner, sums

    def __call__(self, *args, **kwargs):
        y = self.inner(*args, **kwargs)
        total = mx.distributed.all_sum(y.astype(mx.float32), group=self._sums.group)
        self._sums.tape.append(total)
        return total.astype(y.dtype)


class Taped:
    """A stage's range (``slicing.SlicedModel``) whose group's sums all run on every rank, whatever a
    frame goes on to evaluate. MLX computes lazily: a last stage's leader that evaluates only its
    caches (a prompt chunk it does not sample) would skip its last layer's sums, which its other
    ranks (whose output is that layer's) run, and the ranks would fall out of step. After every
    forward, the sums it built are launched, in the order it built them."""

    def __init__(self, stage, sums: Sums):
        self._stage, self._sums = stage, sums

    def __getattr__(self, name):
        return getattr(self._stage, name)

    def __call__(self, *args, **kwargs):
        try:
            return self._stage(*args, **kwargs)
        finally:
            built, self._sums.tape[:] = list(self._sums.tape), []
            if built:
                mx.async_eval(built)


class PadHeads(nn.Module):
    """A query projection sliced to this rank's heads, then ``before`` and ``after`` zero heads
    of ``width`` columns added: the slots of the shared KV heads' other query heads (``queries``:
    a fused q|k|v projection's query columns, padded where keys and values follow)."""

    def __init__(self, inner: nn.Module, before: int, after: int, width: int, queries: Optional[int] = None):
        super().__init__()
        self.inner, self._pads, self._queries = inner, (before * width, after * width), queries

    def __call__(self, x: mx.array) -> mx.array:
        y = self.inner(x)
        zeros = [mx.zeros((*y.shape[:-1], n), dtype=y.dtype) for n in self._pads]
        if self._queries is None:
            return mx.concatenate([zeros[0], y, zeros[1]], axis=-1)
        return mx.concatenate([zeros[0], y[..., :self._queries], zeros[1], y[..., self._queries:]], axis=-1)


class Nothing(nn.Module):
    """A small sub-layer another rank holds whole: it adds nothing here."""

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return mx.zeros_like(x)


class LocalExperts(nn.Module):
    """A router whose choices are kept for the experts this rank holds, ``[lo, hi)``: their
    indices made local, every other expert's score zeroed (and its index pointed at a local
    expert, whose output the zero score cancels)."""

    def __init__(self, router: nn.Module, lo: int, hi: int):
        super().__init__()
        self.router, self._span = router, (lo, hi)

    def __call__(self, x: mx.array):
        inds, scores = self.router(x)
        lo, hi = self._span
        mine = (inds >= lo) & (inds < hi)
        return mx.where(mine, inds - lo, 0), scores * mine.astype(scores.dtype)


# -- slicing one projection ---------------------------------------------------------------------


def _quantized(mod: nn.Module) -> bool:
    return "scales" in mod and hasattr(mod, "group_size")


def in_features(mod: nn.Module) -> int:
    w = mod.weight
    return w.shape[-1] * 32 // mod.bits if _quantized(mod) else w.shape[-1]


def out_features(mod: nn.Module) -> int:
    return mod.weight.shape[-2]


def take_rows(mod: nn.Module, a: int, b: int) -> None:
    """Keep output features ``[a, b)`` of a (switch, quantized) linear layer, in place."""
    take_row_runs(mod, [(a, b)])


def take_row_runs(mod: nn.Module, spans: List[Tuple[int, int]]) -> None:
    """Keep the output features of each of ``spans``, one after the other (a fused q|k|v projection), in place."""
    for name in ("weight", "scales", "biases", "bias"):
        arr = mod[name] if name in mod else None
        if arr is None:
            continue
        if name == "bias":
            mod[name] = mx.contiguous(mx.concatenate([arr[..., a:b] for a, b in spans], axis=-1))
        else:
            mod[name] = mx.contiguous(mx.concatenate([arr[..., a:b, :] for a, b in spans], axis=-2))


def take_cols(mod: nn.Module, a: int, b: int, what: str) -> None:
    """Keep input features ``[a, b)``, in place; quantized, only on group boundaries."""
    if not _quantized(mod):
        mod["weight"] = mx.contiguous(mod["weight"][..., a:b])
        return
    gs, n = mod.group_size, in_features(mod)
    if a % gs or (b % gs and b != n):
        raise Unsplittable(f"{what}: a cut at input column {a if a % gs else b} is not on a quantization group "
                           f"boundary (groups of {gs})")
    mod["weight"] = mx.contiguous(mod["weight"][..., a * mod.bits // 32:b * mod.bits // 32])  # groups: 32 apart
    for name in ("scales", "biases"):
        if name in mod and mod[name] is not None:
            mod[name] = mx.contiguous(mod[name][..., a // gs:(b + gs - 1) // gs])


def take_experts(mod: nn.Module, lo: int, hi: int) -> None:
    """Keep experts ``[lo, hi)`` of a switch layer, in place."""
    for name in ("weight", "scales", "biases", "bias"):
        if name in mod and mod[name] is not None and mod[name].ndim >= 2:
            mod[name] = mx.contiguous(mod[name][lo:hi])


def zero_bias_off_leader(mod: nn.Module, part: Part) -> None:
    """An output projection summed over the group by an enclosing layer adds its bias once."""
    if part.rank and "bias" in mod:
        mod["bias"] = mx.zeros_like(mod["bias"])


def unit(mod: nn.Module) -> int:
    return mod.group_size if _quantized(mod) else 1
