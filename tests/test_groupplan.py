"""Splitting a block across ranks (shards/models/tensor_parallel.py), in one process: each
rank's slice summed by hand gives the whole layer's output; what cannot be split says why.
And planning stages as groups from the links (server/cluster/groupplan.py): tensor parallel
inside a Thunderbolt 5 group, a pipeline over Ethernet, both where a cluster has both."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from mlxpipe.server.cluster import groupplan
from mlxpipe.server.cluster.cost import load_model_cost
from mlxpipe.server.cluster.linkplan import Hop, Links, parse_link
from mlxpipe.server.cluster.planner import NodeSpec, Workload
from mlxpipe.shards.models import tensor_parallel as tp

CONFIGS = Path(__file__).parent / "configs"
DSV3 = CONFIGS / "deepseek_v3.json"
TB5, ETHERNET = "80Gbps,10us", "1Gbps,1ms"


def test_runs_are_as_even_as_they_can_be_the_first_ranks_the_larger():
    assert tp.runs(9, 2) == [(0, 5), (5, 9)] and tp.runs(3, 3) == [(0, 1), (1, 2), (2, 3)]
    assert tp.Part(1, 2).run(1536, 32) == (768, 1536) and tp.Part(0, 2).run(96, 32) == (0, 64)


def _block_parts(path, layer: int, size: int):
    """Layer ``layer`` of the model at ``path`` whole, and split for each of ``size`` ranks (a
    group of one: each rank's sums are its own slice's, added up here)."""
    from mlxpipe.shards.models.slicing import load_stage

    whole, _ = load_stage(path, layer, layer + 1)
    parts = []
    for rank in range(size):
        stage, _ = load_stage(path, layer, layer + 1)
        tp.shard_blocks(stage.blocks, layer, tp.Part(rank, size), tp.Sums(mx.distributed.init()))
        parts.append(stage.blocks[0])
    return whole.blocks[0], parts


@pytest.mark.parametrize("size", [2, 3])
def test_uneven_heads_summed_over_ranks_are_the_whole_attention(default_model, size):
    """9 query heads over 3 KV heads: 5 + 4 (a KV head held by both), or 3 + 3 + 3."""
    whole, parts = _block_parts(default_model, 0, size)
    x = mx.random.normal((1, 7, 576), key=mx.random.key(0))  # float32: each slice's sum unrounded
    want = whole.self_attn(x, "causal")
    got = sum(p.self_attn(x, "causal") for p in parts)
    assert [p.self_attn.n_heads for p in parts] == ([6, 6] if size == 2 else [3, 3, 3])  # (zero heads padded in)
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item()
    assert mx.allclose(sum(p.mlp(x) for p in parts), whole.mlp(x), rtol=1e-4, atol=1e-4).item()


def test_latent_attention_and_experts_split_across_ranks(dsv3_model):
    """DeepSeek-V3: its MLA by heads, its experts across the ranks (each expert's 32 columns are one
    quantization group), its shared expert whole on rank 0."""
    whole, parts = _block_parts(dsv3_model, 1, 2)
    x = mx.random.normal((1, 5, 64), key=mx.random.key(1))
    assert all(p.self_attn.num_heads == 2 for p in parts)
    got = sum(p.self_attn(x) for p in parts)
    assert mx.allclose(got, whole.self_attn(x), rtol=1e-4, atol=1e-4).item()
    got = sum(p.mlp(x) for p in parts)
    assert mx.allclose(got, whole.mlp(x), rtol=1e-4, atol=1e-4).item()
    assert parts[0].mlp.inner.switch_mlp.down_proj.weight.shape[0] == 4


def test_what_cannot_be_split_says_which_layer_and_why(tmp_path, default_model, dsv3_model):
    from mlxpipe.bench import tiny

    config = json.loads((tiny.build("qwen3_next", tmp_path / "q", default_model, weights=False)
                         / "config.json").read_text())
    assert "linear_attn (Qwen3NextGatedDeltaNet) cannot be split across ranks" in tp.why_not(config, 2)
    dsv3 = json.loads((dsv3_model / "config.json").read_text())
    assert tp.why_not(dsv3, 2) is None  # 4 heads of 16 columns: cut at 32, a quantization group's edge
    assert "not on a quantization group boundary (groups of 32)" in tp.why_not(dsv3, 3)
    assert tp.why_not(json.loads((default_model / "config.json").read_text()), 2) is None


# -- planning groups from the links ----------------------------------------------------------------


def test_layouts_are_every_way_to_cut_the_nodes_in_order():
    assert groupplan.compositions(3) == [(1, 1, 1), (1, 2), (2, 1), (3,)]
    assert len(groupplan.compositions(5)) == 16
    # A ring: 2 (k - 1) steps of latency and 2 (k - 1) / k of the bytes.
    assert groupplan.allreduce_seconds(2, 1000, Hop(1e-5, 1e9)) == pytest.approx(2 * (1e-5 + 500 / 1e9))
    assert groupplan.allreduce_seconds(1, 1000, Hop(1.0, 1.0)) == 0.0


def _deepseek_on_four(links: list):
    cost = load_model_cost(DSV3, bits=4)
    nodes = [NodeSpec(f"mac{i}", 192 * 10**9, bandwidth_bytes_per_s=800e9, flops_per_s=25e12) for i in range(4)]
    config = dict(json.loads(DSV3.read_text()), quantization={"bits": 4, "group_size": 64})
    return groupplan.choose(cost, nodes, Links.in_a_row(7168 * 2, [parse_link(x) for x in links], 4), 7168,
                            lambda k: tp.why_not(config, k), context=8192, workload=Workload(0))


def test_deepseek_v3_on_four_macs_is_tensor_parallel_over_thunderbolt_and_a_pipeline_over_ethernet():
    best, choices = _deepseek_on_four([TB5])
    by = {c.widths: c for c in choices}
    assert best.widths == (4,), "an RDMA mesh: one stage over all four"
    assert best.one_stream > 1.5 * by[(1, 1, 1, 1)].one_stream
    best, choices = _deepseek_on_four([ETHERNET])
    assert best.widths == (1, 1, 1, 1), "milliseconds per all-reduce: cut between layers"
    best, _ = _deepseek_on_four([TB5, ETHERNET, TB5])  # two Thunderbolt pairs, Ethernet between them
    assert best.widths == (2, 2)


def test_plan_prints_the_layouts_beside_each_other(capsys):
    from mlxpipe.server.cli import plan as plan_command
    from mlxpipe.server.cli.main import build_parser

    args = build_parser().parse_args(["plan", "--model", str(DSV3), "--nodes", "4x192GB", "--bits", "4",
                                      "--link", TB5])
    assert plan_command.run(args) == 0
    out = capsys.readouterr().out
    assert "-> tensor parallel 4" in out and "   pipeline 1,1,1,1" in out and "mixed 2,2" in out


# -- naming groups ----------------------------------------------------------------------------------


def test_groups_named_by_hand_and_refused_with_one_line(default_model):
    from mlxpipe.server import config as tree
    from mlxpipe.server.cluster import groups
    from mlxpipe.server.cluster.model import open_model
    from mlxpipe.server.config import ClusterConfig

    layout = groups.from_nodes(["a:1+b:2", "c:3"])
    assert layout.leaders == ["a:1", "c:3"] and layout.ranks("a:1") == ["a:1", "b:2"] and layout.widths() == [2, 1]
    assert layout.without(["b:2"]).leaders == ["c:3"], "a group goes as a unit"
    assert groups.widths_of(2, [2]) == [2, 2] and groups.layout_of(list("pqr"), [2, 1]).followers == {"p": ["q"]}
    with pytest.raises(ValueError, match="--tp names 3 stages' ranks"):
        groups.widths_of(2, [2, 1, 1])
    assert tree._widths("auto") == [0] and tree._widths("2,1") == [2, 1]
    with pytest.raises(ValueError, match="--tp takes whole numbers"):
        tree._widths("2,x")
    with pytest.raises(ValueError, match="--tp auto groups remote nodes"):
        open_model(ClusterConfig(model=str(default_model), tp=[0]))
    with pytest.raises(ValueError, match="name a stage's group as a\\+b"):
        open_model(ClusterConfig(model=str(default_model), tp=[2], nodes=["a:1"]))


def test_a_node_names_its_group_port_and_on_linux_no_rdma_devices():
    from mlxpipe.shards.net import announce, hello

    assert hello.rdma_devices() == ()
    assert "rdma" not in announce.properties("n", 1, "s")  # (a Mac with RDMA: its devices, in one short field)
    assert hello.reply("s", 1, "n", (), set(), group_port=4321).group_port == 4321


def test_health_metrics_and_status_show_each_group():
    from mlxpipe.proto import pipeline_pb2 as pb
    from mlxpipe.server.api.health import _stage
    from mlxpipe.server.api.metrics import Metrics
    from mlxpipe.server.cli.status import _groups
    from mlxpipe.server.cluster.stage_client import Placement

    st = Placement("10.0.0.1:1", 0, 30, ranks=["10.0.0.2:1"])
    reply = pb.HealthReply(state="ready", group_rank=0, group_size=2, allreduce_seconds=1e-4, allreduces_per_token=60,
                           stats=pb.StageStats(mirror_seconds=0.5, mirrored=10))
    st.rank_health = [("10.0.0.2:1", pb.HealthReply(state="ready", group_rank=1, group_size=2), "")]
    info, why = _stage(0, st, reply, "")
    assert not why and info["group"]["ranks"] == [{"rank": 0, "address": "10.0.0.1:1", "state": "ready"},
                                                   {"rank": 1, "address": "10.0.0.2:1", "state": "ready"}]
    assert info["group"]["allreduce_ms_per_token"] == pytest.approx(6.0)
    text = Metrics().render([(st, reply, "")], 0, 0).decode()
    assert 'mlxpipe_group_rank_up{address="10.0.0.2:1",rank="1",stage="0"} 1.0' in text
    assert 'mlxpipe_group_allreduce_seconds_per_token{stage="0"} 0.006' in text
    assert "a group of 2 ranks (0 10.0.0.1:1 ready, 1 10.0.0.2:1 ready); all-reduces 6.00 ms a token" in \
        _groups({"stages": [info]})


def test_a_load_naming_a_group_that_cannot_be_is_refused():
    from mlxpipe.proto import pipeline_pb2 as pb
    from mlxpipe.shards.worker.group import Spec

    ok = Spec.from_wire(pb.TensorGroup(rank=1, size=2, peers=["10.0.0.1:7", "10.0.0.2:7"]))
    assert (ok.rank, ok.size, ok.backend, ok.leader) == (1, 2, "ring", False)
    for group, why in ((pb.TensorGroup(rank=2, size=2, peers=["a:1", "b:1"]), "rank 2 of 2"),
                       (pb.TensorGroup(rank=0, size=3, peers=["a:1", "b:1"]), "with 2 peers"),
                       (pb.TensorGroup(rank=0, size=99, peers=["a:1"] * 99), "rank 0 of 99"),
                       (pb.TensorGroup(rank=0, size=2, peers=["a:1", "b:1"], backend="mpi"), "backend 'mpi'"),
                       (pb.TensorGroup(rank=0, size=2, peers=["a:1", "b"]), "host:port")):
        with pytest.raises(ValueError, match=why):
            Spec.from_wire(group)
