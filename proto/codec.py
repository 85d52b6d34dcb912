"""Arrays to and from the wire: the one place that does it.

A tensor travels as shape + dtype name + raw little-endian bytes in C order.
Decoding checks everything before touching the bytes: the dtype is one we
allow, the shape is sane, and shape x itemsize equals the byte count; and
after decoding, that every value is finite (a NaN or infinity in the
activations would turn every later layer's output, and the sampled token,
into noise without any error).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from mlxpipe.proto import pipeline_pb2 as pb

# dtype name -> (mlx dtype, numpy dtype of the same width used to move the bytes)
_DTYPES = {
    "float32": (mx.float32, np.dtype("<f4")),
    "float16": (mx.float16, np.dtype("<f2")),
    "bfloat16": (mx.bfloat16, np.dtype("<u2")),  # numpy has no bfloat16: move as uint16
}
MAX_DIMS = 4


class WireError(ValueError):
    """A tensor on the wire that cannot be decoded; the message says why."""


def dtype_name(dtype: mx.Dtype) -> str:
    for name, (mxd, _) in _DTYPES.items():
        if mxd == dtype:
            return name
    raise WireError(f"dtype {dtype} cannot be sent (allowed: {sorted(_DTYPES)})")


def encode(x: mx.array) -> pb.Tensor:
    """An evaluated (or evaluable) array as a Tensor message."""
    name = dtype_name(x.dtype)
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    data = np.asarray(x).astype(_DTYPES[name][1], copy=False).tobytes()
    return pb.Tensor(shape=list(x.shape), dtype=name, data=data)


def decode(t: pb.Tensor, *, expect_shape: Sequence[int] | None = None) -> mx.array:
    """A Tensor message as an mx.array, after checking it is well formed.

    ``expect_shape`` (optional) must equal the tensor's shape exactly.
    """
    if t.dtype not in _DTYPES:
        raise WireError(
            f"tensor dtype {t.dtype!r} is not allowed (allowed: {sorted(_DTYPES)})"
        )
    shape = tuple(int(d) for d in t.shape)
    if not 1 <= len(shape) <= MAX_DIMS or any(d <= 0 for d in shape):
        raise WireError(f"tensor shape {list(shape)} is not a valid shape")
    if expect_shape is not None and shape != tuple(expect_shape):
        raise WireError(
            f"tensor shape {list(shape)} does not match the frame, expected {list(expect_shape)}"
        )
    mxd, npd = _DTYPES[t.dtype]
    want = int(np.prod(shape)) * npd.itemsize
    if len(t.data) != want:
        raise WireError(
            f"tensor of shape {list(shape)} and dtype {t.dtype} needs {want} bytes, got {len(t.data)}"
        )
    arr = mx.array(np.frombuffer(t.data, dtype=npd).reshape(shape))
    if mxd == mx.bfloat16:
        arr = arr.view(mx.bfloat16)
    if not mx.all(mx.isfinite(arr)).item():
        raise WireError("tensor values are not finite (NaN or infinity)")
    return arr
