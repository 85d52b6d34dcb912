"""``--bits auto``: the most bits per layer that fit the nodes (``plan_bits``), over the
planner's split (``planner.plan``). Pure Python, no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from mlxpipe.server.cluster.cost import ModelCost
from mlxpipe.server.cluster.planner import NodeSpec, Plan, PlanInfeasible, plan
from mlxpipe.shards.params.quant import AUTO_RUNGS, BITS, DEFAULT_GROUP_SIZE, QuantSpec
from mlxpipe.shards.params.sizes import gb


@dataclass(frozen=True)
class BitsChoice:
    """What ``plan_bits`` chose: the spec, its cost and plan, and the trade it made."""

    spec: QuantSpec
    cost: ModelCost
    plan: Plan
    lower: str                   # the rung most layers (or all) got
    higher: Optional[str]        # the next rung up, which does not fit everywhere (None: ``lower`` is the top)
    higher_short: str            # why ``higher`` everywhere does not fit
    higher_bytes: int            # weights at ``higher`` everywhere, and at ``lower`` everywhere
    lower_bytes: int
    lower_tokens_per_s: float    # the pipeline's predicted pace at ``lower`` everywhere

    @property
    def raised(self) -> int:
        """Layers at ``higher``."""
        return sum(1 for i in range(self.cost.num_layers) if self.spec.layer(i) == self.higher)

    def trade(self) -> str:
        """One sentence on the quality given up for the fit."""
        mean = self.cost.mean_bits or 0.0
        size = f"{mean:.2f} bits per weight on average (scales aside), {gb(self.cost.weight_bytes)} of weights"
        if self.higher is None:
            return f"{_rung_name(self.lower)} everywhere fits: {size}; nothing given up for the fit"
        up, down = _rung_name(self.higher), _rung_name(self.lower)
        if self.spec.bits != self.higher:
            kept = f"everything at {down}"
        else:
            kept = (f"the embedding, the head and {self.raised} of {self.cost.num_layers} layers (the outermost) "
                    f"at {up}, {self.cost.num_layers - self.raised} at {down}")
        speed = (f"; more bits read more per token: {self.plan.tokens_per_s_pipeline:.1f} tokens/s predicted, "
                 f"{self.lower_tokens_per_s:.1f} at {down} everywhere" if self.spec.bits == self.higher else "")
        return (f"{up} everywhere ({gb(self.higher_bytes)}) does not fit ({self.higher_short}); kept {kept}: "
                f"{size} ({gb(self.lower_bytes)} at {down} everywhere){speed}. Fewer bits cost accuracy: "
                f"see `mlxpipe bench quality` in docs/planning.md")


def _rung_name(rung: str) -> str:
    return f"{rung}-bit" if rung in BITS else rung


def raise_order(num_layers: int) -> List[int]:
    """Which layers get more bits first: from the ends inward (the first and last
    layers matter most to quality, as mlx-lm's mixed recipes and llama.cpp's
    K-quants assume)."""
    order = []
    for i in range((num_layers + 1) // 2):
        order += [i] if i == num_layers - 1 - i else [i, num_layers - 1 - i]
    return order


def plan_bits(cost_of: Callable[[QuantSpec], ModelCost], nodes: Sequence[NodeSpec], *,
              group_size: int = DEFAULT_GROUP_SIZE, rungs: Sequence[str] = AUTO_RUNGS, **plan_args) -> BitsChoice:
    """The most bits that fit: ``--bits auto``.

    Rungs (``params.quant.AUTO_RUNGS``: 8, 6, 4 and 3 bits and mlx-lm's mixed
    recipes between them) are tried from the largest model down; the first whose
    plan fits every node's budget is ``lower``. If a larger rung exists, layers
    are raised to it one by one from the ends inward (the embedding and head
    first), as many as still fit (a binary search: more raised layers never take
    less memory); the plan for that mix is the usual time-balanced one (``plan``,
    with ``plan_args``). ``cost_of`` gives a model's cost under a spec. Raises
    ``PlanInfeasible`` when not even the smallest rung fits.
    """
    costs = {r: cost_of(QuantSpec(r, group_size)) for r in rungs}
    order = sorted(rungs, key=lambda r: -costs[r].weight_bytes)
    why: Dict[str, str] = {}
    for j, rung in enumerate(order):
        try:
            base = plan(costs[rung], nodes, **plan_args)
        except PlanInfeasible as err:
            why[rung] = str(err)
            continue
        if j == 0:
            return BitsChoice(QuantSpec(rung, group_size), costs[rung], base, rung, None, "",
                              costs[rung].weight_bytes, costs[rung].weight_bytes, base.tokens_per_s_pipeline)
        up = order[j - 1]
        break
    else:
        raise PlanInfeasible(f"not even {_rung_name(order[-1])} fits: {why[order[-1]]}")
    L = costs[rung].num_layers
    priority = raise_order(L)

    def spec(k: int) -> QuantSpec:  # k = 0: all at `rung`; k >= 1: the ends and k - 1 layers at `up`
        if k == 0:
            return QuantSpec(rung, group_size)
        raised = set(priority[:k - 1])
        return QuantSpec(up, group_size, tuple(up if i in raised else rung for i in range(L)))

    best = (0, costs[rung], base)
    lo, hi = 0, L + 1  # k = lo fits; k = hi (everything up) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        cost = cost_of(spec(mid))
        try:
            best = (mid, cost, plan(cost, nodes, **plan_args))
            lo = mid
        except PlanInfeasible:
            hi = mid
    k, cost, chosen = best
    return BitsChoice(spec(k), cost, chosen, rung, up, why[up], costs[up].weight_bytes, costs[rung].weight_bytes,
                      base.tokens_per_s_pipeline)
