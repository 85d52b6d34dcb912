"""A stage's memory (shards/worker/memory.py): what a shard needs before it loads, the refusal of one
that does not fit, and the process's real peak at two shard sizes."""

from __future__ import annotations

import grpc
import pytest
from conftest import stage_stub
from tiny_models import tensor_bytes

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.shards.params.quant import QuantSpec
from mlxpipe.shards.worker import memory

MiB = 1 << 20
# What a stage process holds besides its shard: the interpreter and its libraries
# (about 90 MiB here), MLX's allocator and warm-up's one token; see shards/worker/memory.py.
FIXED = 160 * MiB


def test_range_weights_come_from_the_headers(default_model):
    whole = memory.range_weights(default_model, 0, 30)
    assert whole.weights == tensor_bytes(default_model, lambda n: True)
    last = memory.range_weights(default_model, 29, 30)  # one layer, the final norm and the (tied) head
    assert last.weights == tensor_bytes(default_model, lambda n: ".layers.29." in n or "embed_tokens" in n
                                        or n.startswith("model.norm."))
    assert 0 < last.transient <= last.weights and whole.transient == last.transient  # the largest tensor


def test_quantized_weights_are_predicted_at_their_bits(sources):
    from mlxpipe.server.cluster.cost import load_model_cost

    src = sources("llama")
    cost = load_model_cost(src, quant=QuantSpec("4"))
    for start, end in ((0, 1), (1, cost.num_layers - 1), (1, cost.num_layers)):  # embedding, layers, head
        need = memory.range_weights(src, start, end, QuantSpec("4"))
        share = cost.stage_weight_bytes(start, end)
        assert abs(need.weights - share) <= 0.02 * share, (start, end, need.weights, share)
        assert need.transient > 0


def test_a_shard_that_does_not_fit_is_refused_with_the_figures():
    """Caches fill only once the stage serves: weights and the larger of KV budget and read transient."""
    need = memory.StageNeed(weights=60_000_000, kv=30_000_000, transient=5_000_000)
    need.check(90_000_000, "layers [0, 4)")
    with pytest.raises(memory.MemoryShort, match=r"layers \[0, 4\) needs 60.0 MB of weights \+ 30.0 MB of KV "
                                                 r"cache = 90.0 MB, more than the 89.0 MB this node offers"):
        need.check(89_000_000, "layers [0, 4)")
    reading = memory.StageNeed(weights=60_000_000, kv=0, transient=40_000_000)
    with pytest.raises(memory.MemoryShort, match=r"60.0 MB of weights \+ 40.0 MB more while reading = 100.0 MB"):
        reading.check(99_000_000, "layers [0, 4)")


def _node(tmp_path, name, *args):
    from conftest import node_process

    proc, address = node_process(tmp_path / name, "--models-dir", str(tmp_path.parent), *args)
    assert address, proc.stderr.read()
    return proc, stage_stub(address)


def test_a_stage_refuses_a_plan_over_its_memory_and_keeps_serving(tmp_path, default_model):
    proc, stub = _node(tmp_path, "small", "--models-dir", str(default_model.parent), "--memory", "60MB")
    try:
        for request, what in ((pb.LoadRequest(start=0, end=30), "of weights"),
                              (pb.LoadRequest(start=10, end=12, max_cache_bytes=100_000_000), "100.0 MB of KV")):
            request.model = str(default_model)
            with pytest.raises(grpc.RpcError) as info:
                stub.Load(request, timeout=60)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert what in info.value.details() and "more than the 60.0 MB this node offers" in info.value.details()
            assert stub.Health(pb.HealthRequest()).state == "empty"
        reply = stub.Load(pb.LoadRequest(model=str(default_model), start=10, end=12), timeout=60)
        assert reply.weight_bytes < 10e6 and reply.max_cache_bytes == 60_000_000 - reply.weight_bytes
    finally:
        proc.kill()
        proc.wait()


def test_load_peak_grows_with_the_shard_by_its_weights_only(tmp_path, default_model):
    """Fresh stage processes load one layer (and the head) or all 30: the process's peak is
    its weights, the read transient and a fixed overhead, whatever the shard. One more
    profiles the model first: the bandwidth probe stays within its 128 MiB."""
    peaks = {}
    for start, profile in ((29, False), (0, False), (29, True)):
        proc, stub = _node(tmp_path, f"s{start}{profile}", "--models-dir", str(default_model.parent))
        try:
            if profile:
                assert stub.Profile(pb.ProfileRequest(model=str(default_model), batch=2), timeout=300).layer_seconds
            reply = stub.Load(pb.LoadRequest(model=str(default_model), start=start, end=30), timeout=120)
        finally:
            proc.kill()
            proc.wait()
        need = memory.range_weights(default_model, start, 30)
        assert reply.peak_bytes <= need.weights + need.transient + FIXED + (128 * MiB if profile else 0), (
            reply.peak_bytes / MiB, need.weights / MiB)
        peaks[start, profile] = reply.peak_bytes - reply.weight_bytes  # all but the weights
    assert abs(peaks[0, False] - peaks[29, False]) <= 32 * MiB, {k: v / MiB for k, v in peaks.items()}
