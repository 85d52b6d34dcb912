"""Cuts only where the model can be cut: a KV-sharing Gemma 4 whose even splits are invalid
is cut, profiled, planned and served at its valid cuts only, with mlx-lm's tokens."""

from __future__ import annotations

import json
import math
import random

import pytest
from planner_oracle import brute_force
from test_equality import _check_equal
from test_planner import check_plan, toy_model, toy_nodes
from tiny_models import GEMMA4_SHARED, build_gemma4_shared

from mlxpipe.bench import tiny
from mlxpipe.server.cluster import planner as P
from mlxpipe.server.cluster.splits import even_split, fixed_ranges
from mlxpipe.shards.models.cuts import Cuts, of_config


@pytest.fixture(scope="session")
def gemma4_shared(tmp_path_factory, default_model):
    return build_gemma4_shared(tmp_path_factory.mktemp("gemma4s") / "model", default_model)


def _config(tmp_path, default_model) -> dict:
    out = tiny.build("gemma4_text", tmp_path / "g", default_model, weights=False, extra=GEMMA4_SHARED)
    return json.loads((out / "config.json").read_text())


def test_the_structure_names_the_valid_cuts_and_why(tmp_path, default_model):
    cuts = of_config(_config(tmp_path, default_model), 6)
    assert cuts.traced and cuts.valid == (1, 2)
    assert cuts.units() == [(0, 1), (1, 2), (2, 6)]
    assert cuts.why[4] == "block 4 reads what block 3 returns besides the hidden state"
    assert cuts.why[3] == cuts.why[5] == "block 5 reads what block 2 returns besides the hidden state"
    assert "layers [2, 6) run whole" in cuts.describe()
    assert cuts.allows(0, 2) and cuts.allows(2, 6) and not cuts.allows(0, 3)
    # Without shared layers every boundary is a cut.
    plain = of_config(dict(_config(tmp_path, default_model), num_kv_shared_layers=0), 6)
    assert plain.all_valid and plain.units() == [(i, i + 1) for i in range(6)]


def test_even_snaps_to_the_nearest_valid_cut_and_sizes_elsewhere_are_refused(caplog):
    cuts = Cuts(6, (1, 2), {3: "x", 4: "y", 5: "z"})
    assert even_split(6, 2) == [(0, 3), (3, 6)]
    assert even_split(6, 2, cuts) == [(0, 2), (2, 6)]
    assert "cut at [2] instead of [3]" in caplog.text
    assert even_split(6, 3, cuts) == [(0, 1), (1, 2), (2, 6)]
    with pytest.raises(ValueError, match="cannot be cut into 4 stages"):
        even_split(6, 4, cuts)
    with pytest.raises(ValueError, match=r"layers \[0, 3\) cannot run as a stage: no stage may start or end at "
                                         r"layer 3: x\. valid cuts: at layers 1, 2"):
        fixed_ranges(6, 2, "3,3", cuts)
    assert fixed_ranges(6, 2, "2,4", cuts) == [(0, 2), (2, 6)]
    # Cuts far apart: each boundary takes its own, in order.
    wide = Cuts(12, (2, 3, 10), {})
    assert even_split(12, 3, wide) == [(0, 3), (3, 10), (10, 12)]


@pytest.mark.parametrize("every_node", [False, True])
def test_planner_cuts_only_at_valid_points_exactly(every_node):
    rng = random.Random(35)
    feasible = 0
    for _ in range(200):
        L = rng.randint(2, 7)
        cost = toy_model(rng, L)
        nodes = toy_nodes(rng, rng.randint(1, 3))
        cuts = tuple(sorted(rng.sample(range(1, L), rng.randint(0, L - 1))))
        kw = dict(context=rng.choice([1, 1000]), every_node=every_node, workload=P.Workload(rng.choice([0.0, 10.0])))
        try:
            want = brute_force(cost, nodes, cuts=cuts, **kw)
        except P.PlanInfeasible:
            with pytest.raises(P.PlanInfeasible):
                P.plan(cost, nodes, cuts=cuts, **kw)
            continue
        got = P.plan(cost, nodes, cuts=cuts, **kw)
        check_plan(got, cost, nodes, kw["context"])
        assert all(s.start in (0, *cuts) for s in got.stages)
        assert math.isclose(got.max_seconds, want.max_seconds, rel_tol=1e-12)
        assert math.isclose(got.sum_seconds, want.sum_seconds, rel_tol=1e-9)
        feasible += 1
    assert feasible > 40


@pytest.mark.parametrize("stages", [2, 3])
def test_a_kv_sharing_model_serves_by_default_with_mlx_lm_tokens(gemma4_shared, stages, reference):
    """The default split (the planner over measured profiles: it used to time layer 5 alone
    and fail) cuts only at layers 1 and 2; batched prompts, prefix-cache hits and
    speculation give mlx-lm's tokens."""
    _check_equal(gemma4_shared, stages, reference, copies=False)

