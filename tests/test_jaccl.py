"""JACCL for a tensor-parallel group, wired as `mlx.launch` wires it, checked without Macs: the
device matrix the head builds from what each node says of its Thunderbolt cables
(server/cluster/tp_backend.py, shards/net/rdma.py), the environment a rank's MLX reads
(shards/worker/group.py), `--tp-backend auto` taking the ring here, a forced `jaccl` refused in one
line (by the head for a group without RDMA devices, by a node whose MLX has no JACCL), and the
planner pricing a cabled group's all-reduces at RDMA's figures. Nothing here opens an RDMA device:
that needs Macs with Thunderbolt 5 (docs/multi-mac.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_async

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.cluster import groupplan, tp_backend
from mlxpipe.server.cluster.cost import load_model_cost
from mlxpipe.server.cluster.linkplan import Links, parse_link
from mlxpipe.server.cluster.planner import NodeSpec, Workload
from mlxpipe.shards.net import rdma
from mlxpipe.shards.worker import group

DSV3 = Path(__file__).parent / "configs" / "deepseek_v3.json"


def _port(device, port, peer=""):
    return pb.RdmaPort(device=device, port=port, peer=peer)


# Three Macs cabled as a full mesh: a's en2 to b's en3, a's en3 to c's en2, b's en2 to c's en3.
MESH = [[_port("rdma_en2", "A2", "B3"), _port("rdma_en3", "A3", "C2")],
        [_port("rdma_en2", "B2", "C3"), _port("rdma_en3", "B3", "A2")],
        [_port("rdma_en2", "C2", "A3"), _port("rdma_en3", "C3", "B2")]]
NAMES = ["a:1", "b:1", "c:1"]


def test_the_device_matrix_says_which_device_on_each_rank_faces_each_other_rank():
    choice = tp_backend.choose("auto", MESH, NAMES)
    assert choice == tp_backend.Backend("jaccl", (("", "rdma_en2", "rdma_en3"),
                                                  ("rdma_en3", "", "rdma_en2"),
                                                  ("rdma_en2", "rdma_en3", "")))
    assert tp_backend.rdma_pairs(MESH) == {(0, 1), (0, 2), (1, 2)}
    # Two cables between a pair: both devices, comma-separated, as many as the least-cabled pair has.
    two = [[_port("rdma_en2", "A2", "B2"), _port("rdma_en3", "A3", "B3")],
           [_port("rdma_en2", "B2", "A2"), _port("rdma_en3", "B3", "A3")]]
    assert tp_backend.choose("auto", two, NAMES[:2]).rdma == (("", "rdma_en2,rdma_en3"), ("rdma_en2,rdma_en3", ""))


def test_auto_takes_the_ring_without_a_full_mesh_and_jaccl_forced_says_what_is_missing():
    chain = [MESH[0][:1], [MESH[1][1]], []]  # only a-b cabled; c reports no devices
    assert tp_backend.choose("auto", chain, NAMES) == tp_backend.Backend("ring")
    assert tp_backend.choose("auto", [[], []], NAMES[:2]) == tp_backend.Backend("ring")  # Linux: no devices
    assert tp_backend.choose("ring", MESH, NAMES) == tp_backend.Backend("ring")
    with pytest.raises(ValueError, match=r"^--tp-backend jaccl: the group a:1\+b:1\+c:1 is not a full RDMA mesh: "
                                         r"c:1 reported no RDMA devices"):
        tp_backend.choose("jaccl", chain, NAMES)
    uncabled = [MESH[0][:1], [MESH[1][1], _port("rdma_en2", "B2")], [_port("rdma_en2", "C2")]]
    with pytest.raises(ValueError, match="no Thunderbolt RDMA cable for a:1 -> c:1, b:1 -> c:1, c:1 -> a:1, "
                                         "c:1 -> b:1; cable every pair, or use --tp-backend ring"):
        tp_backend.choose("jaccl", uncabled, NAMES)


def test_a_rank_gets_the_environment_mlx_launch_would_give_it(monkeypatch):
    spec = group.Spec.from_wire(pb.TensorGroup(rank=1, size=2, peers=["10.0.0.1:7", "10.0.0.2:7"], backend="jaccl",
                                               rdma=[pb.RdmaRow(to=["", "rdma_en2,rdma_en3"]),
                                                     pb.RdmaRow(to=["rdma_en4", ""])]))
    env, path = group.backend_env(spec)
    try:
        assert env == {"MLX_RANK": "1", "MLX_IBV_DEVICES": path, "MLX_JACCL_COORDINATOR": "10.0.0.1:7"}
        assert json.loads(Path(path).read_text()) == [[None, ["rdma_en2", "rdma_en3"]], ["rdma_en4", None]]
    finally:
        os.unlink(path)
    ring = group.Spec(0, 2, ("10.0.0.1:7", "10.0.0.2:7"))
    env, path = group.backend_env(ring)
    try:
        assert env == {"MLX_RANK": "0", "MLX_HOSTFILE": path}
        assert json.loads(Path(path).read_text()) == [["10.0.0.1:7"], ["10.0.0.2:7"]]
    finally:
        os.unlink(path)
    for rows, why in (([], "is not 2 by 2"), ([["", ""], ["rdma_en4", ""]], "no device for ranks 0->1"),
                      ([["x", "y"], ["z", ""]], "from a rank to itself")):
        with pytest.raises(ValueError, match=why):
            group.Spec.from_wire(pb.TensorGroup(rank=0, size=2, peers=["a:1", "b:1"], backend="jaccl",
                                                rdma=[pb.RdmaRow(to=r) for r in rows]))


def test_a_node_whose_mlx_has_no_jaccl_refuses_a_jaccl_group_in_one_line():
    group.check_backend("ring")
    with pytest.raises(ValueError, match=r"^tensor group: this node's MLX [\d.]+ has no jaccl backend .*Linux\); "
                                         r"start the head with --tp-backend ring$"):
        group.check_backend("jaccl")


def test_thunderbolt_ports_are_read_as_mlx_distributed_config_reads_them():
    interfaces = rdma.hardware_ports("Hardware Port: Ethernet\nDevice: en0\nEthernet Address: x\n\n"
                                     "Hardware Port: Thunderbolt 1\nDevice: en2\n\n"
                                     "Hardware Port: Thunderbolt 2\nDevice: en3\n")
    assert interfaces == {"Ethernet": "en0", "Thunderbolt 1": "en2", "Thunderbolt 2": "en3"}
    profile = {"SPThunderboltDataType": [
        {"domain_uuid_key": "U1", "receptacle_1_tag": {"receptacle_id_key": "1"},
         "_items": [{"domain_uuid_key": "PEER1"}]},
        {"domain_uuid_key": "U2", "receptacle_1_tag": {"receptacle_id_key": "2"}},  # nothing cabled
        {"receptacle_1_tag": {"receptacle_id_key": "3"}}]}  # no domain: skipped
    assert rdma.thunderbolt_ports(profile, interfaces, ("rdma_en2", "rdma_en3")) == [
        rdma.Port("rdma_en2", "U1", "PEER1"), rdma.Port("rdma_en3", "U2", "")]
    assert rdma.thunderbolt_ports(profile, interfaces, ("rdma_en3",)) == [rdma.Port("rdma_en3", "U2", "")]
    assert rdma.ports() == ()  # Linux


def test_the_planner_prices_a_cabled_group_at_rdma_figures():
    """Two Macs the head timed over Ethernet: a pipeline, unless they are cabled for RDMA."""
    cost = load_model_cost(DSV3, bits=4)
    nodes = [NodeSpec(f"mac{i}", 512 * 10**9, bandwidth_bytes_per_s=800e9, flops_per_s=25e12) for i in range(2)]
    timed = Links.in_a_row(7168 * 2, [parse_link("1Gbps,1ms")], 2)

    def best(links):  # (every width taken as splittable: test_groupplan.py checks DeepSeek-V3's)
        return groupplan.choose(cost, nodes, links, 7168, lambda k: None, context=8192,
                                workload=Workload(0))[0].widths

    assert best(timed) == (1, 1)
    assert best(Links(timed.row_bytes, timed.head, timed.pairs, frozenset({(0, 1)}))) == (2,)
    assert groupplan._inner(Links(0, (), {}, frozenset({(0, 1)})), [1, 0]) == groupplan.RDMA


@pytest.mark.extended  # (starts a group's rank processes: 5-15 s; the refusal's logic is tested above)
def test_forcing_jaccl_on_this_machine_fails_at_group_start_with_one_line(default_model):
    """A real group start (`--stages 1 --tp 2 --tp-backend jaccl`): the head refuses before any Load."""
    from mlxpipe.server.cluster.assembly import Cluster
    from mlxpipe.server.config import ClusterConfig
    from mlxpipe.server.core.transport import PipelineError

    async def start():
        async with Cluster(ClusterConfig(model=str(default_model), stages=1, tp=[2], tp_backend="jaccl",
                                         split="even")):
            pass

    with pytest.raises(PipelineError) as err:
        run_async(start(), timeout=120)
    line = str(err.value)
    assert "\n" not in line and "--tp-backend jaccl: the group" in line and "reported no RDMA devices" in line, line
