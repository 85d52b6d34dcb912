"""The partition planner: exact against brute force, memory-safe; and `mlxpipe plan`."""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import pytest
from planner_oracle import brute_force

from mlxpipe.server.cli import plan as plan_command
from mlxpipe.server.cluster import bits as B
from mlxpipe.server.cluster import context as C
from mlxpipe.server.cluster import planner as P
from mlxpipe.server.cluster.cost import LayerCost, ModelCost, load_model_cost
from mlxpipe.shards.params.quant import QuantSpec
from mlxpipe.shards.params.sizes import expand_list, parse_bandwidth, parse_size

CONFIGS = Path(__file__).parent / "configs"
GB = 10**9


def toy_model(rng: random.Random, num_layers: int) -> ModelCost:
    layers = []
    for _ in range(num_layers):
        kind = rng.choice(["dense", "moe"])
        w = rng.randint(1, 10) * GB
        read = w if kind == "dense" else w // 4
        layers.append(LayerCost(kind, w // 2, read // 2, w, read, rng.randint(0, 3) * 1000))
    tied = rng.random() < 0.3
    embed = rng.randint(0, 3) * GB
    head = embed + rng.randint(0, 2) * GB if tied else rng.randint(0, 4) * GB
    return ModelCost("toy", "toy", tuple(layers), 0, embed, embed // 1000, 0, head, head, tied,
                     None, 64, "config")


def toy_nodes(rng: random.Random, n: int) -> list:
    nodes = []
    for i in range(n):
        mem = rng.randint(3, 30) * GB
        if rng.random() < 0.3:   # measured
            nodes.append(P.NodeSpec(f"n{i}", mem, layer_seconds={"dense": rng.uniform(0.001, 0.02),
                                                                  "moe": rng.uniform(0.001, 0.02)},
                                    embed_seconds=rng.uniform(0, 0.005), head_seconds=rng.uniform(0, 0.03)))
        else:                    # on paper; prefill costed on some
            nodes.append(P.NodeSpec(f"n{i}", mem, bandwidth_bytes_per_s=rng.choice([100, 273, 400, 800]) * GB,
                                    flops_per_s=rng.choice([None, 10e12, 30e12])))
    return nodes


def check_plan(plan: P.Plan, cost: ModelCost, nodes, context: int, concurrency: int = 1) -> None:
    # Contiguous, in node order, every layer exactly once, within memory.
    assert plan.stages[0].start == 0 and plan.stages[-1].end == cost.num_layers
    covered = [i for s in plan.stages for i in range(s.start, s.end)]
    assert covered == list(range(cost.num_layers))
    assert all(s.end > s.start for s in plan.stages)
    idx = [s.node_index for s in plan.stages]
    assert idx == sorted(set(idx))
    for s in plan.stages:
        assert s.weight_bytes + P.KV_MARGIN * s.kv_bytes <= nodes[s.node_index].memory_bytes
        kv = sum(l.kv_bytes_per_token for l in cost.layers[s.start:s.end]) * context * concurrency
        assert s.kv_bytes == kv
        assert s.weight_bytes == cost.stage_weight_bytes(s.start, s.end)
    assert set(plan.unused) == {n.name for i, n in enumerate(nodes) if i not in idx}


@pytest.mark.parametrize("every_node", [False, True])
def test_dp_matches_brute_force_on_random_instances(every_node):
    rng = random.Random(1234)
    feasible = infeasible = 0
    for _ in range(300):
        cost = toy_model(rng, rng.randint(1, 7))
        nodes = toy_nodes(rng, rng.randint(1, 4))
        context, hop = rng.choice([1, 1000, 100_000]), rng.choice([0.0, 0.002])
        kw = dict(context=context, hop_seconds=hop, every_node=every_node,
                  workload=P.Workload(rng.choice([0.0, 10.0]), rng.choice([1, 256])))
        try:
            want = brute_force(cost, nodes, **kw)
        except P.PlanInfeasible:
            with pytest.raises(P.PlanInfeasible):
                P.plan(cost, nodes, **kw)
            infeasible += 1
            continue
        got = P.plan(cost, nodes, **kw)
        check_plan(got, cost, nodes, context)
        check_plan(want, cost, nodes, context)
        if every_node:
            assert len(got.stages) == len(nodes)
        assert math.isclose(got.max_seconds, want.max_seconds, rel_tol=1e-12)
        assert math.isclose(got.sum_seconds, want.sum_seconds, rel_tol=1e-9)
        if got.sum_seconds == want.sum_seconds:   # then the tie goes to fewer stages in both
            assert len(got.stages) == len(want.stages)
        feasible += 1
    assert feasible > (80 if every_node else 100) and infeasible > 20   # both branches exercised


def test_ties_go_to_fewer_stages():
    # Free layers, a costly head: one stage or two give the same max and sum; one stage wins,
    # whether the lone stage is on the first node or (when the first is too small) on the second.
    cost = ModelCost("t", "t", tuple(LayerCost("dense", 0, 0, GB, GB, 0) for _ in range(4)),
                     0, 0, 0, 0, 0, 0, False, None, 64, "config")
    nodes = [P.NodeSpec(f"n{i}", 10 * GB, layer_seconds={"dense": 0.0}, head_seconds=0.01) for i in range(2)]
    plan = P.plan(cost, nodes)
    assert len(plan.stages) == 1 and plan.unused == ("n1",)
    nodes[0] = P.NodeSpec("n0", 3 * GB, layer_seconds={"dense": 0.0}, head_seconds=0.01)
    plan = P.plan(cost, nodes)
    assert [(s.node, s.start, s.end) for s in plan.stages] == [("n1", 0, 4)]


def test_infeasible_says_how_short():
    cost = load_model_cost(CONFIGS / "deepseek_v3.json", bits=3)
    nodes = [P.NodeSpec(f"m{i}", 144 * GB, 800 * GB) for i in range(2)]
    # 293.7 GB of weights, and 8192 tokens of 70 KB of KV kept twice over (planner.KV_MARGIN).
    with pytest.raises(P.PlanInfeasible, match=r"needs 294\.9 GB for weights and KV cache \(293\.7 GB and 2 x "
                                               r"0\.6 GB for 8192 tokens\), the nodes have 288\.0 GB: 6\.9 GB short"):
        P.plan(cost, nodes, context=8192)
    # Enough in total, but one MoE layer (about 5 GB at 3-bit) is larger than every node.
    small = [P.NodeSpec(f"s{i}", 4 * GB, 273 * GB) for i in range(100)]
    with pytest.raises(P.PlanInfeasible, match=r"layer 3 \(moe\) needs 5\.1 GB .* fits on no node"):
        P.plan(cost, small)
    # Enough in total and per layer, but whole layers do not pack into 8 x 48 GB at 4-bit.
    cost4 = load_model_cost(CONFIGS / "deepseek_v3.json", bits=4)
    with pytest.raises(P.PlanInfeasible, match="no contiguous split of the 61 layers"):
        P.plan(cost4, [P.NodeSpec(f"mini{i}", 48 * GB, 273 * GB) for i in range(8)])
    assert issubclass(P.PlanInfeasible, ValueError)


def test_faster_node_gets_more_layers():
    cost = load_model_cost(CONFIGS / "llama_3_1_405b.json", bits=4)
    nodes = [P.NodeSpec("slow", 200 * GB, 400 * GB), P.NodeSpec("fast", 200 * GB, 800 * GB)]
    plan = P.plan(cost, nodes)
    slow, fast = plan.stages
    assert fast.num_layers > 1.5 * slow.num_layers
    # Measured profiles work the same way.
    measured = [P.NodeSpec("a", 200 * GB, layer_seconds={"dense": 0.002}, head_seconds=0.004),
                P.NodeSpec("b", 200 * GB, layer_seconds={"dense": 0.001}, head_seconds=0.002)]
    a, b = P.plan(cost, measured).stages
    assert b.num_layers > a.num_layers


def test_node_too_small_is_left_out():
    cost = load_model_cost(CONFIGS / "qwen3_235b_a22b.json", bits=4)
    nodes = [P.NodeSpec("big0", 100 * GB, 800 * GB), P.NodeSpec("tiny", 1 * GB, 800 * GB),
             P.NodeSpec("big1", 100 * GB, 800 * GB)]
    plan = P.plan(cost, nodes)
    assert plan.unused == ("tiny",)
    assert [s.node for s in plan.stages] == ["big0", "big1"]
    check_plan(plan, cost, nodes, 8192)


def test_last_stage_carries_the_head():
    # Two equal nodes: the head (about 1.5 MoE layers of reading) makes the last stage take fewer layers.
    cost = load_model_cost(CONFIGS / "deepseek_v3.json", bits=3)
    nodes = [P.NodeSpec(f"n{i}", 512 * GB, 800 * GB) for i in range(2)]
    first, last = P.plan(cost, nodes).stages
    assert last.num_layers < first.num_layers
    # Measured: 1 ms a layer, 5 ms of head, 0.5 ms a hop -> 33 + 28 layers, 33.5 ms each.
    nodes = [P.NodeSpec(f"n{i}", 512 * GB, layer_seconds={"dense": 1e-3, "moe": 1e-3}, head_seconds=5e-3)
             for i in range(2)]
    plan = P.plan(cost, nodes, hop_seconds=0.5e-3)
    assert plan.ranges == [(0, 33), (33, 61)]
    assert [s.seconds for s in plan.stages] == pytest.approx([33.5e-3, 33.5e-3])
    assert plan.tokens_per_s_one_stream == pytest.approx(1 / 67e-3)
    assert plan.tokens_per_s_pipeline == pytest.approx(2 / 67e-3)


@pytest.mark.parametrize("bits,budgets,fits", [
    (3, [512] * 2, True), (3, [192] * 3, True), (3, [192] * 2, True), (3, [144] * 2, False),
    (4, [512] * 2, True), (4, [192] * 3, True), (4, [144] * 3, True), (4, [178] * 2, False),
])
def test_deepseek_v3_plans(bits, budgets, fits):
    cost = load_model_cost(CONFIGS / "deepseek_v3.json", bits=bits)
    assert cost.num_layers == 61
    assert [l.kind for l in cost.layers] == ["dense"] * 3 + ["moe"] * 58
    nodes = [P.NodeSpec(f"mac{i}", gb * GB, 800 * GB) for i, gb in enumerate(budgets)]
    if not fits:
        with pytest.raises(P.PlanInfeasible, match="short"):
            P.plan(cost, nodes)
        return
    plan = P.plan(cost, nodes, context=8192, concurrency=2)
    check_plan(plan, cost, nodes, 8192, 2)
    assert len(plan.stages) == len(budgets)   # identical nodes: every one of them helps


def test_every_node_gets_layers():
    # Equal layers, a head worth three layers, three stages already running: the last takes fewer.
    cost = ModelCost("t", "t", tuple(LayerCost("dense", 0, 0, GB, GB, 0) for _ in range(12)),
                     0, 0, 0, 0, 0, 0, False, None, 64, "config")
    nodes = [P.NodeSpec(f"n{i}", 100 * GB, layer_seconds={"dense": 1.0}, head_seconds=3.0) for i in range(3)]
    assert P.plan(cost, nodes, every_node=True).ranges == [(0, 5), (5, 10), (10, 12)]
    with pytest.raises(P.PlanInfeasible, match="cannot give each of 15 nodes"):
        P.plan(cost, nodes * 5, every_node=True)


def test_parse_units():
    assert parse_size("192GB") == 192 * GB
    assert parse_size("144 GiB") == 144 * 2**30
    assert parse_size("1.5TB") == 1.5e12
    assert parse_size("512mb") == 512 * 10**6
    assert parse_bandwidth("800GB/s") == 800e9
    with pytest.raises(ValueError, match="unit"):
        parse_size("192")
    assert expand_list("3x192GB, a=64GB,") == ["192GB"] * 3 + ["a=64GB"]


def _shortfall(cost: ModelCost, memory: float, context: int) -> float:
    """Bytes missing for every layer's weights, embedding and head, and one
    stream's KV cache, summed from the cost model's parts (not the planner's)."""
    weights = sum(l.weight_bytes for l in cost.layers) + cost.embed_bytes + cost.head_bytes
    weights -= cost.embed_bytes if cost.tied else 0  # one matrix for both
    kv = sum(l.kv_bytes_per_token for l in cost.layers) * context
    return weights + P.KV_MARGIN * kv - memory


def _args(*argv):
    p = argparse.ArgumentParser()
    plan_command.add_arguments(p)
    return p.parse_args(list(argv))


def test_cli_json(capsys):
    rc = plan_command.run(_args("--model", str(CONFIGS / "deepseek_v3.json"), "--nodes", "3x144GB", "--bits", "4",
                     "--bandwidth", "800GB/s", "--json"))
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] and out["num_layers"] == 61 and out["bandwidth_assumed"] is False
    ranges = [(s["start"], s["end"]) for s in out["stages"]]
    assert ranges[0][0] == 0 and ranges[-1][1] == 61 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(s["weight_bytes"] + s["kv_bytes"] <= 144 * GB for s in out["stages"])
    assert out["tokens_per_s_pipeline"] > out["tokens_per_s_one_stream"] > 0


def test_cli_table_and_infeasible(capsys):
    qwen = str(CONFIGS / "qwen3_235b_a22b.json")
    assert plan_command.run(_args("--model", qwen, "--nodes", "96GB,96GB", "--bits", "4")) == 0
    out = capsys.readouterr().out
    assert "800 GB/s assumed" in out and "[0, " in out and "tokens/s" in out
    rc = plan_command.run(_args("--model", str(CONFIGS / "deepseek_v3.json"), "--nodes", "144GB,144GB", "--bits", "3",
                                "--context", "8192", "--concurrency", "1"))
    assert rc == 2
    short = _shortfall(load_model_cost(CONFIGS / "deepseek_v3.json", bits=3), 2 * 144 * GB, context=8192)
    assert f"{short / 1e9:.1f} GB short" in capsys.readouterr().err
    rc = plan_command.run(_args("--model", str(CONFIGS / "deepseek_v3.json"), "--nodes", "2x144GB", "--bits", "3",
                                "--json"))
    assert rc == 2 and "short" in json.loads(capsys.readouterr().out)["error"]
    assert plan_command.run(_args("--model", str(CONFIGS / "deepseek_v3.json"), "--nodes", "2x144GB",
                       "--bandwidth", "800GB/s,800GB/s,800GB/s")) == 2


# -- `--bits auto`: the most bits that fit -------------------------------------------------

DSV3 = CONFIGS / "deepseek_v3.json"


def _dsv3_cost(spec):
    return load_model_cost(DSV3, quant=spec)


def test_auto_bits_fit_deepseek_v3_on_two_178GB_above_3_bits():
    """The Done-when: DeepSeek-V3 on two M2 Ultras at a raised wired limit (178 GB each):
    4-bit does not fit, and --bits auto finds a fitting mix above 3 bits on average."""
    nodes = [P.NodeSpec(f"m{i}", 178 * GB, bandwidth_bytes_per_s=800 * GB) for i in range(2)]
    with pytest.raises(P.PlanInfeasible, match="short"):
        P.plan(_dsv3_cost(QuantSpec("4")), nodes, context=8192)
    choice = B.plan_bits(_dsv3_cost, nodes, context=8192)
    check_plan(choice.plan, choice.cost, nodes, 8192)
    assert choice.cost.mean_bits > 3.5 and choice.higher == "4" and choice.raised > 0
    assert choice.cost.weight_bytes < 356 * GB < _dsv3_cost(QuantSpec("4")).weight_bytes
    # The most that fits: the next layer in the raising order at `higher` does not.
    L = choice.cost.num_layers
    more = set(B.raise_order(L)[:choice.raised + 1])
    spec = QuantSpec("4", 64, tuple("4" if i in more else choice.lower for i in range(L)))
    with pytest.raises(P.PlanInfeasible):
        P.plan(_dsv3_cost(spec), nodes, context=8192)
    # Every layer's bytes and the stage sums are those of its own rung.
    for i, l in enumerate(choice.cost.layers):
        assert l.weight_bytes == _dsv3_cost(QuantSpec(choice.spec.layer(i))).layers[i].weight_bytes
    short = _shortfall(_dsv3_cost(QuantSpec("4")), 2 * 178 * GB, context=8192)
    assert f"{short / 1e9:.1f} GB short" in choice.trade() and "4-bit" in choice.trade()


def test_auto_bits_ends_of_the_ladder():
    roomy = [P.NodeSpec("big", 2000 * GB, bandwidth_bytes_per_s=800 * GB)]
    choice = B.plan_bits(_dsv3_cost, roomy)
    assert choice.spec == QuantSpec("8") and choice.higher is None and "nothing given up" in choice.trade()
    with pytest.raises(P.PlanInfeasible, match="not even 3-bit fits"):
        B.plan_bits(_dsv3_cost, [P.NodeSpec("small", 100 * GB, bandwidth_bytes_per_s=800 * GB)])
    assert B.raise_order(5) == [0, 4, 1, 3, 2] and B.raise_order(4) == [0, 3, 1, 2]


def test_recipe_rungs_cost_what_mlx_lm_gives_each_module():
    """mixed_3_6: 6 bits for down projections of mlx-lm's "more bits" layers (first and last
    eighth, every third between) and the output head, 3 bits elsewhere."""
    cost = _dsv3_cost(QuantSpec("mixed_3_6"))
    three, four = _dsv3_cost(QuantSpec("3")), _dsv3_cost(QuantSpec("4"))
    assert three.weight_bytes < cost.weight_bytes < four.weight_bytes
    more = [i for i in range(61) if i < 7 or i >= 53 or (i - 7) % 3 == 2]
    for i, l in enumerate(cost.layers):
        assert (l.weight_bytes > three.layers[i].weight_bytes) == (i in more)
    assert cost.head_bytes > three.head_bytes and cost.embed_bytes == three.embed_bytes


def test_measured_times_scale_with_the_bytes_read():
    four, three = _dsv3_cost(QuantSpec("4")), _dsv3_cost(QuantSpec("3"))
    node = P.NodeSpec("m", 178 * GB, layer_seconds={"dense": 0.002, "moe": 0.004}, head_seconds=0.01,
                      profiled=four)
    layers4, _, head4 = node.times(four)
    layers3, _, head3 = node.times(three)
    assert layers4[10] == pytest.approx(0.004)
    assert layers3[10] == pytest.approx(0.004 * three.layers[10].read_bytes / four.layers[10].read_bytes)
    assert head3 < head4 == pytest.approx(0.01)


def test_cli_auto_shows_bits_per_stage_and_the_trade(capsys):
    assert plan_command.run(_args("--model", str(DSV3), "--nodes", "178GB,178GB", "--bits", "auto",
                                  "--bandwidth", "800GB/s", "--context", "8192")) == 0
    out = capsys.readouterr().out
    assert "--bits auto:" in out and "quality: 4-bit everywhere" in out
    assert "bits" in next(l for l in out.splitlines() if l.startswith("stage")).split() and "x4 + " in out
    assert plan_command.run(_args("--model", str(DSV3), "--nodes", "178GB,178GB", "--bits", "auto", "--json",
                                  "--context", "8192")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mean_bits"] > 3 and len(out["layer_bits"]) == 61 and all(s["mean_bits"] > 3 for s in out["stages"])
    assert sum(s["weight_bytes"] for s in out["stages"]) == out["weight_bytes"]


# -- balancing for prefill and decode ---------------------------------------------------------


def _macs(n, memory_gb=144, flops=25e12):
    return [P.NodeSpec(f"m{i}", memory_gb * GB, 800 * GB, flops_per_s=flops) for i in range(n)]


def test_prefill_mix_gives_the_last_stage_more_layers_and_a_shorter_ttft():
    """The head costs nothing in prefill chunks: weighted 10 prompt tokens per generated one,
    the last stage takes more layers than a decode-only split gives it, and the first token
    comes sooner, at some decode speed."""
    cost = _dsv3_cost(QuantSpec("4"))
    nodes = _macs(3)
    mixed = P.plan(cost, nodes)  # Workload(): 10 prompt tokens per generated token
    decode = P.plan(cost, nodes, workload=P.Workload(0))
    check_plan(mixed, cost, nodes, 8192)
    assert mixed.stages[-1].num_layers > decode.stages[-1].num_layers
    assert mixed.ttft(2048) < decode.ttft(2048)
    assert mixed.tokens_per_s_pipeline < decode.tokens_per_s_pipeline
    assert mixed.stages[-1].prefill_seconds < mixed.stages[-1].seconds  # no head, and compute at a chunk
    # Each is the best at what it balances for: the slowest stage's decode + 10 x prefill time.
    def objective(p):
        return max(s.seconds + 10 * s.prefill_seconds for s in p.stages)

    assert objective(mixed) <= objective(decode)
    assert decode.max_seconds <= mixed.max_seconds


def test_without_compute_figures_the_workload_changes_nothing():
    cost = _dsv3_cost(QuantSpec("4"))
    paper = [P.NodeSpec(f"m{i}", 144 * GB, 800 * GB) for i in range(3)]  # no flops: prefill not costed
    assert P.plan(cost, paper).ranges == P.plan(cost, paper, workload=P.Workload(0)).ranges
    assert P.plan(cost, paper).ttft(2048) is None
    assert P.plan(cost, _macs(3), workload=P.Workload(0)).ranges == P.plan(cost, paper).ranges
    with pytest.raises(ValueError, match="prompt ratio must not be negative"):
        P.Workload(-1)


def test_ttft_is_the_pipeline_fill_and_the_slowest_stage_per_later_chunk():
    cost = ModelCost("t", "t", tuple(LayerCost("dense", 10**9, 10**9, GB, GB, 0) for _ in range(4)),
                     0, 0, 0, 0, 0, 0, False, None, 64, "config")
    nodes = [P.NodeSpec(f"n{i}", 10 * GB, 1000 * GB, flops_per_s=f) for i, f in enumerate((2e12, 1e12))]
    p = P.plan(cost, nodes, workload=P.Workload(10, chunk_tokens=100), hop_seconds=0.001)
    prefill = [s.prefill_seconds for s in p.stages]
    # Per token: 2 GFLOP per layer over the node's flops, a layer's GB read once per 100-token chunk.
    assert prefill == pytest.approx([s.num_layers * (2e9 / f + 1e9 / 1e14) + 0.001 / 100
                                     for s, f in zip(p.stages, (2e12, 1e12))])
    chunk = [100 * x for x in prefill]
    # 1001 tokens: 10 chunks of the first 1000, then the last token as a decode step.
    assert p.ttft(1001) == pytest.approx(sum(chunk) + 9 * max(chunk) + p.sum_seconds)
    assert p.ttft(1) == pytest.approx(p.sum_seconds)


def test_cli_shows_the_chosen_and_the_decode_only_split_for_deepseek_v3(capsys):
    args = ("--model", str(DSV3), "--nodes", "3x144GB", "--bits", "4", "--bandwidth", "800GB/s")
    assert plan_command.run(_args(*args)) == 0
    out = capsys.readouterr().out
    assert "compute: 25 TFLOPS assumed" in out and "balanced for 10 prompt tokens per generated token" in out
    chosen, decode_only = [l for l in out.splitlines() if "TTFT" in l]
    assert chosen.split("layers")[1].split()[:5] == ["21", "/", "20", "/", "20"]
    assert decode_only.split("layers")[1].split()[:5] == ["21", "/", "21", "/", "19"]
    assert plan_command.run(_args(*args, "--json", "--flops", "30TFLOPS", "--prompt-tokens", "512")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["flops_assumed"] is False and out["workload"]["prompt_tokens"] == 512
    assert 0 < out["ttft_s"] < out["decode_only"]["ttft_s"]
    assert out["decode_only"]["tokens_per_s_pipeline"] >= out["tokens_per_s_pipeline"]
    assert plan_command.run(_args(*args, "--prompt-ratio", "0")) == 0
    assert "balanced for decode alone" in capsys.readouterr().out
    assert plan_command.parse_flops("25TFLOPS") == 25e12 == plan_command.parse_flops("2.5e13")
    with pytest.raises(ValueError, match="cannot read compute"):
        plan_command.parse_flops("fast")


def test_measured_prefill_weighs_each_decode_rows_share_of_prompt_tokens():
    """Nodes that timed prefill themselves: a decode step of 8 rows generates 8 tokens, so it
    carries 8 x prompt_ratio prompt tokens' prefill; the head (decode only) then moves layers
    to the last stage's side no further than that balance."""
    cost = ModelCost("t", "t", tuple(LayerCost("dense", 10**6, 10**6, 10**6, 10**6, 0) for _ in range(30)),
                     0, 0, 0, 0, 0, 0, False, None, 64, "config")

    def nodes(rows):
        return [P.NodeSpec(f"n{i}", 10 * GB, layer_seconds={"dense": 0.018}, head_seconds=0.16,
                           prefill_layer_seconds={"dense": 0.002}, decode_rows=rows) for i in range(2)]

    decode = P.plan(cost, nodes(8), workload=P.Workload(0), every_node=True)
    assert decode.ranges == [(0, 19), (19, 30)]  # 19 x 18 ms against 11 x 18 + 160 ms
    mixed = P.plan(cost, nodes(8), every_node=True)  # 80 prompt tokens per step: 160 ms a layer
    assert mixed.ranges == [(0, 15), (15, 30)]
    assert [s.prefill_seconds for s in mixed.stages] == pytest.approx([0.030, 0.030])
    one_row = P.plan(cost, nodes(1), every_node=True)  # 10 prompt tokens a step: 38 ms a layer
    assert one_row.ranges == [(0, 17), (17, 30)]
    with pytest.raises(ValueError, match="at least one token"):
        P.plan(cost, nodes(0))


# -- context planned with the weights ----------------------------------------------------------

QWEN = CONFIGS / "qwen3_235b_a22b.json"
LLAMA = CONFIGS / "llama_3_1_405b.json"


@pytest.mark.parametrize("bits", [8, 4])
def test_kv_bytes_are_what_mlx_lms_quantized_cache_holds(bits):
    """The formula (params/quant.py kv_bytes) against the arrays of mlx-lm's own QuantizedKVCache."""
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache

    from mlxpipe.shards.params.quant import kv_bytes

    cache = QuantizedKVCache(group_size=64, bits=bits)
    keys = mx.random.normal((1, 4, 256, 128)).astype(mx.float16)  # 4 KV heads x 128, 256 positions
    cache.update_and_fetch(keys, keys)
    held = sum(a.nbytes for part in (cache.keys, cache.values) for a in part)
    assert held == kv_bytes(256 * 2 * 4 * 128, bits, 64, 2)
    assert kv_bytes(2 * 4 * 128, 16) == 2 * 4 * 128 * 2
    with pytest.raises(ValueError, match="KV bits 7"):
        kv_bytes(128, 7)


def test_kv_per_token_of_the_shipped_configs():
    """DeepSeek-V3's latent cache is about 70 KB a token; Qwen3-235B-A22B's GQA cache 192 KB
    (94 layers x 4 KV heads x 128 x 2 x 2 bytes), 0.28 of that at 4 bits."""
    dsv3, qwen = load_model_cost(DSV3, bits=4), load_model_cost(QWEN, bits=4)
    assert dsv3.kv_bytes_per_token == 61 * (512 + 64) * 2
    assert qwen.kv_bytes_per_token == 94 * 4 * 128 * 2 * 2
    assert C.at_kv_bits(qwen, 8).kv_bytes_per_token == 94 * 2 * 4 * (128 + 2 * 2 * 2)
    assert C.at_kv_bits(qwen, 4).kv_bytes_per_token / qwen.kv_bytes_per_token == pytest.approx(0.28125)
    assert dsv3.max_positions == 163840 and qwen.max_positions == 40960
    with pytest.raises(ValueError, match="16-bit cost"):
        C.at_kv_bits(C.at_kv_bits(qwen, 4), 8)


@pytest.mark.parametrize("every_node", [False, True])
def test_fits_is_what_the_planner_finds_a_plan_for(every_node):
    rng = random.Random(7)
    for _ in range(300):
        cost = toy_model(rng, rng.randint(1, 7))
        nodes = toy_nodes(rng, rng.randint(1, 4))
        context, streams = rng.choice([1, 1000, 100_000, 1_000_000]), rng.choice([1, 4])
        try:
            P.plan(cost, nodes, context=context, concurrency=streams, every_node=every_node)
            planned = True
        except P.PlanInfeasible:
            planned = False
        assert P.fits(cost, nodes, context, streams, every_node) == planned


def _longest(cost, nodes, streams, most):
    """Checks a context table's cell from the planner: it plans, and a token more does not."""
    return lambda c: (c == most or not P.fits(cost, nodes, c + 1, streams)) and c and P.plan(
        cost, nodes, context=c, concurrency=streams).stages


@pytest.mark.parametrize("model, nodes, bits", [(DSV3, "178GB,178GB", "auto"), (DSV3, "3x144GB", "4"),
                                                (QWEN, "2x96GB", "4")])
def test_cli_context_table_is_the_longest_context_that_fits(capsys, model, nodes, bits):
    """For 16-, 8- and 4-bit KV, 1 and 4 streams: the longest context each stream may hold,
    layers placed for it; fewer KV bits and fewer streams hold more."""
    assert plan_command.run(_args("--model", str(model), "--nodes", nodes, "--bits", bits, "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    weights = load_model_cost(model, quant=QuantSpec(out["layer_bits"][0], 64, tuple(out["layer_bits"]))) \
        if bits == "auto" else load_model_cost(model, bits=int(bits))
    specs = [P.NodeSpec(n["name"], n["memory_bytes"], 800 * GB) for n in out["nodes"]]
    most = out["model_context"]
    table = {r["kv_bits"]: r for r in out["context_table"]}
    assert list(table) == [16, 8, 4]
    for kv_bits, row in table.items():
        cost = weights if kv_bits == 16 else C.at_kv_bits(weights, kv_bits)
        assert row["kv_bytes_per_token"] == cost.kv_bytes_per_token
        for streams, longest in row["longest_context"].items():
            assert 0 < longest <= most and _longest(cost, specs, int(streams), most)(longest)
    one, four = ([table[b]["longest_context"][n] for b in (16, 8, 4)] for n in ("1", "4"))
    assert one == sorted(one) and four == sorted(four) and all(f <= o for f, o in zip(four, one))
    assert four[0] < four[2]  # 4-bit KV holds more where 16-bit does not reach the model's own
    assert plan_command.run(_args("--model", str(model), "--nodes", nodes, "--bits", bits)) == 0
    text = capsys.readouterr().out
    assert "longest context that fits" in text and f"{four[0]}" in text and "(model's max)" in text


def test_default_context_is_the_models_own_and_auto_bits_trade_bits_for_it(capsys):
    """DeepSeek-V3 on 2 x 178 GB: without --context the plan keeps room for one stream of
    the model's 163840 tokens, and --bits auto chooses fewer bits than for 8192."""
    args = ("--model", str(DSV3), "--nodes", "178GB,178GB", "--bits", "auto", "--json")
    assert plan_command.run(_args(*args)) == 0
    full = json.loads(capsys.readouterr().out)
    assert plan_command.run(_args(*args, "--context", "8192")) == 0
    short = json.loads(capsys.readouterr().out)
    assert full["context"] == full["model_context"] == 163840 and not full["context_clamped"]
    assert short["context"] == 8192 and full["concurrency"] == 1
    assert full["mean_bits"] < short["mean_bits"]
    kv = full["kv_bytes_per_token"] * 163840
    assert sum(s["kv_bytes"] for s in full["stages"]) == kv
    assert sum(s["weight_bytes"] for s in full["stages"]) + P.KV_MARGIN * kv <= 2 * 178 * GB
    # 8-bit KV leaves more to the weights.
    assert plan_command.run(_args(*args, "--kv-bits", "8")) == 0
    assert json.loads(capsys.readouterr().out)["mean_bits"] > full["mean_bits"]


def test_a_context_that_does_not_fit_is_clamped_unless_declared(capsys):
    """Llama-3.1-405B at 4 bits on 2 x 144 GB: its 131072 tokens do not fit for one stream; the
    plan takes the longest that does. Declared, the same context is refused, saying why."""
    args = ("--model", str(LLAMA), "--nodes", "2x144GB", "--bits", "4", "--json")
    assert plan_command.run(_args(*args)) == 0
    out = json.loads(capsys.readouterr().out)
    cost = load_model_cost(LLAMA, bits=4)
    nodes = [P.NodeSpec(f"n{i}", 144 * GB, 800 * GB) for i in range(2)]
    assert out["context_clamped"] and out["context"] < out["model_context"] == 131072
    assert P.fits(cost, nodes, out["context"]) and not P.fits(cost, nodes, out["context"] + 1)
    assert out["context_table"][0]["longest_context"]["1"] == out["context"]
    assert plan_command.run(_args(*args, "--context", "131072")) == 2
    assert "short" in json.loads(capsys.readouterr().out)["error"]
    assert plan_command.run(_args(*args[:-1], "--context", "131072")) == 2
    assert "131072 tokens" in capsys.readouterr().err


def test_a_larger_context_moves_layers_to_the_node_with_more_memory():
    """Llama-3.1-405B (516 KB of KV a token) on a 192 GB and a 128 GB Mac of equal speed:
    at 8k the layers split evenly; at 64k the smaller one cannot hold half the layers and
    their KV, so layers move to the larger."""
    cost = load_model_cost(LLAMA, bits=4)
    nodes = [P.NodeSpec("studio", 192 * GB, 800 * GB), P.NodeSpec("mini", 128 * GB, 800 * GB)]
    short = P.plan(cost, nodes, context=8192, workload=P.Workload(0))
    long = P.plan(cost, nodes, context=65536, workload=P.Workload(0))
    assert short.ranges == [(0, 63), (63, 126)]
    assert long.stages[0].num_layers > 63 and long.stages[1].weight_bytes + P.KV_MARGIN * long.stages[1].kv_bytes \
        <= 128 * GB < long.stages[1].weight_bytes + P.KV_MARGIN * sum(l.kv_bytes_per_token for l in cost.layers[63:]) * 65536
    check_plan(long, cost, nodes, 65536)
    assert long.max_seconds > short.max_seconds  # the price: the larger node is now the slower stage


def test_plan_context_takes_the_declared_or_the_longest_that_fits():
    cost = ModelCost("t", "t", tuple(LayerCost("dense", 0, 0, GB, GB, 1000) for _ in range(4)),
                     0, 0, 0, 0, 0, 0, False, None, 64, "config")
    nodes = [P.NodeSpec("n", 6 * GB, 800 * GB)]  # 2 GB for KV: 2 x 4000 bytes a token -> 250000 tokens
    at = lambda c: P.plan(cost, nodes, context=c)  # noqa: E731
    fits = lambda c: P.fits(cost, nodes, c)  # noqa: E731
    assert C.plan_context(at, 100_000, fits)[::2] == (100_000, False)
    assert C.plan_context(at, 10**6, fits)[::2] == (250_000, True)
    assert C.plan_context(at, 10**6, fits, context=1000)[::2] == (1000, False)
    with pytest.raises(P.PlanInfeasible):
        C.plan_context(at, 10**6, fits, context=300_000)
    assert C.longest_context(lambda c: False, 100) == 0
    with pytest.raises(P.PlanInfeasible, match="not even one token"):
        C.plan_context(lambda c: P.plan(cost, [P.NodeSpec("n", GB, 800 * GB)], context=c), 100,
                       lambda c: False)


def test_one_kv_bits_knob_quantizes_the_stages_and_sizes_the_plan(capsys):
    """serve's --kv-bits/--kv-group-size/--quantized-kv-start are what the stages load with and
    what the scheduler switches at; plan's same options price the KV cache by the one formula."""
    from mlxpipe.server import config as tree
    from mlxpipe.server.cluster import sizing
    from mlxpipe.shards.params.kv import KvQuant

    p = argparse.ArgumentParser()
    tree.add_arguments(p, tree.ClusterConfig)
    cfg = tree.from_args(tree.ClusterConfig, p.parse_args(["--kv-bits", "8", "--kv-group-size", "32",
                                                            "--quantized-kv-start", "100"]))
    assert sizing.stage_limits(cfg, 1 << 30).kv == KvQuant(8, 32, 100)
    assert sizing.scheduler_config(cfg, 2, 1000, 0, 1.0).kv_start == 100
    plain = tree.from_args(tree.ClusterConfig, p.parse_args([]))
    assert plain.kv_bits == 16 and sizing.kv_quant(plain) is None and sizing.stage_limits(plain, 1 << 30).kv is None
    args = ("--model", str(DSV3), "--nodes", "3x144GB", "--bits", "4", "--json")
    rows = {}
    for group in ("32", "64"):
        assert plan_command.run(_args(*args, "--kv-bits", "8", "--kv-group-size", group)) == 0
        rows[group] = json.loads(capsys.readouterr().out)
    base = load_model_cost(DSV3, bits=4)
    for group, out in rows.items():
        assert out["kv_bits"] == 8 and out["kv_group_size"] == int(group)
        assert out["kv_bytes_per_token"] == C.at_kv_bits(base, 8, int(group)).kv_bytes_per_token
    assert rows["32"]["kv_bytes_per_token"] > rows["64"]["kv_bytes_per_token"]  # more scales and biases
