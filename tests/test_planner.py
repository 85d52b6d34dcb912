"""The partition planner: exact against brute force, memory-safe, and sized right on real configs."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import struct
from pathlib import Path

import pytest

from mlxpipe.server import planner as P

CONFIGS = Path(__file__).parent / "configs"
GB = 10**9


def toy_model(rng: random.Random, num_layers: int) -> P.ModelCost:
    layers = []
    for _ in range(num_layers):
        kind = rng.choice(["dense", "moe"])
        w = rng.randint(1, 10) * GB
        layers.append(P.LayerCost(kind, 0, 0, w, w if kind == "dense" else w // 4, rng.randint(0, 3) * 1000))
    tied = rng.random() < 0.3
    embed = rng.randint(0, 3) * GB
    head = embed + rng.randint(0, 2) * GB if tied else rng.randint(0, 4) * GB
    return P.ModelCost("toy", "toy", tuple(layers), 0, embed, embed // 1000, 0, head, head, tied,
                       None, 64, "config")


def toy_nodes(rng: random.Random, n: int) -> list:
    nodes = []
    for i in range(n):
        mem = rng.randint(3, 30) * GB
        if rng.random() < 0.3:   # measured
            nodes.append(P.NodeSpec(f"n{i}", mem, layer_seconds={"dense": rng.uniform(0.001, 0.02),
                                                                  "moe": rng.uniform(0.001, 0.02)},
                                    embed_seconds=rng.uniform(0, 0.005), head_seconds=rng.uniform(0, 0.03)))
        else:                    # on paper
            nodes.append(P.NodeSpec(f"n{i}", mem, bandwidth_bytes_per_s=rng.choice([100, 273, 400, 800]) * GB))
    return nodes


def check_plan(plan: P.Plan, cost: P.ModelCost, nodes, context: int, concurrency: int = 1) -> None:
    # Contiguous, in node order, every layer exactly once, within memory.
    assert plan.stages[0].start == 0 and plan.stages[-1].end == cost.num_layers
    covered = [i for s in plan.stages for i in range(s.start, s.end)]
    assert covered == list(range(cost.num_layers))
    assert all(s.end > s.start for s in plan.stages)
    idx = [s.node_index for s in plan.stages]
    assert idx == sorted(set(idx))
    for s in plan.stages:
        assert s.weight_bytes + s.kv_bytes <= nodes[s.node_index].memory_bytes
        kv = sum(l.kv_bytes_per_token for l in cost.layers[s.start:s.end]) * context * concurrency
        assert s.kv_bytes == kv
        assert s.weight_bytes == cost.stage_weight_bytes(s.start, s.end)
    assert set(plan.unused) == {n.name for i, n in enumerate(nodes) if i not in idx}


def test_dp_matches_brute_force_on_random_instances():
    rng = random.Random(1234)
    feasible = infeasible = 0
    for _ in range(300):
        cost = toy_model(rng, rng.randint(1, 7))
        nodes = toy_nodes(rng, rng.randint(1, 4))
        context, hop = rng.choice([1, 1000, 100_000]), rng.choice([0.0, 0.002])
        try:
            want = P.brute_force(cost, nodes, context=context, hop_seconds=hop)
        except P.PlanInfeasible:
            with pytest.raises(P.PlanInfeasible):
                P.plan(cost, nodes, context=context, hop_seconds=hop)
            infeasible += 1
            continue
        got = P.plan(cost, nodes, context=context, hop_seconds=hop)
        check_plan(got, cost, nodes, context)
        check_plan(want, cost, nodes, context)
        assert math.isclose(got.max_seconds, want.max_seconds, rel_tol=1e-12)
        assert math.isclose(got.sum_seconds, want.sum_seconds, rel_tol=1e-9)
        if got.sum_seconds == want.sum_seconds:   # then the tie goes to fewer stages in both
            assert len(got.stages) == len(want.stages)
        feasible += 1
    assert feasible > 100 and infeasible > 20   # both branches exercised


def test_ties_go_to_fewer_stages():
    # Free layers, a costly head: one stage or two give the same max and sum; one stage wins,
    # whether the lone stage is on the first node or (when the first is too small) on the second.
    cost = P.ModelCost("t", "t", tuple(P.LayerCost("dense", 0, 0, GB, GB, 0) for _ in range(4)),
                       0, 0, 0, 0, 0, 0, False, None, 64, "config")
    nodes = [P.NodeSpec(f"n{i}", 10 * GB, layer_seconds={"dense": 0.0}, head_seconds=0.01) for i in range(2)]
    plan = P.plan(cost, nodes)
    assert len(plan.stages) == 1 and plan.unused == ("n1",)
    nodes[0] = P.NodeSpec("n0", 3 * GB, layer_seconds={"dense": 0.0}, head_seconds=0.01)
    plan = P.plan(cost, nodes)
    assert [(s.node, s.start, s.end) for s in plan.stages] == [("n1", 0, 4)]


def test_infeasible_says_how_short():
    cost = P.load_model_cost(CONFIGS / "deepseek_v3.json", bits=3)
    nodes = [P.NodeSpec(f"m{i}", 144 * GB, 800 * GB) for i in range(2)]
    with pytest.raises(P.PlanInfeasible, match=r"needs 294\.3 GB for weights and KV cache, "
                                               r"the nodes have 288\.0 GB: 6\.3 GB short"):
        P.plan(cost, nodes, context=8192)
    # Enough in total, but one MoE layer (about 5 GB at 3-bit) is larger than every node.
    small = [P.NodeSpec(f"s{i}", 4 * GB, 273 * GB) for i in range(100)]
    with pytest.raises(P.PlanInfeasible, match=r"layer 3 \(moe\) needs 5\.0 GB .* fits on no node"):
        P.plan(cost, small)
    # Enough in total and per layer, but whole layers do not pack into 8 x 48 GB at 4-bit.
    cost4 = P.load_model_cost(CONFIGS / "deepseek_v3.json", bits=4)
    with pytest.raises(P.PlanInfeasible, match="no contiguous split of the 61 layers"):
        P.plan(cost4, [P.NodeSpec(f"mini{i}", 48 * GB, 273 * GB) for i in range(8)])
    assert issubclass(P.PlanInfeasible, ValueError)


def test_faster_node_gets_more_layers():
    cost = P.load_model_cost(CONFIGS / "llama_3_1_405b.json", bits=4)
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
    cost = P.load_model_cost(CONFIGS / "qwen3_235b_a22b.json", bits=4)
    nodes = [P.NodeSpec("big0", 100 * GB, 800 * GB), P.NodeSpec("tiny", 1 * GB, 800 * GB),
             P.NodeSpec("big1", 100 * GB, 800 * GB)]
    plan = P.plan(cost, nodes)
    assert plan.unused == ("tiny",)
    assert [s.node for s in plan.stages] == ["big0", "big1"]
    check_plan(plan, cost, nodes, 8192)


def test_last_stage_carries_the_head():
    # Two equal nodes: the head (about 1.5 MoE layers of reading) makes the last stage take fewer layers.
    cost = P.load_model_cost(CONFIGS / "deepseek_v3.json", bits=3)
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
    cost = P.load_model_cost(CONFIGS / "deepseek_v3.json", bits=bits)
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


def test_kv_cache_per_token():
    dsv3 = P.load_model_cost(CONFIGS / "deepseek_v3.json", bits=4)
    assert {l.kv_bytes_per_token for l in dsv3.layers} == {(512 + 64) * 2}        # MLA latent + rope key
    llama = P.load_model_cost(CONFIGS / "llama_3_1_405b.json", bits=4)
    assert {l.kv_bytes_per_token for l in llama.layers} == {2 * 8 * 128 * 2}      # GQA: K and V, 8 heads
    qwen = P.load_model_cost(CONFIGS / "qwen3_235b_a22b.json", bits=4)
    assert {l.kv_bytes_per_token for l in qwen.layers} == {2 * 4 * 128 * 2}


def test_parameter_counts_match_published_totals():
    # Published totals: DeepSeek-V3 671B (37B activated; the technical report and README),
    # Llama 3.1 405B (405.8B, as the Hugging Face model card counts it), Qwen3-235B-A22B
    # 235B total / 22B activated (its model card).
    dsv3 = P.load_model_cost(CONFIGS / "deepseek_v3.json")
    llama = P.load_model_cost(CONFIGS / "llama_3_1_405b.json")
    qwen = P.load_model_cost(CONFIGS / "qwen3_235b_a22b.json")
    assert dsv3.total_params == pytest.approx(671e9, rel=0.01)
    assert dsv3.active_params == pytest.approx(37e9, rel=0.02)
    assert llama.total_params == pytest.approx(405.8e9, rel=0.01)
    assert llama.active_params == llama.total_params
    assert qwen.total_params == pytest.approx(235e9, rel=0.01)
    assert qwen.active_params == pytest.approx(22e9, rel=0.02)


def test_4bit_sizes_match_published_mlx_checkpoints():
    # mlx-community/DeepSeek-V3-0324-4bit: 368,756,663 KiB = 377.6 GB, the storage size in exo's
    # model card for it (exo-explore/exo, MODEL_CARDS "deepseek-v3"); the same layout as DeepSeek-V3.
    dsv3 = P.load_model_cost(CONFIGS / "deepseek_v3.json", bits=4, group_size=64)
    assert dsv3.weight_bytes == pytest.approx(368_756_663 * 1024, rel=0.02)
    # No published byte count found for mlx-community/Meta-Llama-3.1-405B-Instruct-4bit or
    # mlx-community/Qwen3-235B-A22B-4bit; check instead that 4-bit group-64 weights are
    # (4 + 32/64) / 16 of the 16-bit ones (everything but norms/router quantized) and that the
    # parameter totals above hold, which fixes the size: 405.85B x 4.5/8 = 228.3 GB and
    # 235.1B x 4.5/8 = 132.3 GB.
    for name, total in [("llama_3_1_405b", 228.3e9), ("qwen3_235b_a22b", 132.3e9)]:
        q = P.load_model_cost(CONFIGS / f"{name}.json", bits=4)
        full = P.load_model_cost(CONFIGS / f"{name}.json")
        assert q.weight_bytes == pytest.approx(full.weight_bytes * 4.5 / 16, rel=0.005)
        assert q.weight_bytes == pytest.approx(total, rel=0.01)


def test_moe_reads_only_active_experts():
    dsv3 = P.load_model_cost(CONFIGS / "deepseek_v3.json", bits=4)
    moe = dsv3.layers[10]
    assert moe.read_bytes < moe.weight_bytes / 10
    assert dsv3.layers[0].read_bytes == dsv3.layers[0].weight_bytes
    # Per decoded token about 37B parameters are touched; the embedding is read one row at a time.
    assert dsv3.read_bytes == pytest.approx((dsv3.active_params - dsv3.embed_params) * 4.5 / 8, rel=0.01)


def test_tied_head_counted_once_on_a_single_stage():
    cfg = json.loads((CONFIGS / "llama_3_1_405b.json").read_text())
    cfg.update(num_hidden_layers=2, tie_word_embeddings=True)
    cost = P.model_cost(cfg, bits=4)
    assert cost.stage_weight_bytes(0, 2) == sum(l.weight_bytes for l in cost.layers) + cost.head_bytes
    assert cost.stage_weight_bytes(0, 1) + cost.stage_weight_bytes(1, 2) == \
        sum(l.weight_bytes for l in cost.layers) + cost.embed_bytes + cost.head_bytes


def _write_safetensors(path: Path, tensors: dict) -> None:
    header, offset = {}, 0
    for name, nbytes in tensors.items():
        header[name] = {"dtype": "U8", "shape": [nbytes], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_safetensors_headers_give_exact_bytes(tmp_path):
    cfg = json.loads((CONFIGS / "qwen3_235b_a22b.json").read_text())
    cfg.update(num_hidden_layers=2, quantization={"bits": 4, "group_size": 64})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {
        "model.embed_tokens.weight": 1000, "model.layers.0.self_attn.q_proj.weight": 300,
        "model.layers.0.mlp.switch_mlp.up_proj.weight": 1600})
    _write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {
        "model.layers.1.self_attn.q_proj.weight": 200, "model.layers.1.mlp.switch_mlp.up_proj.weight": 3200,
        "model.layers.2.mtp.weight": 999, "model.norm.weight": 10, "lm_head.weight": 2000})
    cost = P.load_model_cost(tmp_path)
    assert cost.source == "safetensors" and cost.bits == 4
    assert [l.weight_bytes for l in cost.layers] == [1900, 3400]
    assert [l.read_bytes for l in cost.layers] == [300 + 1600 * 8 // 128, 200 + 3200 * 8 // 128]
    assert (cost.embed_bytes, cost.head_bytes, cost.tied) == (1000, 2010, False)
    # Asking for other bits than the folder holds falls back to the config.
    assert P.load_model_cost(tmp_path, bits=3).source == "config"


def test_bad_safetensors_header_is_refused(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError, match="header"):
        P.read_safetensors_header(bad)


def test_balanced_ranges():
    # Equal layers, a head worth three layers: the last stage takes fewer.
    r = P.balanced_ranges(12, [1.0] * 12, 0.0, 3.0, 3)
    assert r == [(0, 5), (5, 10), (10, 12)]
    rng = random.Random(7)
    for _ in range(200):
        L, k = rng.randint(1, 9), rng.randint(1, 4)
        if k > L:
            continue
        times = [rng.uniform(0, 1) for _ in range(L)]
        embed, head = rng.uniform(0, 1), rng.uniform(0, 2)
        mem = [rng.randint(2, 12) for _ in range(k)] if rng.random() < 0.5 else None
        sizes = [rng.randint(1, 4) for _ in range(L)] if mem else None

        def stage_time(s, e):
            return sum(times[s:e]) + (embed if s == 0 else 0) + (head if e == L else 0)

        best = None
        for cuts in itertools.combinations(range(1, L), k - 1):
            b = (0, *cuts, L)
            if mem and any(sum(sizes[b[j]:b[j + 1]]) > mem[j] for j in range(k)):
                continue
            m = max(stage_time(b[j], b[j + 1]) for j in range(k))
            best = m if best is None else min(best, m)
        if best is None:
            with pytest.raises(P.PlanInfeasible):
                P.balanced_ranges(L, times, embed, head, k, mem, sizes)
            continue
        got = P.balanced_ranges(L, times, embed, head, k, mem, sizes)
        assert len(got) == k and got[0][0] == 0 and got[-1][1] == L
        assert all(s < e for s, e in got) and all(a[1] == b[0] for a, b in zip(got, got[1:]))
        assert max(stage_time(s, e) for s, e in got) == pytest.approx(best, rel=1e-9)
        if mem:
            assert all(sum(sizes[s:e]) <= m for (s, e), m in zip(got, mem))
    with pytest.raises(ValueError, match="non-empty"):
        P.balanced_ranges(3, [1.0] * 3, 0, 0, 4)


def test_parse_units():
    assert P.parse_size("192GB") == 192 * GB
    assert P.parse_size("144 GiB") == 144 * 2**30
    assert P.parse_size("1.5TB") == 1.5e12
    assert P.parse_size("512mb") == 512 * 10**6
    assert P.parse_bandwidth("800GB/s") == 800e9
    with pytest.raises(ValueError, match="unit"):
        P.parse_size("192")


def _args(*argv):
    p = argparse.ArgumentParser()
    P.add_arguments(p)
    return p.parse_args(list(argv))


def test_cli_json(capsys):
    rc = P.run(_args("--model", str(CONFIGS / "deepseek_v3.json"), "--nodes", "3x144GB", "--bits", "4",
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
    assert P.run(_args("--model", qwen, "--nodes", "96GB,96GB", "--bits", "4")) == 0
    out = capsys.readouterr().out
    assert "800 GB/s assumed" in out and "[0, " in out and "tokens/s" in out
    rc = P.run(_args("--model", str(CONFIGS / "deepseek_v3.json"), "--nodes", "144GB,144GB", "--bits", "3"))
    assert rc == 2
    assert "6.3 GB short" in capsys.readouterr().err
    rc = P.run(_args("--model", str(CONFIGS / "deepseek_v3.json"), "--nodes", "2x144GB", "--bits", "3", "--json"))
    assert rc == 2 and "short" in json.loads(capsys.readouterr().out)["error"]
    assert P.run(_args("--model", str(CONFIGS / "deepseek_v3.json"), "--nodes", "2x144GB",
                       "--bandwidth", "800GB/s,800GB/s,800GB/s")) == 2
