"""What ``planner.plan`` must answer, found by trying every assignment (exponential: small cases only)."""

from __future__ import annotations

import itertools
from typing import Sequence

from mlxpipe.server.cluster.cost import ModelCost
from mlxpipe.server.cluster.planner import NodeSpec, Plan, PlanInfeasible, Workload, _Problem


def brute_force(cost: ModelCost, nodes: Sequence[NodeSpec], *, context: int = 8192, concurrency: int = 1,
                hop_seconds: float = 0.0, every_node: bool = False, workload: Workload = Workload(),
                cuts=None) -> Plan:
    """The best plan by trying every choice of nodes and every cut (every node, with ``every_node``;
    only the valid ``cuts``, when given)."""
    prob = _Problem(cost, nodes, context, concurrency, hop_seconds, workload)
    L, N = prob.L, prob.N
    if every_node and N > L:
        raise PlanInfeasible(f"cannot give each of {N} nodes one of {L} layers")
    best_key, best = None, None
    for k in [N] if every_node else range(1, min(N, L) + 1):
        for chosen in itertools.combinations(range(N), k):
            for chosen_cuts in itertools.combinations(range(1, L) if cuts is None else cuts, k - 1):
                bounds = (0, *chosen_cuts, L)
                stages = [(n, bounds[j], bounds[j + 1]) for j, n in enumerate(chosen)]
                if not all(prob.fits(n, s, e) for n, s, e in stages):
                    continue
                times = [prob.time(n, s, e) for n, s, e in stages]
                key = (max(times), sum(times), k)
                if best_key is None or key < best_key:
                    best_key, best = key, stages
    if best is None:
        raise prob.infeasible()
    return prob.plan(best)
