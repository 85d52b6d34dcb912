"""The generated modules match pipeline.proto, and the codec round-trips and refuses."""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from google.protobuf import descriptor_pb2

from mlxpipe.proto import codec
from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto import pipeline_pb2_grpc as pb_grpc

PROTO_DIR = Path(__file__).resolve().parent.parent / "proto"


def _strip_json_names(messages):
    for m in messages:
        for f in m.field:
            f.ClearField("json_name")
        _strip_json_names(m.nested_type)


def test_generated_modules_are_not_stale():
    """Compile pipeline.proto now and compare with what the committed module holds.

    Compares the descriptors, not the text, so that a different grpcio-tools
    version does not count as stale; a changed .proto does."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        rc = protoc.main(["protoc", f"-Imlxpipe/proto={PROTO_DIR}", f"--descriptor_set_out={out}",
                          str(PROTO_DIR / "pipeline.proto")])
        assert rc == 0
        fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    _strip_json_names(fresh.message_type)  # protoc adds them; generated code leaves them out
    committed = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert fresh == committed, "proto/ is stale: run `python proto/generate.py`"
    methods = {m.name for m in fresh.service[0].method}
    assert methods == {n for n in dir(pb_grpc.StageServicer) if not n.startswith("_")}


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_codec_round_trip(dtype):
    x = (mx.arange(24).reshape(2, 3, 4) / 7).astype(dtype)
    t = codec.encode(x)
    assert t.dtype == codec.dtype_name(dtype) and list(t.shape) == [2, 3, 4]
    assert len(t.data) == 24 * x.itemsize
    y = codec.decode(t, expect_shape=(2, 3, 4))
    assert y.dtype == dtype and mx.array_equal(x, y).item()


@pytest.mark.parametrize("tensor,message", [
    (pb.Tensor(shape=[2, 2], dtype="float32", data=b"\0" * 15), "needs 16 bytes, got 15"),
    (pb.Tensor(shape=[2, 2], dtype="int64", data=b"\0" * 32), "'int64' is not allowed"),
    (pb.Tensor(shape=[2, -2], dtype="float32", data=b""), "not a valid shape"),
    (pb.Tensor(shape=[], dtype="float32", data=b""), "not a valid shape"),
    (pb.Tensor(shape=[1] * 9, dtype="float32", data=b"\0" * 4), "not a valid shape"),
    (pb.Tensor(shape=[2], dtype="float32", data=np.array([1, np.nan], "<f4").tobytes()), "not finite"),
    (pb.Tensor(shape=[2], dtype="float16", data=np.array([-np.inf, 0], "<f2").tobytes()), "not finite"),
    (pb.Tensor(shape=[1], dtype="bfloat16", data=np.array([0x7FC0], "<u2").tobytes()), "not finite"),
])
def test_codec_refuses_malformed_tensors(tensor, message):
    with pytest.raises(codec.WireError, match=message):
        codec.decode(tensor)


def test_codec_bytes_are_little_endian_model_dtype():
    t = codec.encode(mx.array([1.0, -2.0], dtype=mx.float16))
    assert t.data == np.array([1.0, -2.0], dtype="<f2").tobytes()


@pytest.mark.parametrize("dtype,edges", [
    (mx.float32, [3.4028235e38, -3.4028235e38, 1e-45, -0.0]),
    (mx.float16, [65504.0, -65504.0, 6e-8, -0.0]),
    (mx.bfloat16, [3.3895e38, -3.3895e38, 1e-40, -0.0]),
])
def test_codec_takes_every_finite_value_and_refuses_every_nonfinite_one(dtype, edges):
    """The finiteness check reads exponent bits: the largest finite values, subnormals and
    signed zeros pass; infinities and NaNs of either sign, with any payload, do not."""
    x = mx.array(edges, dtype=mx.float32).astype(dtype)
    assert mx.all(mx.isfinite(x)).item()
    assert mx.array_equal(codec.decode(codec.encode(x)), x).item()
    width = {mx.float32: np.uint32}.get(dtype, np.uint16)
    bits = np.frombuffer(codec.encode(x).data, dtype=width).copy()
    inf = np.frombuffer(codec.encode(mx.array([np.inf], dtype=mx.float32).astype(dtype)).data, dtype=width)[0]
    quiet = (inf >> 1) & ~inf  # the top mantissa bit
    for bad in (inf, inf | (1 << (8 * bits.itemsize - 1)), inf | 1, inf | quiet):  # +-inf, NaNs
        data = bits.copy()
        data[1] = bad
        t = pb.Tensor(shape=[len(edges)], dtype=codec.dtype_name(dtype), data=data.tobytes())
        with pytest.raises(codec.WireError, match="not finite"):
            codec.decode(t)


def test_codec_encodes_slices_and_transposes_in_c_order():
    x = mx.arange(24, dtype=mx.float32).reshape(2, 3, 4)
    for view in (x[:, -1, :], x.transpose(1, 0, 2), x[:, ::2]):
        t = codec.encode(view)
        assert t.data == np.asarray(view).tobytes(order="C")
        assert mx.array_equal(codec.decode(t), view).item()
