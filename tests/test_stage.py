"""A stage worker on its own: what it loads, and how it refuses bad input."""

from __future__ import annotations

import queue
import re

import grpc
import numpy as np
import pytest
from conftest import SECRET, stage_stub
from tiny_models import tensor_bytes

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.cluster.local import LocalStages

HIDDEN = 576


@pytest.fixture(scope="module")
def stage(default_model):
    local = LocalStages(1, SECRET, default_model.parent)
    (address,) = local.start()
    stub = stage_stub(address)
    stub.address = address
    yield stub
    local.stop()


def _layer_of(name: str):
    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


@pytest.mark.parametrize("start,end,with_embedding", [(10, 20, False), (0, 10, True)])
def test_stage_materializes_only_its_range(stage, default_model, start, end, with_embedding):
    # Any reachable successor makes this a middle stage (no head): here, itself.
    reply = stage.Load(pb.LoadRequest(model=str(default_model), start=start, end=end, next_address=stage.address))
    want = tensor_bytes(
        default_model,
        lambda n: (_layer_of(n) is not None and start <= _layer_of(n) < end)
        or (with_embedding and "embed_tokens" in n),
    )
    assert reply.model_bytes > 90e6
    assert abs(reply.weight_bytes - want) <= 0.02 * want + (1 << 20), (reply.weight_bytes, want)
    health = stage.Health(pb.HealthRequest())
    assert health.state == "ready" and (health.start, health.end) == (start, end)
    assert health.active_bytes <= want + (2 << 20) < reply.model_bytes


def _hidden(rows, n, dtype="float32", data=None):
    arr = np.zeros((rows, n, HIDDEN), dtype=np.float32)
    return pb.Tensor(shape=[rows, n, HIDDEN], dtype=dtype, data=arr.tobytes() if data is None else data)


def _prefill(seq_id, n, offset=0, sample=False, hidden=None):
    return pb.Frame(
        frame_id=seq_id * 100 + offset,
        kind=pb.Frame.PREFILL,
        seqs=[pb.SeqEntry(seq_id=seq_id, offset=offset, num_tokens=n, sample=sample)],
        tokens=[5] * n,
        hidden=hidden if hidden is not None else _hidden(1, n),
    )


BAD_FRAMES = [
    ("wrong byte count", _prefill(1, 3, hidden=_hidden(1, 3, data=b"\0" * 100)),
     grpc.StatusCode.INVALID_ARGUMENT, "needs 6912 bytes, got 100"),
    ("unknown dtype", _prefill(1, 3, hidden=_hidden(1, 3, dtype="float64")),
     grpc.StatusCode.INVALID_ARGUMENT, "'float64' is not allowed"),
    ("shape not matching the frame", _prefill(1, 3, hidden=_hidden(1, 2)),
     grpc.StatusCode.INVALID_ARGUMENT, "does not match the frame"),
    ("unknown sequence", pb.Frame(kind=pb.Frame.DECODE, seqs=[pb.SeqEntry(seq_id=999, offset=4, num_tokens=1)],
                                  tokens=[1], hidden=_hidden(1, 1)),
     grpc.StatusCode.NOT_FOUND, "unknown sequence 999"),
    ("token ids not matching the rows", pb.Frame(kind=pb.Frame.PREFILL, seqs=[pb.SeqEntry(seq_id=1, num_tokens=2)],
                                                 tokens=[1, 2, 3], hidden=_hidden(1, 2)),
     grpc.StatusCode.INVALID_ARGUMENT, "3 token ids for 1 x 2 positions"),
    ("no activations into a later stage", pb.Frame(kind=pb.Frame.PREFILL, seqs=[pb.SeqEntry(seq_id=1, num_tokens=1)],
                                                  tokens=[1]),
     grpc.StatusCode.INVALID_ARGUMENT, "must carry activations"),
    ("impossible sampling", pb.Frame(kind=pb.Frame.PREFILL, seqs=[pb.SeqEntry(
        seq_id=1, num_tokens=1, sample=True, sampling=pb.SamplingParams(temperature=-1))],
        tokens=[1], hidden=_hidden(1, 1)),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature must be in [0, 2]"),
    ("NaN sampling value", pb.Frame(kind=pb.Frame.PREFILL, seqs=[pb.SeqEntry(
        seq_id=1, num_tokens=1, sample=True, sampling=pb.SamplingParams(temperature=1, top_p=float("nan")))],
        tokens=[1], hidden=_hidden(1, 1)),
     grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in"),
    ("infinite logit bias", pb.Frame(kind=pb.Frame.PREFILL, seqs=[pb.SeqEntry(
        seq_id=1, num_tokens=1, sample=True, sampling=pb.SamplingParams(logit_bias={3: float("inf")}))],
        tokens=[1], hidden=_hidden(1, 1)),
     grpc.StatusCode.INVALID_ARGUMENT, "logit_bias values must be in"),
    ("NaN activations", _prefill(1, 3, hidden=_hidden(1, 3, data=np.full((1, 3, HIDDEN), np.nan, np.float32)
                                                     .tobytes())),
     grpc.StatusCode.INVALID_ARGUMENT, "not finite"),
    ("timings of too many stages", pb.Frame(kind=pb.Frame.PREFILL, seqs=[pb.SeqEntry(seq_id=1, num_tokens=1)],
                                            tokens=[1], hidden=_hidden(1, 1), timings=[pb.StageTiming()] * 257),
     grpc.StatusCode.INVALID_ARGUMENT, "timings of at most 256 stages"),
    ("infinite bfloat16 activations", _prefill(1, 2, hidden=_hidden(1, 2, dtype="bfloat16", data=np.full(
        (1, 2, HIDDEN), 0x7F80, np.uint16).tobytes())),
     grpc.StatusCode.INVALID_ARGUMENT, "not finite"),
]


def test_bad_frames_are_refused_and_the_stage_keeps_serving(stage, default_model):
    stage.Load(pb.LoadRequest(model=str(default_model), start=15, end=30))
    results = stage.Results(pb.ResultsRequest())
    for what, frame, code, message in BAD_FRAMES:
        with pytest.raises(grpc.RpcError) as info:
            stage.Forward(iter([frame]), timeout=30)
        assert info.value.code() == code, what
        assert message in info.value.details(), (what, info.value.details())
    # Still serving: a well-formed prefill samples a token.
    frames = queue.Queue()
    call = stage.Forward.future(iter(frames.get, None), timeout=60)
    frames.put(_prefill(7, 4))
    last = _prefill(7, 1, offset=4, sample=True)
    last.timings.add(compute_us=1234)  # as if an earlier stage had passed it on
    frames.put(last)
    first, second = next(results), next(results)
    assert not first.tokens and len(second.tokens) == 1 and 0 <= second.tokens[0].token < 49152
    # Each result carries the timings of the stages its frame passed, this one's last.
    assert len(first.timings) == 1 and first.timings[0].compute_us > 0
    assert [t.compute_us for t in second.timings][0] == 1234 and second.timings[1].compute_us > 0
    assert stage.Health(pb.HealthRequest()).live_seqs == [7]  # held while its stream is open
    assert stage.Free(pb.FreeRequest(seq_ids=[7])).freed == 1
    frames.put(_prefill(8, 2))
    next(results)
    frames.put(None)
    assert call.result().frames == 3
    assert stage.Health(pb.HealthRequest()).live_seqs == []  # a stream's sequences go with it
    results.cancel()


@pytest.mark.parametrize("request_kwargs,code,message", [
    (dict(start=20, end=40), grpc.StatusCode.INVALID_ARGUMENT, "not inside the model's [0, 30)"),
    (dict(start=5, end=5), grpc.StatusCode.INVALID_ARGUMENT, "is empty"),
    (dict(model="no-such-model", start=0, end=4), grpc.StatusCode.NOT_FOUND, "'no-such-model' not found"),
    (dict(model="/etc", start=0, end=4), grpc.StatusCode.NOT_FOUND, "'/etc' not found in this node's models"),
    (dict(model="../../../../etc", start=0, end=4), grpc.StatusCode.NOT_FOUND, "not found in this node's models"),
])
def test_bad_loads_are_refused(stage, default_model, request_kwargs, code, message):
    req = pb.LoadRequest(model=str(default_model))
    for k, v in request_kwargs.items():
        setattr(req, k, v)
    with pytest.raises(grpc.RpcError) as info:
        stage.Load(req, timeout=60)
    assert info.value.code() == code
    assert message in info.value.details()
    # The stage still loads and answers afterwards.
    reply = stage.Load(pb.LoadRequest(model=str(default_model), start=0, end=30), timeout=120)
    assert reply.num_layers == 30
    assert stage.Health(pb.HealthRequest()).state == "ready"
