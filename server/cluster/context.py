"""Context planned with the weights: the KV cache at a precision (``at_kv_bits``: mlx-lm's
quantized KV cache, ``params.quant.kv_bytes``), the context a plan is for (``plan_context``:
the one declared, or the model's own clamped to the longest that fits), and for each KV
precision the longest context 1 and 4 streams may hold (``context_table``, ``mlxpipe
plan``'s table). Pure Python, over ``planner.fits``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from mlxpipe.server.cluster.cost import ModelCost
from mlxpipe.server.cluster.planner import NodeSpec, PlanInfeasible, fits
from mlxpipe.shards.params.quant import DEFAULT_GROUP_SIZE, KV_BITS, kv_bytes


def at_kv_bits(cost: ModelCost, bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> ModelCost:
    """``cost`` (at 16-bit KV) with its KV cache at ``bits`` (``params.quant.kv_bytes``)."""
    if cost.kv_bits != 16:
        raise ValueError("a KV precision is taken from the 16-bit cost")
    if bits == 16:
        return cost
    d = cost.kv_dtype_bytes
    layers = tuple(dataclasses.replace(l, kv_bytes_per_token=kv_bytes(l.kv_bytes_per_token // d, bits, group_size, d))
                   for l in cost.layers)
    return dataclasses.replace(cost, layers=layers, kv_bits=bits, kv_group_size=group_size)


T = TypeVar("T")


def longest_context(fits_at: Callable[[int], bool], most: int) -> int:
    """The longest context of at most ``most`` tokens for which ``fits_at`` holds (0: not
    even one token). More context never takes less memory: a binary search."""
    if fits_at(most):
        return most
    lo, hi = 0, most  # fits at lo (or lo is 0), not at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
    return lo


def plan_context(plan_at: Callable[[int], T], most: int, fits_at: Callable[[int], bool],
                 context: Optional[int] = None) -> Tuple[int, T, bool]:
    """The context to plan for and its plan: ``context`` when given (``plan_at``'s
    ``PlanInfeasible`` if it does not fit), else ``most`` (the model's own), clamped to
    the longest that ``fits_at``; and whether it was clamped. ``plan_at``: a context ->
    a plan, or ``PlanInfeasible``."""
    if context is not None:
        return context, plan_at(context), False
    try:
        return most, plan_at(most), False
    except PlanInfeasible:
        fitting = longest_context(fits_at, most)
    if not fitting:
        try:
            plan_at(1)
        except PlanInfeasible as err:
            raise PlanInfeasible(f"not even one token of context fits beside the weights: {err}") from None
    return fitting, plan_at(max(fitting, 1)), True


STREAMS = (1, 4)  # the concurrencies of ``context_table``


@dataclass(frozen=True)
class ContextRow:
    """The longest context that fits, at one KV precision, for each number of streams."""

    kv_bits: int
    kv_bytes_per_token: int
    longest: Dict[int, int]  # streams -> tokens each (at most the model's own; 0: not one token)


def context_table(cost: ModelCost, nodes: Sequence[NodeSpec], most: int, *, kv_bits: Sequence[int] = KV_BITS,
                  streams: Sequence[int] = STREAMS, group_size: int = DEFAULT_GROUP_SIZE,
                  every_node: bool = False) -> List[ContextRow]:
    """For each KV precision, the longest context (up to ``most``, the model's own) that
    ``streams`` requests may each hold at once beside ``cost``'s weights (from a cost at
    16-bit KV), with the layers placed for it."""
    rows = []
    for bits in kv_bits:
        at = at_kv_bits(cost, bits, group_size)
        longest = {n: longest_context(lambda c: fits(at, nodes, c, n, every_node), most) for n in streams}
        rows.append(ContextRow(bits, at.kv_bytes_per_token, longest))
    return rows
