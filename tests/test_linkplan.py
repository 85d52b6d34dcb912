"""The planner prices links: exact against brute force with each hop charged to the stage it
leads into, slow links placed where they cost least, and `mlxpipe plan --link`."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from test_planner import toy_model, toy_nodes

from mlxpipe.server.cluster import linkplan as LP
from mlxpipe.server.cluster import planner as P

GB = 10**9


def _links(rng, n, row_bytes=14336):
    hop = lambda: LP.Hop(rng.choice([5e-6, 1e-4, 3e-3]), rng.choice([5e9, 1e8, 2e6]))  # noqa: E731
    return LP.Links(row_bytes, tuple(hop() for _ in range(n)), {p: hop() for p in itertools.combinations(range(n), 2)})


def _brute(cost, nodes, links, cuts, every_node, **kw):
    pr = LP._Priced(cost, nodes, range(len(nodes)), links, kw["context"], 1, kw["workload"])
    L, N, best = cost.num_layers, len(nodes), None
    for k in [N] if every_node else range(1, N + 1):
        for chosen in itertools.combinations(range(N), k):
            for cut in itertools.combinations(cuts, k - 1):
                bounds = (0, *cut, L)
                stages = [(n, bounds[j], bounds[j + 1]) for j, n in enumerate(chosen)]
                if not all(pr.prob.fits(*st) for st in stages):
                    continue
                times = [pr.time(chosen[j - 1] if j else -1, *st) for j, st in enumerate(stages)]
                key = (max(times), sum(times), k)
                best = key if best is None or key < best else best
    return best


@pytest.mark.parametrize("every_node", [False, True])
def test_linked_plan_is_exact_for_the_order_given(every_node):
    rng = random.Random(7)
    checked = 0
    for _ in range(150):
        L = rng.randint(1, 6)
        cost, nodes = toy_model(rng, L), toy_nodes(rng, rng.randint(1, 3))
        links = _links(rng, len(nodes))
        cuts = tuple(sorted(rng.sample(range(1, L), rng.randint(0, L - 1)))) if L > 1 else ()
        kw = dict(context=rng.choice([1, 1000]), workload=P.Workload(rng.choice([0.0, 10.0])))
        want = _brute(cost, nodes, links, cuts, every_node, **kw)
        if want is None:
            with pytest.raises(P.PlanInfeasible):
                LP.plan(cost, nodes, links, cuts=cuts, every_node=every_node, reorder=False, **kw)
            continue
        got = LP.plan(cost, nodes, links, cuts=cuts, every_node=every_node, reorder=False, **kw)
        pr = LP._Priced(cost, nodes, got.order, links, kw["context"], 1, kw["workload"])
        stages = [(s.node_index, s.start, s.end) for s in got.plan.stages]
        times = [pr.time(stages[j - 1][0] if j else -1, *st) for j, st in enumerate(stages)]
        assert math.isclose(max(times), want[0], rel_tol=1e-12) and math.isclose(sum(times), want[1], rel_tol=1e-9)
        assert all(s.start in (0, *cuts) for s in got.plan.stages)
        checked += 1
    assert checked > 30


def test_a_node_on_a_slow_link_goes_to_an_end_where_only_tokens_cross_one_of_its_hops():
    rng = random.Random(3)
    cost = toy_model(rng, 6)
    nodes = [P.NodeSpec(f"n{i}", 1000 * GB, bandwidth_bytes_per_s=800 * GB) for i in range(3)]
    fast, slow = LP.Hop(1e-4, 5e9), LP.Hop(1e-4, 2e6)   # the middle node of the order given sits on a slow link
    pairs = {(0, 1): slow, (0, 2): fast, (1, 2): slow}
    links = LP.Links(14336, (fast, slow, fast), pairs)
    kw = dict(context=1, workload=P.Workload(0), every_node=True)
    given = LP.plan(cost, nodes, links, reorder=False, **kw)
    best = LP.plan(cost, nodes, links, **kw)
    assert given.order == (0, 1, 2)
    assert best.order.index(1) in (0, 2), best.order     # first or last: one activation hop, not two
    assert best.plan.tokens_per_s_one_stream > given.plan.tokens_per_s_one_stream * 1.1
    assert any("2.0 MB/s" in h[1].describe() for h in best.hops)


def test_parse_link_and_links_on_paper():
    hop = LP.parse_link("40Gbps,50us")
    assert math.isclose(hop.latency_s, 50e-6) and math.isclose(hop.bytes_per_s, 5e9)
    hop = LP.parse_link("1GB/s,0.3ms")
    assert math.isclose(hop.latency_s, 3e-4) and math.isclose(hop.bytes_per_s, 1e9)
    with pytest.raises(ValueError, match="40Gbps,50us"):
        LP.parse_link("fast")
    row = LP.Links.in_a_row(100, [LP.Hop(1e-3, 1e9), LP.Hop(2e-3, 1e8)], 3)
    assert row.between(0, 2) == LP.Hop(2e-3, 1e8) and row.head[0] == LP.Hop()
    with pytest.raises(ValueError, match="2 hops for 4 nodes"):
        LP.Links.in_a_row(100, [LP.Hop(), LP.Hop()], 4)
