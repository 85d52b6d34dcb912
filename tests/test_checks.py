"""Nodes refused early with one line (versions, clock, no proof of the secret), Hello's proof
bound to the address dialled, and Echo behind the secret: on a real node process."""

from __future__ import annotations

import grpc
import pytest
from conftest import SECRET, node_process, run_async, stage_stub

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto.rpc import Security
from mlxpipe.server.cluster import checks
from mlxpipe.shards.net import hello, links


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    proc, address = node_process(tmp_path_factory.mktemp("checks"))
    assert address, proc.stderr.read()
    yield address
    proc.kill()
    proc.wait()


def test_a_node_proves_the_secret_for_its_own_address_only(node):
    facts = run_async(checks.ask(node, Security(secret=SECRET)))
    assert facts.proved and facts.versions == hello.versions() and abs(facts.clock_offset_s) < 5
    assert facts.reply.cluster == hello.cluster_id(SECRET) and facts.reply.memory_bytes > 0
    assert checks.refusal(facts, need_proof=True) is None
    other = run_async(checks.ask(node, Security(secret="another-secret-0123456789")))
    assert not other.proved  # its proof is for the node's secret, which is not this one
    assert checks.refusal(other, need_proof=True) == f"node {node} does not prove it holds this cluster's secret"
    # A head's question relayed from elsewhere (another address dialled): no proof at all.
    nonce = b"n" * 16
    reply = stage_stub(node, secret=None).Hello(pb.HelloRequest(), timeout=10, metadata=(
        (hello.NONCE_KEY, nonce.hex()), (hello.DIALLED_KEY, "10.9.9.9:50051")))
    assert reply.proof == b"" and reply.name
    reply = stage_stub(node, secret=None).Hello(pb.HelloRequest(), timeout=10, metadata=(
        (hello.NONCE_KEY, nonce.hex()), (hello.DIALLED_KEY, node)))
    assert hello.verify(SECRET, nonce, node, reply.proof)


def test_echo_needs_the_secret_and_times_a_hop(node):
    with pytest.raises(grpc.RpcError) as err:
        stage_stub(node, secret=None).Echo(pb.EchoRequest(payload=b"x"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

    async def timed():
        security = Security(secret=SECRET)
        async with security.channel(node) as channel:
            from mlxpipe.proto import pipeline_pb2_grpc as pb_grpc

            return await links.measure(pb_grpc.StageStub(channel), security.metadata(), 256, 1 << 20, node)

    f = run_async(timed())
    assert 0 < f.latency_s < 0.5 and f.bytes_per_s > 1e6 and f.samples == links.SMALL_REPEATS + links.LARGE_REPEATS


def test_refusals_name_the_node_and_what_differs():
    reply = pb.HelloReply(mlxpipe_version="0.0.1", mlx_version=hello.versions()["mlx"],
                          mlx_lm_version=hello.versions()["mlx_lm"])
    facts = checks.NodeFacts("10.0.0.2:50051", reply, True, 0.0)
    mine = hello.versions()["mlxpipe"]
    assert checks.refusal(facts, need_proof=True) == (f"node 10.0.0.2:50051 runs mlxpipe 0.0.1, this head mlxpipe "
                                                      f"{mine}: install the same versions")
    v = hello.versions()
    same = pb.HelloReply(mlxpipe_version=v["mlxpipe"], mlx_version=v["mlx"], mlx_lm_version=v["mlx_lm"])
    late = checks.NodeFacts("10.0.0.3:50051", same, True, -95.0)
    assert checks.refusal(late, need_proof=False) == ("node 10.0.0.3:50051's clock is -95 s from this head's (more "
                                                      "than 30 s): set both by network time")
    assert checks.refusal(checks.NodeFacts("a:1", same, False, 1.0), need_proof=False) is None
